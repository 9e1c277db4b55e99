"""A multi-rank cell's trainer: the leader mirrors every call to its followers.

``LeaderTrainer`` wraps rank 0's trainer and has the interface the cellrunner uses
(``EmbeddedTrainer``'s): each method first sends its command (``cellrunner.spmd``), then makes
the local call, which the followers make too. ``follow`` is ranks 1..n-1's whole life: receive a
command, make the same call, until ``exit``.

Gradients do not pass through the leader: ``send_grads`` has every rank push its own buffer to
its peer rank of the core, and ``apply_grads`` has every core rank take its peers' from its own
inbox, agree with the others that all are there and fit, and apply (``cellrunner.grads``).
Weights to train on go the same way: every core rank publishes its own shard after each start,
restore and apply, and ``start_from_peers`` has rank r of a satellite pull the core's rank r
(``cellrunner.rank_weights``). Only the HF-layout weights for serving leave through the leader.

A follower that fails a call logs it and goes on: the ranks take the same inputs, so a failure
the leader also sees (a refused gradient, non-finite values) is reported by the leader as any
command's error. A failure on one rank only leaves the others waiting in the next collective;
the leader then stops heartbeating and the controller drops the cell (and srun's
``--kill-on-bad-exit`` ends a step whose follower died).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from cellrunner.grads import GradExchange
from cellrunner.model import FlatWeights
from cellrunner.rank_weights import RankWeights
from cellrunner.spmd import Command, CommandChannel
from cellrunner.trainer import MicrostepResult
from base import wire
from base.checkpoints import Checkpoint

log = logging.getLogger(__name__)


@dataclass
class RankLinks:
    """What one rank of a multi-rank cell exchanges with the same rank of other cells."""

    grads: GradExchange
    weights: RankWeights

    def close(self) -> None:
        self.grads.close()
        self.weights.close()


class LeaderTrainer:
    def __init__(self, trainer: Any, channel: CommandChannel, links: RankLinks):
        self.trainer, self.channel, self.links = trainer, channel, links

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
        """Build the replica, or bring the core's back. A multi-rank satellite never loads the
        whole model: it starts from its peers' shards (``start_from_peers``)."""
        if weights is not None:
            raise ValueError("a multi-rank cell starts from its peers' shards (start_from_peers), not whole weights")
        self._everywhere("start")

    def start_from_peers(self, addrs: list[str], *, min_version: int, timeout_s: float) -> int:
        """Satellite: every rank loads its peer's shard of the core (``cellrunner.rank_weights``);
        returns the version loaded."""
        if len(addrs) != dist.get_world_size():
            raise ValueError(f"the core publishes {len(addrs)} rank shards, this cell has {dist.get_world_size()} ranks")
        return self._everywhere("start_peers", min_version=min_version, addrs=list(addrs), timeout_s=float(timeout_s))

    def stop(self) -> None:
        self._everywhere("stop")

    def weights(self) -> FlatWeights:
        return self._everywhere("weights")

    def microstep(self, shard: wire.Shard) -> MicrostepResult:
        # The followers decode the shard; the leader has it already (one decode per microstep saved).
        self.channel.send("microstep", shard=wire.encode(shard))
        return self.trainer.microstep(shard)

    def send_grads(self, addrs: list[str], *, cell_id: int, step: int) -> None:
        """Every rank sends its gradient to ``addrs[rank]`` (the core's ranks, in rank order)."""
        world = dist.get_world_size()
        if len(addrs) != world:
            raise ValueError(f"the core has {len(addrs)} gradient inboxes, this cell {world} ranks: layouts differ")
        self._everywhere("send_grads", step=step, cell_id=cell_id, addrs=list(addrs))

    def apply_grads(self, *, step: int, satellites: list[int], num_executions: int,
                    timeout_s: float) -> tuple[FlatWeights, float]:
        return self._everywhere("apply", step=step, satellites=list(satellites), num_executions=num_executions,
                                timeout_s=float(timeout_s))

    def save_checkpoint(self, directory: str) -> str:
        return self._everywhere("save_checkpoint", directory=str(directory))

    def restore(self, ckpt: Checkpoint) -> None:
        self._everywhere("restore", path=str(ckpt.path), version=ckpt.version)

    def _everywhere(self, op: str, **args: Any) -> Any:
        """Broadcast the command, then make the call here through the followers' own code path,
        so every rank runs the same thing."""
        self.channel.send(op, **args)
        return run_command(self.trainer, self.channel, self.links, Command(op, args))

    def close(self) -> None:
        """Let the followers go (they exit their loop)."""
        self.channel.send("exit")


def follow(trainer: Any, channel: CommandChannel, links: RankLinks) -> None:
    """A follower rank: mirror the leader's calls until it says ``exit``."""
    while True:
        cmd = channel.recv()
        if cmd.op == "exit":
            return
        try:
            run_command(trainer, channel, links, cmd)
        except Exception:  # the leader sees the same failure and reports it
            log.exception("follower: %s failed", cmd.op)


def run_command(trainer: Any, channel: CommandChannel, links: RankLinks, cmd: Command) -> Any:
    """One command on this rank (every rank of the cell runs it); returns the trainer's result."""
    a = cmd.args
    if cmd.op == "start":
        trainer.start(None)
        if trainer.is_core:
            links.weights.publish(trainer)
        return None
    if cmd.op == "start_peers":
        return links.weights.start(trainer, a["addrs"], min_version=a["min_version"], timeout_s=a["timeout_s"],
                                   channel=channel)
    if cmd.op == "stop":
        return trainer.stop()
    if cmd.op == "weights":
        return trainer.weights(everywhere=False)  # the leader publishes; no full copy on followers
    if cmd.op == "microstep":
        return trainer.microstep(wire.decode(a["shard"], expect=(wire.Shard,)))
    if cmd.op == "send_grads":
        return links.grads.send(trainer, a["addrs"], cell_id=a["cell_id"], step=a["step"], agree=channel.all_ok)
    if cmd.op == "apply":
        out = links.grads.apply(trainer, step=a["step"], satellites=a["satellites"],
                                num_executions=a["num_executions"], timeout_s=a["timeout_s"], agree=channel.all_ok)
        links.weights.publish(trainer)
        return out
    if cmd.op == "save_checkpoint":
        return trainer.save_checkpoint(a["directory"])
    if cmd.op == "restore":
        trainer.restore(Checkpoint(a["version"], Path(a["path"])))
        links.weights.publish(trainer)
        return None
    raise AssertionError(cmd.op)  # decode_command admits only COMMANDS
