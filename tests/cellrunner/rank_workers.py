"""Test support: run one worker script as the ranks of a cell (real processes, gloo on a free
port, torchrun's variables) and collect the JSON object each prints last."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def leave() -> None:
    """End a worker rank that finished its work as ``cellrunner.main`` ends a multi-rank cell: at
    once. The interpreter's teardown of a gloo process group whose peer has already left can abort
    ("terminate called without an active exception", exit -6); that is not what a test checks."""
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, args: list[str], *, world: int = 2, timeout: float = 240) -> list[dict]:
    """``python script *args`` as ranks 0..world-1; every rank must exit 0. Results in rank order."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, script, *args], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"rank {rank}: {err[-3000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results
