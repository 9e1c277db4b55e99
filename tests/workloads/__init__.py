"""Helpers shared by the workload tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from base.typed_config import build
from workloads.config import SandboxConfig

ROOT = Path(__file__).resolve().parents[2]


def sandbox_config(kind: str, **over) -> SandboxConfig:
    """conf/sandbox/<kind>.yaml, typed, with ``over`` replaced."""
    cfg = build(SandboxConfig, yaml.safe_load((ROOT / "conf" / "sandbox" / f"{kind}.yaml").read_text()))
    return dataclasses.replace(cfg, **over)
