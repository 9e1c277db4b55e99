"""Inside a multi-rank cell: the leader's commands to its followers, and the tensors they share.

Megatron is SPMD: every rank of a cell must make the same trainer call with the same arguments.
Only the leader (rank 0) hears the controller, so before each call it broadcasts a *command*: an
operation name and its arguments as MessagePack bytes (a shard travels as its wire frame), over
a gloo group of the cell, and the followers decode and check it like any frame off a wire.
Nothing here pickles: ``broadcast_object_list`` and friends would.

Bulk tensors use the cell's default group on the trainer's device (NCCL on GPUs, gloo on CPU):
the weights a satellite pulled reach every rank by one broadcast; a satellite's gradient is the
flat DDP buffers of its ranks gathered on the leader and concatenated in rank order, each buffer
once (DP replicas hold the same reduced gradient, so only the first of them sends); the core
scatters each satellite's concatenation back, so rank r adds what rank r (or its replica) of the
satellite computed (cells share one training layout, so rank r's buffer means the same thing in
every cell).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from controller import wire

MAX_COMMAND_BYTES = wire.MAX_FRAME_BYTES

# op -> its arguments and their types; a command with any other shape is refused
COMMANDS: dict[str, dict[str, type]] = {
    "start": {"weights_version": int},  # -1: no weights (build / bring back); else a broadcast follows
    "stop": {},
    "weights": {},
    "microstep": {"shard": bytes},  # wire.encode(shard)
    "take_grads": {},
    "apply": {"num_satellites": int, "num_executions": int},
    "save_checkpoint": {"directory": str},
    "restore": {"path": str, "version": int},
    "exit": {},
}


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
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise CommandError(f"{op}.{name}: want {kind.__name__}, got {type(value).__name__}")


class CommandChannel:
    """Rank 0 sends, every other rank receives, in the same order (a broadcast per command)."""

    def __init__(self, group: Any = None):
        # Commands are host bytes: a gloo group even when the default one is NCCL.
        self.group = group if group is not None else dist.new_group(backend="gloo")

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

    def flag(self, ok: bool | None = None) -> bool:
        """The leader's yes/no (``ok``), as every rank sees it: a refused command stops everywhere."""
        t = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.group)
        return bool(t.item())

    def gather_ints(self, local: int) -> list[int]:
        """Every rank's ``local`` integer, in rank order, on every rank."""
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, torch.tensor([local], dtype=torch.int64), group=self.group)
        return [int(p.item()) for p in parts]


def broadcast_flat(data: torch.Tensor | None, numel: int, device: torch.device) -> torch.Tensor:
    """Rank 0's float32 vector on every rank (``data`` on rank 0, None elsewhere)."""
    if dist.get_rank() == 0:
        assert data is not None and data.numel() == numel
        buf = data.reshape(-1).to(device=device, dtype=torch.float32).contiguous()
    else:
        buf = torch.empty(numel, dtype=torch.float32, device=device)
    dist.broadcast(buf, src=0)
    return buf


def gather_flat(local: np.ndarray, sizes: list[int], device: torch.device) -> np.ndarray | None:
    """Every rank's float32 vector (``sizes`` in rank order), concatenated on rank 0; None elsewhere."""
    width = max(sizes)
    mine = torch.zeros(width, dtype=torch.float32, device=device)
    mine[: local.size] = torch.from_numpy(local).to(device)
    if dist.get_rank() == 0:
        parts = [torch.empty(width, dtype=torch.float32, device=device) for _ in sizes]
        dist.gather(mine, parts, dst=0)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)]).cpu().numpy()
    dist.gather(mine, None, dst=0)
    return None


def scatter_chunks(chunks: list[np.ndarray] | None, sizes: list[int], device: torch.device) -> np.ndarray:
    """Rank r gets ``chunks[r]`` (of ``sizes[r]`` elements); ``chunks`` is given on rank 0, None elsewhere."""
    width, rank = max(max(sizes), 1), dist.get_rank()
    mine = torch.empty(width, dtype=torch.float32, device=device)
    if rank == 0:
        assert chunks is not None and [c.size for c in chunks] == sizes
        parts = []
        for c in chunks:
            part = torch.zeros(width, dtype=torch.float32, device=device)
            part[: c.size] = torch.from_numpy(np.ascontiguousarray(c, dtype=np.float32)).to(device)
            parts.append(part)
        dist.scatter(mine, parts, src=0)
    else:
        dist.scatter(mine, None, src=0)
    return mine[: sizes[rank]].cpu().numpy()


def owner_slices(keys: list[int], sizes: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Ranks whose buffers are copies of another's (equal ``keys``: DP replicas of one
    model-parallel rank) send nothing. Returns what each rank sends (its size, or 0) and, for every
    rank, the (offset, size) of its buffer in the concatenation of what was sent."""
    first = {}
    for r, k in enumerate(keys):
        first.setdefault(k, r)
    sent = [n if first[k] == r else 0 for r, (k, n) in enumerate(zip(keys, sizes))]
    offsets = np.concatenate([[0], np.cumsum(sent)]).tolist()
    where = []
    for r, k in enumerate(keys):
        owner = first[k]
        if sizes[owner] != sizes[r]:
            raise ValueError(f"ranks {owner} and {r} share a gradient key but not a size ({sizes[owner]} vs {sizes[r]})")
        where.append((int(offsets[owner]), sizes[r]))
    return sent, where
