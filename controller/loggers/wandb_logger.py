"""Weights & Biases, online with a key and offline without (``wandb sync`` uploads it later).

W&B wants one monotonic step per run, and Gyre's figures have two axes (controller.loggers.scalars):
each is declared as its own step metric, so per-step charts read against ``step`` and live ones
against ``elapsed_s``, and wandb's internal step is never passed."""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path
from typing import Any

from controller.loggers.config import WandbConfig
from controller.loggers.scalars import ScalarView

log = logging.getLogger(__name__)

INSTALL_HINT = "logger=wandb needs the wandb package: `pip install 'gyre[wandb]'` (or `pip install wandb`)"


def resolve_mode(mode: str) -> str:
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY") or _netrc_login():
        return "online"
    return "offline"


def _netrc_login() -> bool:
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbLogger:
    name = "wandb"

    def __init__(self, cfg: WandbConfig, run_dir: Path, run_config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError(INSTALL_HINT) from exc
        mode = resolve_mode(cfg.mode)
        log.info("wandb: %s mode, project %s, files under %s", mode, cfg.project, run_dir / "wandb")
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity or None, name=run_dir.name, id=_run_id(run_dir.name),
            dir=str(run_dir), mode=mode, tags=list(cfg.tags), config=run_config, resume="allow",
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        for axis, prefixes in (("step", ("train", "eval", "tokens", "staleness", "proxy")),
                               ("elapsed_s", ("water", "cells", "switch", "microstep", "executions", "shard", "weights"))):
            self.run.define_metric(axis)
            for p in prefixes:
                self.run.define_metric(f"{p}/*", step_metric=axis)
        self.view = ScalarView()

    def event(self, kind: str, ev: dict[str, Any]) -> None:
        scalars = self.view.scalars(kind, ev)
        if not scalars:
            return
        row: dict[str, float] = {s.tag: s.value for s in scalars}
        row["step" if scalars[0].axis == "step" else "elapsed_s"] = scalars[0].x
        self.run.log(row)

    def close(self) -> None:
        self.run.finish()


def _run_id(name: str) -> str:
    """W&B ids allow letters, digits, '-' and '_'; a requeued job resumes the same W&B run."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:64]
