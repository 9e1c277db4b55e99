"""What a policy that keeps running work served could reach on a trace, at best: an estimate.

    .venv/bin/python -m bench.served_whatif bench/traces/p2_4t_moving.json [--staleness 1 2]

``controller.bounds.makespan_bound`` lets every cell train whenever there is training work, as if
serving were free. A policy that never leaves a running execution without a serving cell (rule 1
of ``controller/scheduler.py``; ``async`` too) cannot: while runs are live, at least
``ceil(live / capacity_per_cell)`` cells serve. This what-if follows the bound's step chain (the
staleness bound, grading, microsteps of the step's length, the apply) with that many cells
taken out of training at each moment, switches and transfers free, each step's runs started the
moment the staleness bound allows, and training shared out in ``--dt`` second ticks, a cell per
microstep. It is an estimate, not a proven bound (starting runs later could in principle free
cells sooner); ``served=False`` leaves the serving out and lands within 1% of the bound itself,
which checks the model (``tests/bench/test_served_whatif.py``).

Prints one JSON object: per staleness, the what-if's hours and the bound's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from controller.bounds import makespan_bound
from controller.simulator import pool_source
from controller.traces import Trace, load_trace


def served_whatif_s(trace: Trace, *, seed: int = 0, dt: float = 10.0, served: bool = True) -> float:
    """Seconds to the last update, with the serving cells live runs need kept out of training."""
    wl, cc = trace.workload, trace.cells
    runs = pool_source(trace, seed)
    live = np.zeros(1, dtype=np.int32)  # live runs in each tick, grown as runs are added
    pending: dict[int, list[tuple[float, int]]] = {}  # step -> (its group's shards ready at, microsteps)

    def add_step(step: int, start: float) -> None:
        nonlocal live
        groups = []
        for g in range(wl.groups_per_step):
            ends = []
            for i in range(wl.group_size):
                length = min(wl.launch_s + sum(runs(f"s{step}-g{g}-e{i}", step)), wl.timeout_s)
                a, b = int(start / dt), int(math.ceil((start + length) / dt))
                if b + 1 > len(live):
                    live = np.concatenate([live, np.zeros(b + 1 - len(live) + 4096, dtype=np.int32)])
                live[a:b] += 1
                ends.append(start + length)
            groups.append((max(ends) + wl.grade_s, trace.microsteps_of_step(step)))
        pending[step] = sorted(groups)

    for step in range(min(wl.steps, wl.staleness + 1)):
        add_step(step, 0.0)
    applied = 0.0
    for step in range(wl.steps):
        work, groups, t = [], pending.pop(step), applied
        microstep_s = trace.microstep_s_of_step(step)
        while groups or work:
            while groups and groups[0][0] <= t + 1e-9:
                work += [microstep_s] * groups.pop(0)[1]
            k = int(t / dt)
            serving = math.ceil(int(live[k]) / cc.capacity_per_cell) if served and k < len(live) else 0
            cells = min(cc.num_cells - serving, cc.compute_slots)
            if work and cells > 0:
                work.sort(reverse=True)
                for j in range(min(cells, len(work))):
                    work[j] -= dt
                work = [w for w in work if w > 1e-9]
            t = (k + 1) * dt
        applied = t + cc.apply_s
        nxt = step + wl.staleness + 1
        if nxt < wl.steps:
            add_step(nxt, applied)
    return applied


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--staleness", type=int, nargs="+", default=None, help="default: the trace's own")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dt", type=float, default=10.0)
    args = ap.parse_args(argv)
    base = load_trace(args.trace)
    out = {"trace": base.name, "by_staleness": {}}
    for s in args.staleness or [base.workload.staleness]:
        trace = dataclasses.replace(base, workload=dataclasses.replace(base.workload, staleness=s))
        out["by_staleness"][str(s)] = {
            "served_whatif_h": served_whatif_s(trace, seed=args.seed, dt=args.dt) / 3600,
            "unserved_h": served_whatif_s(trace, seed=args.seed, dt=args.dt, served=False) / 3600,
            "bound_h": makespan_bound(trace, pool_source(trace, args.seed)) / 3600,
        }
    print(json.dumps(out, sort_keys=True))
    return out


if __name__ == "__main__":
    main()
