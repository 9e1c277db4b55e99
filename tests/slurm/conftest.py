"""Real local Slurm clusters (slurm/local-cluster.sh) for the tests.

`slurm_env`: the 8-node cluster n1..n8 with accounting, for the whole session. `up` is idempotent:
a cluster already up (CI's `.ci/run`, or a developer's) is used as it is and left up; one this
session started is taken down again. `long_slurm_env`: the 2.4T recipe's node count and name length
(192 nodes gyre-compute-node-0001..0192, no accounting) beside it, in its own directory and ports,
up for one module only. Missing Slurm binaries fail the session with the apt-get line to install
them; these tests are never skipped.
"""

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "slurm" / "local-cluster.sh"

LONG_PREFIX = "gyre-compute-node-"
LONG_NODES = 192
LONG_CLUSTER = {
    "SLURM_LOCAL_DIR": "/tmp/slurm-local-long", "SLURM_LOCAL_NODES": str(LONG_NODES),
    "SLURM_LOCAL_NODE_PREFIX": LONG_PREFIX, "SLURM_LOCAL_NODE_DIGITS": "4",
    "SLURM_LOCAL_PORT_OFFSET": "1000",  # 17817 slurmctld, 18001-18192 slurmd: clear of the 8-node cluster
    # 4 steps x 48 nodes start 192 slurmstepd at once: on 2 loaded cores a node's launch reply took
    # 30 s (2026-12-06), past Slurm's default 10 s, and srun then failed the step.
    "SLURM_LOCAL_MSG_TIMEOUT": "100",
    "WITH_DBD": "0",
    "ADD_HOSTS": "1",  # host=auto: a multi-rank cell resolves its first node's name (MASTER_ADDR)
}


def long_node(i: int) -> str:
    return f"{LONG_PREFIX}{i:04d}"


def _cluster(cmd: str, knobs: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(knobs or {})}
    return subprocess.run(["bash", str(SCRIPT), cmd], capture_output=True, text=True, timeout=300, env=env)


def _up(knobs: dict[str, str] | None = None) -> Iterator[dict[str, str]]:
    was_up = _cluster("status", knobs).returncode == 0
    up = _cluster("up", knobs)
    assert up.returncode == 0, f"slurm/local-cluster.sh up failed:\n{up.stderr}"
    env_line = _cluster("env", knobs).stdout.strip()
    assert env_line.startswith("export SLURM_CONF="), env_line
    yield {**os.environ, "SLURM_CONF": env_line.split("=", 1)[1], "PYTHONPATH": str(ROOT)}
    if not was_up:
        down = _cluster("down", knobs)
        assert down.returncode == 0, down.stderr


@pytest.fixture(scope="session")
def slurm_env() -> Iterator[dict[str, str]]:
    """The environment to run sbatch/srun/sacct/submitit against the local cluster."""
    yield from _up()


@pytest.fixture(scope="module")
def long_slurm_env() -> Iterator[dict[str, str]]:
    """The same against the 192-node cluster of long names (no sacct: wait with `sbatch --wait`)."""
    yield from _up(LONG_CLUSTER)
