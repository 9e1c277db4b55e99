"""Start and supervise the local child processes: processor, proxy, cellrunners.

Each child logs to ``runs/<id>/logs/<name>.log`` and announces readiness by writing a small JSON
file; a child that dies before that fails the start with the tail of its log. Cells start through
a ``CellLauncher``: ``LocalCells`` here, ``controller.slurm_launch.SlurmCells`` as srun steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol

from base.lifecycle import PARENT_PID_ENV

PROJECT_ROOT = Path(__file__).resolve().parent.parent


class StartError(RuntimeError):
    pass


def python_path() -> str:
    """The project first, then whatever the user's PYTHONPATH held (site additions survive)."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(PROJECT_ROOT)]
    return os.pathsep.join([str(PROJECT_ROOT), *kept])


def spawn(name: str, module: str, args: list[str], log_dir: Path) -> subprocess.Popen:
    log_dir.mkdir(parents=True, exist_ok=True)
    out = open(log_dir / f"{name}.log", "wb")
    env = {**os.environ, "PYTHONPATH": python_path(), "PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid())}
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, env=env, start_new_session=True,
    )
    out.close()
    return proc


class CellLauncher(Protocol):
    def launch(self, cell_id: int, cell_args: list[str], log_dir: Path) -> subprocess.Popen:
        """Start cell ``cell_id``'s cellrunner with ``cell_args``, logging to ``log_dir/cell<id>.log``.
        The result is polled, signalled and killed like any child; its exit drops the cell."""
        ...


class LocalCells:
    """Every cell is a child process on this machine (``cluster.kind: local``); a cell of several
    ranks (``cluster.ranks_per_node``) is a ``controller.local_step`` that runs and supervises them."""

    def __init__(self, ranks_per_node: int = 1, dist_port: int = 29500, host: str = "127.0.0.1"):
        self.ranks_per_node, self.dist_port, self.host = ranks_per_node, dist_port, host

    def launch(self, cell_id: int, cell_args: list[str], log_dir: Path) -> subprocess.Popen:
        if self.ranks_per_node == 1:
            return spawn(f"cell{cell_id}", "cellrunner.main", cell_args, log_dir)
        step = ["--cell-id", str(cell_id), "--ranks", str(self.ranks_per_node), "--host", self.host,
                "--dist-port", str(self.dist_port + cell_id)]
        return spawn(f"cell{cell_id}", "controller.local_step", [*step, "--", *cell_args], log_dir)


def log_tail(log_dir: Path, name: str, num_lines: int = 20) -> str:
    try:
        lines = (log_dir / f"{name}.log").read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-num_lines:])


def wait_ready(name: str, proc: subprocess.Popen, ready_file: Path, log_dir: Path, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready_file.exists():
            try:
                return json.loads(ready_file.read_text())
            except json.JSONDecodeError:
                pass  # half-written; the child writes it once, try again
        if proc.poll() is not None:
            raise StartError(f"{name} exited with {proc.returncode} before it was ready:\n{log_tail(log_dir, name)}")
        time.sleep(0.05)
    raise StartError(f"{name} not ready after {timeout_s}s:\n{log_tail(log_dir, name)}")


def stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)

