"""Where a run's figures go besides metrics.jsonl: TensorBoard, W&B, Prometheus (conf/logger).

Every logger takes the same events the controller writes to metrics.jsonl (``event(kind, fields)``)
and maps them to scalars through ``scalars.ScalarView``, so the three show the same figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from controller.loggers.config import LoggerConfig


class Logger(Protocol):
    name: str

    def event(self, kind: str, ev: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def build_loggers(cfg: LoggerConfig, run_dir: Path, run_config: Any = None) -> list[Logger]:
    """The chosen loggers, started (a W&B run opened, a /metrics port bound)."""
    loggers: list[Logger] = []
    if cfg.tensorboard is not None:
        from controller.loggers.tensorboard import TensorBoardLogger

        loggers.append(TensorBoardLogger(cfg.tensorboard, run_dir))
    if cfg.wandb is not None:
        from controller.loggers.wandb_logger import WandbLogger
        from base.typed_config import to_dict

        loggers.append(WandbLogger(cfg.wandb, run_dir, to_dict(run_config) if run_config is not None else {}))
    if cfg.prometheus is not None:
        from controller.loggers.prometheus import PrometheusLogger

        loggers.append(PrometheusLogger(cfg.prometheus, run_dir))
    return loggers
