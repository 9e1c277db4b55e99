"""The ``logger`` config group (conf/logger/): any of tensorboard, wandb, prometheus, at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class TensorBoardConfig:
    subdir: str
    """Event files go to ``runs/<id>/<subdir>/``."""
    flush_secs: float
    """How stale the files may be for a TensorBoard watching the run live."""


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    project: str
    entity: str
    """'' for the key's default entity."""
    mode: Literal["auto", "online", "offline"]
    """auto: $WANDB_MODE when set, else online with an API key ($WANDB_API_KEY or a netrc login),
    else offline (``wandb sync runs/<id>/wandb/offline-run-*`` uploads it later)."""
    tags: list[str]


@dataclass(frozen=True, kw_only=True)
class PrometheusConfig:
    host: str
    """Address /metrics binds to: loopback by default; a node address for a site's scraper."""
    port: int
    """0 picks a free port; the URL is written to ``runs/<id>/prometheus.url`` and the log."""


@dataclass(frozen=True, kw_only=True)
class LoggerConfig:
    """Each is on when its option is chosen (``logger=[tensorboard,wandb,prometheus]``), else None."""

    tensorboard: TensorBoardConfig | None
    wandb: WandbConfig | None
    prometheus: PrometheusConfig | None
