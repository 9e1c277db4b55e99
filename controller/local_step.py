"""A multi-rank cell on this machine: what ``srun`` does for a Slurm cell, for local processes.

``python -m controller.local_step --cell-id C --ranks N --host H --dist-port P -- <cellrunner args>``
starts the cell's N ranks (``cellrunner.main`` with the variables of ``base.ranks``; rank 0
leads) and supervises them as one unit, like ``srun --kill-on-bad-exit``: the first rank that
fails has the others killed, SIGTERM reaches every rank (as ``scancel`` does a step's tasks: the
leader stops gracefully, the followers wait for its ``exit``), and the step's exit code is the
first failure's. The controller supervises this process as it would one cellrunner.

GPUs: when ``CUDA_VISIBLE_DEVICES`` is not set, cell C's ranks see GPUs ``C*N .. C*N+N-1`` (cells
side by side on one multi-GPU machine); each rank then takes ``LOCAL_RANK`` among them.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from base.ranks import rank_env
from base.lifecycle import PARENT_PID_ENV, exit_with_parent

KILL_AFTER_S = 150.0
"""After SIGTERM: longer than a follower's grace (cellrunner.follower.GRACE_S), so the leader's final
checkpoint can finish."""


def run_step(*, cell_id: int, ranks: int, host: str, dist_port: int, cell_args: list[str], poll_s: float = 0.2) -> int:
    base = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
    if "CUDA_VISIBLE_DEVICES" not in base:
        base["CUDA_VISIBLE_DEVICES"] = ",".join(str(cell_id * ranks + i) for i in range(ranks))
    procs = [
        subprocess.Popen([sys.executable, "-m", "cellrunner.main", *cell_args], env={**base, **rank_env(
            rank=r, world_size=ranks, ranks_per_node=ranks, master_addr=host, master_port=dist_port)})
        for r in range(ranks)
    ]
    stop_requested = False
    first_failure = 0

    def request_stop(*_: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    while True:
        codes = [p.poll() for p in procs]  # every one (any() would stop at the first live rank)
        if all(c is not None for c in codes):
            break
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:  # like srun --kill-on-bad-exit: the others would wait in a collective forever
            first_failure = failed[0][1]
            print(f"local_step: cell {cell_id} rank {failed[0][0]} exited with {failed[0][1]}: ending the cell",
                  flush=True)
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        if stop_requested:  # every rank at once, as scancel does; the leader stops gracefully
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + KILL_AFTER_S
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(poll_s)
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(poll_s)
    for p in procs:
        p.wait()
    return first_failure or next((p.returncode for p in procs if p.returncode), 0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cell-id", type=int, required=True)
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--host", required=True)
    ap.add_argument("--dist-port", type=int, required=True)
    ap.add_argument("cell_args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cell_args = args.cell_args[1:] if args.cell_args[:1] == ["--"] else args.cell_args
    exit_with_parent()
    sys.exit(run_step(cell_id=args.cell_id, ranks=args.ranks, host=args.host, dist_port=args.dist_port,
                      cell_args=cell_args))


if __name__ == "__main__":
    main()
