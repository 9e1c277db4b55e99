"""The controller's cell launch, alone, inside a Slurm job: ``python -m tests.slurm.launch_shape OUT``.

What controller/controller.py does with ``cluster=slurm``, minus everything else: read the job's
node list with ``SlurmCells.from_env``, write the shared cellrunner config (``host: auto``, as the big
recipes set it), and start every cell with ``SlurmCells.launch`` as its own srun step, with the
controller's argument shape. Then it waits for the steps and writes ``OUT/launch.json`` (the cells'
nodes, each step's exit code, the seconds). Run through tests/slurm/rank_python, each rank is a
light stand-in (tests/slurm/rank_standin.py); srun, the step end (``controller.slurm_launch``), the
rank placement and the per-rank config copies are the real ones. Exit 1 if any step failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from controller.slurm_launch import AUTO_HOST, SlurmCells


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--num-cells", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--dist-port", type=int, default=29500)
    ap.add_argument("--timeout-s", type=float, default=600)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    # multi_rank: every task is a rank, as for trainer=megatron (the recipes' stack).
    cells = SlurmCells.from_env(args.num_cells, ranks_per_node=args.ranks_per_node, multi_rank=True,
                                dist_port=args.dist_port)
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = args.out / "cellrunner.json"
    cfg.write_text(json.dumps({"host": AUTO_HOST}))
    procs = [cells.launch(i, ["--config-json", str(cfg), "--cell-id", str(i), "--controller", "tcp://127.0.0.1:1"],
                          args.out / "logs") for i in range(len(cells.cells))]
    deadline = time.monotonic() + args.timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()  # srun cancels its step
            p.wait(timeout=60)
    report = {"job": cells.job_id, "cells": [list(c) for c in cells.cells], "ranks_per_node": args.ranks_per_node,
              "exit_codes": [p.returncode for p in procs], "seconds": round(time.monotonic() - t0, 2)}
    (args.out / "launch.json").write_text(json.dumps(report))
    print(f"launch_shape: {len(procs)} steps, exit codes {report['exit_codes']}, {report['seconds']} s", flush=True)
    return 0 if all(code == 0 for code in report["exit_codes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
