"""A multi-rank cell's followers wait for the leader's next command on a gloo group through every
serving phase: the group gets ``trainer.command_timeout_s``, not torch's 30-minute default."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bench.switch import load_config
from cellrunner import follower, main, spmd
from cellrunner.backends import CellRunnerConfig
from base.ranks import CellRanks
from base import curve
from controller.controller import cellrunner_config
from base.typed_config import build

TIMEOUT_S = 3 * 24 * 3600.0


def group_timeout(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def test_the_command_group_gets_the_configured_timeout() -> None:
    if not dist.is_initialized():  # a one-rank world, as a one-process Megatron cell starts
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert group_timeout(spmd.CommandChannel(timeout_s=TIMEOUT_S).group) == timedelta(seconds=TIMEOUT_S)
    assert group_timeout(spmd.CommandChannel().group) == timedelta(minutes=30)  # torch's, what it was


def megatron_cell_cfg(tmp_path: Path) -> CellRunnerConfig:
    cfg = load_config(["trainer=megatron", f"trainer.command_timeout_s={TIMEOUT_S}"])
    return build(CellRunnerConfig, cellrunner_config(cfg, checkpoint_dir=tmp_path / "ck", log_dir=tmp_path))


class Made(Exception):
    pass


def test_leader_and_followers_open_their_channel_with_the_configs_timeout(tmp_path, monkeypatch) -> None:
    """Both ends of a multi-rank cell (the leader's CellRunner, a follower) pass the timeout on;
    the trainer and the links are stand-ins, the channel is where the test stops."""
    cfg = megatron_cell_cfg(tmp_path)
    assert cfg.trainer.command_timeout_s == TIMEOUT_S
    seen = []

    def channel(*args, **kwargs):
        seen.append(kwargs.get("timeout_s"))
        raise Made

    monkeypatch.setattr(curve, "_keys", None)
    for mod in (main, follower):
        monkeypatch.setattr(mod, "make_trainer", lambda *a, **k: object())
        monkeypatch.setattr(mod, "CommandChannel", channel)
    monkeypatch.setattr(follower, "make_node_engine", lambda *a, **k: None)
    monkeypatch.setattr(follower, "stop_on_signal", lambda *a, **k: None)
    ranks = [CellRanks(rank=r, world_size=2, local_rank=r, node_rank=0, nnodes=1, master_addr="127.0.0.1")
             for r in (0, 1)]
    try:
        main.CellRunner(cfg, 0, "tcp://127.0.0.1:9", ranks[0])
    except Made:
        pass
    try:
        follower.run_follower(cfg, 0, ranks[1], 300)
    except Made:
        pass
    assert seen == [TIMEOUT_S, TIMEOUT_S]
