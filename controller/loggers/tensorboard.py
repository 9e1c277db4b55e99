"""TensorBoard event files under ``runs/<id>/tb/``, written by TensorBoard's own writer (through
``torch.utils.tensorboard``); ``tensorboard --logdir runs/<id>/tb`` watches the run live."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controller.loggers.config import TensorBoardConfig
from controller.loggers.scalars import ScalarView


class TensorBoardLogger:
    name = "tensorboard"

    def __init__(self, cfg: TensorBoardConfig, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (a dependency)

        self.dir = run_dir / cfg.subdir
        self.writer = SummaryWriter(log_dir=str(self.dir), flush_secs=max(int(cfg.flush_secs), 1))
        self.view = ScalarView()

    def event(self, kind: str, ev: dict[str, Any]) -> None:
        for s in self.view.scalars(kind, ev):
            # Both axes share TensorBoard's one integer step; the tag's prefix says which it is
            # (controller.loggers.scalars).
            self.writer.add_scalar(s.tag, s.value, global_step=s.x)

    def close(self) -> None:
        self.writer.close()
