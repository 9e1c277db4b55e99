"""Inside a multi-rank cell: the leader's commands to its followers, and the small collectives they share.

Megatron is SPMD: every rank of a cell must make the same trainer call with the same arguments.
Only the leader (rank 0) hears the controller, so before each call it broadcasts a *command*: an
operation name and its arguments as MessagePack bytes (a shard travels as its wire frame), over
a gloo group of the cell, and the followers decode and check it like any frame off a wire.
Nothing here pickles: ``broadcast_object_list`` and friends would.

Bulk tensors never pass through here or through the leader: each rank sends its gradient to,
and a satellite's rank pulls its weights from, the same rank of the core (``cellrunner.grads``,
``cellrunner.rank_weights``); here the ranks only agree that every one of them is done.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from base import wire

MAX_COMMAND_BYTES = wire.MAX_FRAME_BYTES

# op -> its arguments and their types; a command with any other shape is refused
COMMANDS: dict[str, dict[str, Any]] = {
    "start": {},  # build the replica or bring the core's back
    "stop": {},
    "weights": {},
    "microstep": {"shard": bytes},  # wire.encode(shard)
    # rank r pushes its gradient to addrs[r], the core's rank r (cellrunner.grads)
    "send_grads": {"step": int, "cell_id": int, "addrs": list[str]},
    # every rank takes the named satellites' gradients of step from its own inbox, then all apply or none
    "apply": {"step": int, "satellites": list[int], "num_executions": int, "timeout_s": float},
    # a satellite's rank r pulls addrs[r]'s shard, the core's rank r (cellrunner.rank_weights)
    "start_peers": {"min_version": int, "addrs": list[str], "timeout_s": float},
    "save_checkpoint": {"directory": str},
    "restore": {"path": str, "version": int},
    "exit": {},
}


Agree = Callable[[bool], list[int]]
"""Collective over a cell's ranks: given this rank's ok, the ranks that were not ok
(``CommandChannel.all_ok``; ``solo`` for a single-rank cell)."""


def solo(ok: bool) -> list[int]:
    return [] if ok else [0]


class CommandError(ValueError):
    """A command frame that is not one of ``COMMANDS`` with the right arguments."""


@dataclass(frozen=True, slots=True)
class Command:
    op: str
    args: dict[str, Any]


def encode_command(op: str, **args: Any) -> bytes:
    check_command(op, args)
    return msgpack.packb([op, args], use_bin_type=True)


def decode_command(data: bytes) -> Command:
    if len(data) > MAX_COMMAND_BYTES:
        raise CommandError(f"command: {len(data)} bytes is over the {MAX_COMMAND_BYTES} limit")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise CommandError(f"command: not MessagePack ({type(exc).__name__}: {exc})") from None
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str) and isinstance(obj[1], dict)):
        raise CommandError("command: want [op, {args}]")
    op, args = obj
    check_command(op, args)
    return Command(op, args)


def check_command(op: str, args: dict[str, Any]) -> None:
    want = COMMANDS.get(op)
    if want is None:
        raise CommandError(f"command: unknown op {op!r}")
    if set(args) != set(want):
        raise CommandError(f"{op}: want arguments {sorted(want)}, got {sorted(map(str, args))}")
    for name, kind in want.items():
        value = args[name]
        if typing.get_origin(kind) is list:
            item = typing.get_args(kind)[0]
            if not isinstance(value, list) or not all(_is(v, item) for v in value):
                raise CommandError(f"{op}.{name}: want a list of {item.__name__}")
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = args[name] = float(value)
        if not _is(value, kind):
            raise CommandError(f"{op}.{name}: want {kind.__name__}, got {type(value).__name__}")


def _is(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


class CommandChannel:
    """Rank 0 sends, every other rank receives, in the same order (a broadcast per command)."""

    def __init__(self, group: Any = None, *, timeout_s: float | None = None):
        """``timeout_s``: how long a follower's ``recv`` (and every collective here) may wait, the
        cell's ``trainer.command_timeout_s``; None keeps torch's default (30 minutes for gloo),
        shorter than a cell may serve while its followers wait for the next command."""
        # Commands are host bytes: a gloo group even when the default one is NCCL.
        if group is None:
            timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
            group = dist.new_group(backend="gloo", timeout=timeout)
        self.group = group

    def send(self, op: str, **args: Any) -> None:
        data = encode_command(op, **args)
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.group)

    def recv(self) -> Command:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        n = int(size.item())
        if not 0 < n <= MAX_COMMAND_BYTES:
            raise CommandError(f"command: size {n} out of range")
        buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return decode_command(buf.numpy().tobytes())

    def all_ok(self, ok: bool) -> list[int]:
        """Collective: the ranks whose ``ok`` was False (none: every rank may go on)."""
        return [r for r, v in enumerate(self.gather_ints(1 if ok else 0)) if not v]

    def gather_strings(self, local: str) -> list[str]:
        """Every rank's ``local`` string, in rank order, on every rank."""
        data = local.encode()
        sizes = self.gather_ints(len(data))
        width = max(max(sizes), 1)
        mine = torch.zeros(width, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.zeros(width, dtype=torch.uint8) for _ in sizes]
        dist.all_gather(parts, mine, group=self.group)
        return [p[:n].numpy().tobytes().decode() for p, n in zip(parts, sizes)]

    def gather_ints(self, local: int) -> list[int]:
        """Every rank's ``local`` integer, in rank order, on every rank."""
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, torch.tensor([local], dtype=torch.int64), group=self.group)
        return [int(p.item()) for p in parts]
