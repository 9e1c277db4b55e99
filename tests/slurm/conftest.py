"""A real local Slurm (slurm/local-cluster.sh) for the whole test session.

`up` is idempotent: a cluster already up (CI's `.ci/run`, or a developer's) is used as it is and
left up; one this session started is taken down again. Missing Slurm binaries fail the session
with the apt-get line to install them; these tests are never skipped.
"""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "slurm" / "local-cluster.sh"


def _cluster(cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), cmd], capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    """The environment to run sbatch/srun/sacct/submitit against the local cluster."""
    was_up = _cluster("status").returncode == 0
    up = _cluster("up")
    assert up.returncode == 0, f"slurm/local-cluster.sh up failed:\n{up.stderr}"
    env_line = _cluster("env").stdout.strip()
    assert env_line.startswith("export SLURM_CONF="), env_line
    env = {**os.environ, "SLURM_CONF": env_line.split("=", 1)[1], "PYTHONPATH": str(ROOT)}
    yield env
    if not was_up:
        down = _cluster("down")
        assert down.returncode == 0, down.stderr
