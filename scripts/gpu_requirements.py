"""The GPU environment's requirement set: what ``make gpu-env`` (scripts/install_gpu.sh) installs,
one requirement a line, and what the GPU recipes run with.

It is the GPU stack's pins plus every dependency of Gyre's own (pyproject.toml) except those the
stack pins differently: sglang 0.5.23 pins torch 2.14.1 (its CUDA 13 build) and transformers 5.19.0,
where the CPU install pins torch 2.13.0+cpu and transformers >= 5.20. Everything else Gyre imports
(tensorboard for the default logger, prometheus-client, orjson, ...) comes from pyproject.toml, so
the two environments cannot drift apart by a forgotten name. tests/scripts/test_gpu_env.py checks
the set against the sglang wheel's own metadata.

    python scripts/gpu_requirements.py > reqs.txt     # stdlib only: runs on any Python 3.11
    python scripts/gpu_requirements.py --venv         # .venv-gpu
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GPU_VENV = ".venv-gpu"
"""Where install_gpu.sh puts the environment and where the GPU recipes (slurm/gyre_122b.sbatch,
slurm/gyre_2p4t.sbatch) and scripts/gpu_check.sh look for its Python by default."""

SGLANG = "sglang==0.5.23"
STACK = (
    SGLANG,
    # sglang 0.5.23's own pin (its wheel's Requires-Dist), named so the resolver cannot pick another
    # build and so a test can hold the two together: torch 2.14.1 from PyPI is the CUDA 13 build.
    "torch==2.14.1",
    "transformers==5.19.0",
    # Python 3.11 stops at megatron-core 0.16.1 (0.17+ needs 3.12), the CPU tests' version too.
    "megatron-core==0.16.1",
    # The CUDA 13 build of Mooncake, matching torch's CUDA: its engine.so links libcudart.so.13,
    # which torch's nvidia-cuda-runtime wheel brings. The plain `mooncake-transfer-engine` is the
    # CUDA 12 build (libcudart.so.12, absent next to a CUDA 13 torch). 0.3.13.post1: the version
    # the CPU build (mooncake-transfer-engine-non-cuda, the [cpu] extra) is tested with.
    "mooncake-transfer-engine-cuda13==0.3.13.post1",
)


def name_of(requirement: str) -> str:
    """The normalized project name of one requirement line (PEP 503: case, ``_`` and ``.`` fold to ``-``)."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not m:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def gyre_dependencies(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The stack's pins, then Gyre's own dependencies minus the names the stack pins."""
    pinned = {name_of(r) for r in STACK}
    rest = [r for r in gyre_dependencies(pyproject) if name_of(r) not in pinned]
    return [*STACK, *rest]


if __name__ == "__main__":
    if sys.argv[1:] == ["--venv"]:
        print(GPU_VENV)
    elif sys.argv[1:]:
        sys.exit("usage: gpu_requirements.py [--venv]")
    else:
        sys.stdout.write("".join(r + "\n" for r in requirements()))
