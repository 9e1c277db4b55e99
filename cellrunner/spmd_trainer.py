"""A multi-rank cell's trainer: the leader mirrors every call to its followers.

``LeaderTrainer`` wraps rank 0's trainer and has the interface the cellrunner uses
(``EmbeddedTrainer``'s): each method first sends its command (``cellrunner.spmd``), then makes
the local call, which the followers make too. ``follow`` is ranks 1..n-1's whole life: receive a
command, make the same call, until ``exit``.

Gradients do not pass through the leader: ``send_grads`` has every rank push its own buffer to
its peer rank of the core, and ``apply_grads`` has every core rank take its peers' from its own
inbox, agree with the others that all are there and fit, and apply (``cellrunner.grads``). A
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

import torch.distributed as dist

from cellrunner.grads import GradExchange
from cellrunner.model import FlatWeights, num_elements
from cellrunner.spmd import Command, CommandChannel, broadcast_flat
from cellrunner.trainer import MicrostepResult
from controller import wire
from controller.checkpoints import Checkpoint

log = logging.getLogger(__name__)


class LeaderTrainer:
    def __init__(self, trainer: Any, channel: CommandChannel):
        self.trainer, self.channel = trainer, channel

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

    def grad_numel(self) -> int:
        return self.trainer.grad_numel()

    def send_grads(self, exchange: GradExchange, addrs: list[str], *, cell_id: int, step: int) -> None:
        """Every rank sends its gradient to ``addrs[rank]`` (the core's ranks, in rank order)."""
        world = dist.get_world_size()
        if len(addrs) != world:
            raise ValueError(f"the core has {len(addrs)} gradient inboxes, this cell {world} ranks: layouts differ")
        self.channel.send("send_grads", step=step, cell_id=cell_id, addrs=list(addrs))
        exchange.send(self.trainer, addrs, cell_id=cell_id, step=step, agree=self.channel.all_ok)

    def apply_grads(self, exchange: GradExchange, *, step: int, num_satellites: int, num_executions: int,
                    timeout_s: float) -> tuple[FlatWeights, float]:
        self.channel.send("apply", step=step, num_satellites=num_satellites, num_executions=num_executions,
                          timeout_s=float(timeout_s))
        out = exchange.apply(self.trainer, step=step, num_satellites=num_satellites, num_executions=num_executions,
                             timeout_s=timeout_s, agree=self.channel.all_ok)
        assert out is not None
        return out

    def save_checkpoint(self, directory: str) -> str:
        self.channel.send("save_checkpoint", directory=str(directory))
        return self.trainer.save_checkpoint(directory)

    def restore(self, ckpt: Checkpoint) -> None:
        self.channel.send("restore", path=str(ckpt.path), version=ckpt.version)
        self.trainer.restore(ckpt)

    def close(self) -> None:
        """Let the followers go (they exit their loop)."""
        self.channel.send("exit")


def follow(trainer: Any, channel: CommandChannel, exchange: GradExchange) -> None:
    """A follower rank: mirror the leader's calls until it says ``exit``."""
    while True:
        cmd = channel.recv()
        if cmd.op == "exit":
            return
        try:
            run_command(trainer, channel, exchange, cmd)
        except Exception:  # the leader sees the same failure and reports it
            log.exception("follower: %s failed", cmd.op)


def run_command(trainer: Any, channel: CommandChannel, exchange: GradExchange, cmd: Command) -> None:
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
    elif cmd.op == "send_grads":
        exchange.send(trainer, a["addrs"], cell_id=a["cell_id"], step=a["step"], agree=channel.all_ok)
    elif cmd.op == "apply":
        exchange.apply(trainer, step=a["step"], num_satellites=a["num_satellites"],
                       num_executions=a["num_executions"], timeout_s=a["timeout_s"], agree=channel.all_ok)
    elif cmd.op == "save_checkpoint":
        trainer.save_checkpoint(a["directory"])
    elif cmd.op == "restore":
        trainer.restore(Checkpoint(a["version"], Path(a["path"])))
    else:  # decode_command admits only COMMANDS
        raise AssertionError(cmd.op)


def spec_key(specs: Any) -> list[tuple[str, tuple[int, ...], int]]:
    return [(s.name, tuple(s.shape), s.offset) for s in specs]
