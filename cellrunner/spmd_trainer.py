"""A multi-rank cell's trainer: the leader mirrors every call to its followers.

``LeaderTrainer`` wraps rank 0's trainer and has the interface the cellrunner uses
(``EmbeddedTrainer``'s): each method first sends its command (``cellrunner.spmd``), then makes
the local call, which the followers make too. ``follow`` is ranks 1..n-1's whole life: receive a
command, make the same call, until ``exit``.

Gradients leave and enter a cell through its leader: ``take_grads`` returns the ranks' buffers
concatenated in rank order, DP replicas' identical copies left out, and ``apply`` scatters each
satellite's concatenation so that rank r adds rank r's part (a replica gets its original's). A
satellite's weights come in at the leader and are broadcast.

A follower that fails a call logs it and goes on: the ranks take the same inputs, so a failure
the leader also sees (a refused gradient, non-finite values) is reported by the leader as any
command's error. A failure on one rank only leaves the others waiting in the next collective;
the leader then stops heartbeating and the controller drops the cell (and srun's
``--kill-on-bad-exit`` ends a step whose follower died).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from cellrunner.model import FlatWeights, num_elements
from cellrunner.spmd import (
    Command, CommandChannel, broadcast_flat, gather_flat, owner_slices, scatter_chunks,
)
from cellrunner.trainer import MicrostepResult
from controller import wire
from controller.checkpoints import Checkpoint

log = logging.getLogger(__name__)


class LeaderTrainer:
    def __init__(self, trainer: Any, channel: CommandChannel):
        self.trainer, self.channel = trainer, channel
        self.rank_sizes: list[int] = []
        """Each rank's share of the last ``take_grads``, in rank order."""

    # what the cellrunner reads
    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def num_microsteps(self) -> int:
        return self.trainer.num_microsteps

    @property
    def model(self) -> Any:
        return self.trainer.model

    def start(self, weights: FlatWeights | None) -> None:
        # The followers rebuild the weights on their own specs, so the layout must be the same
        # (names, shapes and offsets), checked before anything is sent.
        if weights is not None and spec_key(weights.specs) != spec_key(self.trainer.specs):
            raise ValueError("weights: manifest does not match this cell's model")
        self.channel.send("start", weights_version=-1 if weights is None else weights.version)
        if weights is not None:
            data = broadcast_flat(weights.tensor(), weights.num_elements, self.trainer.device)
            weights = FlatWeights(weights.version, self.trainer.specs, data)
        self.trainer.start(weights)

    def stop(self) -> None:
        self.channel.send("stop")
        self.trainer.stop()

    def weights(self) -> FlatWeights:
        self.channel.send("weights")
        return self.trainer.weights()

    def microstep(self, shard: wire.Shard) -> MicrostepResult:
        self.channel.send("microstep", shard=wire.encode(shard))
        return self.trainer.microstep(shard)

    def take_grads(self) -> np.ndarray:
        self.channel.send("take_grads")
        full, self.rank_sizes = take_grads_everywhere(self.trainer, self.channel)
        assert full is not None
        return full

    def apply(self, satellite_grads: list[np.ndarray], num_executions: int) -> tuple[FlatWeights, float]:
        self.channel.send("apply", num_satellites=len(satellite_grads), num_executions=num_executions)
        sent, where = grad_layout(self.trainer, self.channel)
        bad = [g.size for g in satellite_grads if g.shape != (sum(sent),)]
        # Checked before anything moves: a refused step leaves every rank's gradients as they were.
        if not self.channel.flag(not bad):
            raise ValueError(f"satellite gradient has {bad[0]} elements, want {sum(sent)} (sent by this cell's ranks: {sent})")
        mine = []
        for g in satellite_grads:
            g = np.ascontiguousarray(g, dtype=np.float32)
            chunks = [g[off: off + n] for off, n in where]
            mine.append(scatter_chunks(chunks, [n for _, n in where], self.trainer.device))
        return self.trainer.apply(mine, num_executions)

    def save_checkpoint(self, directory: str) -> str:
        self.channel.send("save_checkpoint", directory=str(directory))
        return self.trainer.save_checkpoint(directory)

    def restore(self, ckpt: Checkpoint) -> None:
        self.channel.send("restore", path=str(ckpt.path), version=ckpt.version)
        self.trainer.restore(ckpt)

    def close(self) -> None:
        """Let the followers go (they exit their loop)."""
        self.channel.send("exit")


def follow(trainer: Any, channel: CommandChannel) -> None:
    """A follower rank: mirror the leader's calls until it says ``exit``."""
    while True:
        cmd = channel.recv()
        if cmd.op == "exit":
            return
        try:
            run_command(trainer, channel, cmd)
        except Exception:  # the leader sees the same failure and reports it
            log.exception("follower: %s failed", cmd.op)


def run_command(trainer: Any, channel: CommandChannel, cmd: Command) -> None:
    a = cmd.args
    if cmd.op == "start":
        weights = None
        if a["weights_version"] >= 0:
            data = broadcast_flat(None, num_elements(trainer.specs), trainer.device)
            weights = FlatWeights(a["weights_version"], trainer.specs, data)
        trainer.start(weights)
    elif cmd.op == "stop":
        trainer.stop()
    elif cmd.op == "weights":
        trainer.weights()
    elif cmd.op == "microstep":
        shard = wire.decode(a["shard"], expect=(wire.Shard,))
        trainer.microstep(shard)
    elif cmd.op == "take_grads":
        take_grads_everywhere(trainer, channel)
    elif cmd.op == "apply":
        _, where = grad_layout(trainer, channel)
        if not channel.flag():
            return
        mine = [scatter_chunks(None, [n for _, n in where], trainer.device) for _ in range(a["num_satellites"])]
        trainer.apply(mine, a["num_executions"])
    elif cmd.op == "save_checkpoint":
        trainer.save_checkpoint(a["directory"])
    elif cmd.op == "restore":
        trainer.restore(Checkpoint(a["version"], Path(a["path"])))
    else:  # decode_command admits only COMMANDS
        raise AssertionError(cmd.op)


def spec_key(specs: Any) -> list[tuple[str, tuple[int, ...], int]]:
    return [(s.name, tuple(s.shape), s.offset) for s in specs]


def grad_layout(trainer: Any, channel: CommandChannel) -> tuple[list[int], list[tuple[int, int]]]:
    """Every rank's part in the cell's gradient vector (collective): what each sends, and where
    each rank's own buffer sits in the concatenation."""
    keys = channel.gather_ints(trainer.grad_owner_key())
    return owner_slices(keys, channel.gather_ints(trainer.grad_numel()))


def take_grads_everywhere(trainer: Any, channel: CommandChannel) -> tuple[np.ndarray | None, list[int]]:
    """Collective: the cell's gradient on the leader (None elsewhere), and what each rank sent."""
    local = trainer.take_grads()
    sent, _ = grad_layout(trainer, channel)
    mine = local if sent[dist.get_rank()] else local[:0]
    return gather_flat(mine, sent, trainer.device), sent
