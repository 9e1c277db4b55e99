"""A light stand-in for one rank of a cell, for the launch-shape check at 192 nodes.

It takes the place of ``python -m cellrunner.main`` (cellrunner/main.py), which controller/slurm_launch.py
execs in every srun task that is a rank: the same arguments (``--config-json F --cell-id N
--controller ADDR``), the same rank variables read by the same function (``base.ranks.ranks_from_env``,
as cellrunner/main.py does before anything else), and the per-rank config read back as the real
cellrunner reads it. Then, instead of building an engine and a trainer (its imports alone: 393 MB a rank), it
writes what it was given to ``<config dir>/ranks/cell<N>.r<rank>.json`` and exits 0. Stdlib only:
it runs on the interpreter without the venv (tests/slurm/rank_python).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from base.ranks import ranks_from_env


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="stand-in for cellrunner.main: report this rank and exit")
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--cell-id", type=int, required=True)
    ap.add_argument("--controller", required=True)
    args, _ = ap.parse_known_args(argv)
    ranks = ranks_from_env(os.environ)  # raises on a bad layout, as the real cellrunner does
    config = Path(args.config_json)
    cfg = json.loads(config.read_text())
    report = {
        "cell": args.cell_id, "rank": ranks.rank, "world_size": ranks.world_size, "node_rank": ranks.node_rank,
        "local_rank": ranks.local_rank, "nnodes": ranks.nnodes, "master_addr": ranks.master_addr,
        "master_port": os.environ.get("MASTER_PORT"), "node": os.environ.get("SLURMD_NODENAME"),
        "step": f"{os.environ.get('SLURM_JOB_ID')}.{os.environ.get('SLURM_STEP_ID')}",
        "step_nodelist": os.environ.get("SLURM_STEP_NODELIST"), "config": str(config), "host": cfg.get("host"),
        "controller": args.controller, "pid": os.getpid(),
    }
    out = config.parent / "ranks" / f"cell{args.cell_id}.r{ranks.rank}.json"
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    tmp.rename(out)
    print(f"rank_standin: cell {args.cell_id} rank {ranks.rank} of {ranks.world_size} on {report['node']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
