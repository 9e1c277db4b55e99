"""The simulator's table (workload x policy, hours) and its calibration against the embedded system.

    .venv/bin/python -m bench.simulate [--quick] [--traces bench/traces] [--calibrate RESULT.json]

Table: every trace in ``--traces`` (``bench/traces/*.json``, written by ``bench.traces.generate``)
run through ``controller.simulator`` with each policy (``scheduler.decide`` itself, the trace's
staleness bound for all three): hours to the trace's last step, elastic's ratio against async and
colocate, and the share of runs cut at the timeout (a policy that stalls running work while every
cell trains lets more runs hit the timeout: it trains on shorter runs). The reference's hours are
printed beside the trace that carries them.

Calibration: ``--calibrate`` takes a ``bench.elastic`` result file. The simulator is given that
run's setup (4 cells, capacity, workload, staleness, and the think time of every execution, from
the same function the harness used) and its measured costs (median switch times, weight loads,
microstep and apply times, call latency, each run's own overhead drawn from its measured spread,
the shard latency), simulates each policy, and ``calibration_error`` is the larger of
|predicted ratio - measured ratio| / measured over ``elastic_vs_async`` and
``elastic_vs_colocate``. Without a result file it is null, with the reason. ``error_own`` is the
same with each policy's microsteps at the mean its own run measured (``own_microstep_s``): the
simulator has no CPU contention, and on a machine whose cores the cells share with the rollouts
a cell that trains while others serve pays for it; the gap between the two errors says how much. No value is ever
filled in that was not measured; ``assumed`` lists those that are not (the gradient push, and
for older result files the shard latency).

Bound (``bound_h`` per row, ``p2_4t_ceiling_vs_*``): ``controller.bounds.makespan_bound``, the
shortest time *any* policy could take on the same runs (switches, transfers and serving capacity
free; the staleness bound, the timeout, the grading, the step order and the cells' number kept).
Colocate's or async's hours over it is the highest ratio a policy could reach on that trace, so a
goal above it is out of reach for every policy, not just the one we have.

Stall-free bound (``served_bound_h``): ``controller.bounds.serving_bound``, the shortest time of
any policy that never leaves a running execution without a serving slot, as elastic and async
never do: the cells' time has to cover every run's slot time and every microstep. Colocate can
pass it, by letting its running executions wait out part of their timeout while every cell
trains; ``cut_call_share`` (model time cut by the timeout, as a share of what the runs asked
for) says what that costs its runs. Elastic's ceilings (``elastic_ceiling_vs_*``) use the larger
of the two bounds.

Release: the calibration simulates the run's own ``algo.release`` (``group``: a group's microsteps
come when it closes; ``run``: each run's as it is graded, the embedded trainer's run release).
``what_if_run_release`` runs the 2.4T-like trace (and a group-release calibration) with
``release="run"`` as well: a what-if there, never in the headline figures, because Megatron does
not keep the per-execution gradients run release needs (``cellrunner/run_release.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from controller.bounds import makespan_bound, serving_bound
from controller.simulator import RunSource, SimResult, pool_source, simulate
from controller.traces import CellCosts, Phase, Trace, TraceError, WorkloadShape, load_trace
from workloads.harness import think_times

ROOT = Path(__file__).resolve().parent.parent
TRACES = Path(__file__).resolve().parent / "traces"
POLICIES = ("elastic", "async", "colocate")
QUICK_STEPS = 6
GRADE_S_ASSUMED = 0.05
"""Embedded: last run of a group ends -> its shards reach the controller (grading, processor);
used only for result files from before bench.elastic measured it (``calibration.grade_s``)."""
GRAD_TRANSFER_S_ASSUMED = 0.02
"""Embedded: a satellite's gradient push (a few MB over local ZeroMQ)."""


# ---------------------------------------------------------------- the table


def table(trace_dir: Path, *, quick: bool, seed: int) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(trace_dir.glob("*.json"), key=lambda p: (not p.stem.startswith("p2_4t"), p.stem)):
        trace = load_trace(path)
        if quick:
            trace = dataclasses.replace(trace, workload=dataclasses.replace(trace.workload, steps=QUICK_STEPS))
        res = {k: simulate(trace, k, seed=seed) for k in POLICIES}
        e = res["elastic"].makespan_s
        bound = makespan_bound(trace, pool_source(trace, seed))
        served = serving_bound(trace, pool_source(trace, seed))
        # elastic never leaves a running execution without a slot, so both bounds hold for it
        elastic_bound = max(bound, served)
        # The trace's async split is the reference's; every other split is run too, so the
        # comparison against the best fixed pools is in the table beside it.
        splits: dict[str, float] = {}  # training cells (a JSON key) -> async h / elastic h
        for k in range(1, trace.cells.num_cells):
            shape = dataclasses.replace(trace.workload, async_train_cells=k)
            splits[str(k)] = (res["async"] if k == trace.workload.async_train_cells
                         else simulate(dataclasses.replace(trace, workload=shape), "async", seed=seed)).makespan_s / e
        rows.append({
            "trace": trace.name, "description": trace.description, "steps": trace.workload.steps,
            "nodes": trace.cells.num_cells * trace.cells.nodes_per_cell, "cells": trace.cells.num_cells,
            "hours": {k: r.makespan_h for k, r in res.items()},
            "vs_async": res["async"].makespan_s / e, "vs_colocate": res["colocate"].makespan_s / e,
            "bound_h": bound / 3600.0, "ceiling_vs_async": res["async"].makespan_s / bound,
            "ceiling_vs_colocate": res["colocate"].makespan_s / bound,
            "served_bound_h": served / 3600.0,
            "elastic_ceiling_vs_async": res["async"].makespan_s / elastic_bound,
            "elastic_ceiling_vs_colocate": res["colocate"].makespan_s / elastic_bound,
            "cut_call_share": {k: r.cut_call_s / r.call_s if r.call_s else 0.0 for k, r in res.items()},
            "overcommit_h": {k: r.overcommit_s / 3600.0 for k, r in res.items()},
            "async_train_cells": trace.workload.async_train_cells, "vs_async_splits": splits,
            "vs_best_async": min(splits.values()),
            "timed_out_share": {k: r.num_timed_out / max(1, r.num_executions) for k, r in res.items()},
            "switches": {k: sum(r.switches) for k, r in res.items()},
            "max_staleness": {k: r.max_staleness for k, r in res.items()},
            "reference_h": trace.reference_h,
        })
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| workload | nodes | elastic h | async h | colocate h | vs Async | vs Colocate | vs best Async split "
          "| timed out e/a/c | model time cut e/a/c | bound h (ceilings) | stall-free bound h (elastic's ceilings) "
          "| reference |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        h, to, cut, ref = r["hours"], r["timed_out_share"], r["cut_call_share"], r["reference_h"]
        ref_s = (f"{ref['elastic']:.2f} / {ref['async']:.2f} / {ref['colocate']:.2f} h = "
                 f"{ref['async'] / ref['elastic']:.2f}x / {ref['colocate'] / ref['elastic']:.2f}x") if ref else ""
        print(f"| {r['trace']} | {r['nodes']} | {h['elastic']:.2f} | {h['async']:.2f} | {h['colocate']:.2f} | "
              f"{r['vs_async']:.2f}x | {r['vs_colocate']:.2f}x | "
              f"{r['vs_best_async']:.2f}x ({min(r['vs_async_splits'], key=r['vs_async_splits'].get)} of "
              f"{r['cells']} cells train) | "
              f"{to['elastic']:.0%} / {to['async']:.0%} / {to['colocate']:.0%} | "
              f"{cut['elastic']:.0%} / {cut['async']:.0%} / {cut['colocate']:.0%} | "
              f"{r['bound_h']:.2f} ({r['ceiling_vs_async']:.2f}x / {r['ceiling_vs_colocate']:.2f}x) | "
              f"{r['served_bound_h']:.2f} ({r['elastic_ceiling_vs_async']:.2f}x / "
              f"{r['elastic_ceiling_vs_colocate']:.2f}x) | {ref_s} |")


# ---------------------------------------------------------------- calibration


class CalibrationError(ValueError):
    pass


def load_result(path: Path) -> dict[str, Any]:
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"{path}: not a readable JSON file: {exc}") from None
    for key in ("elastic_vs_async", "elastic_vs_colocate", "calibration", "config", "host"):
        if key not in res:
            raise CalibrationError(f"{path}: no '{key}': not a bench.elastic result file")
    for key in ("elastic_vs_async", "elastic_vs_colocate"):
        if not isinstance(res[key], (int, float)) or res[key] <= 0:
            raise CalibrationError(f"{path}: {key} = {res[key]!r}: the run did not measure all three policies")
    return res


def embedded_setup(result: dict[str, Any]) -> dict[str, Any]:
    """The run's configuration: conf/ defaults with the run's overrides applied."""
    conf = ROOT / "conf"
    cfg = {
        "workload": yaml.safe_load((conf / "workload" / "wordmap.yaml").read_text()),
        "scheduler": yaml.safe_load((conf / "scheduler" / "elastic.yaml").read_text()),
        "cluster": yaml.safe_load((conf / "cluster" / "local.yaml").read_text()),
        "trainer": yaml.safe_load((conf / "trainer" / "embedded.yaml").read_text()),
        "algo": yaml.safe_load((conf / "algo" / "gspo.yaml").read_text()),
    }
    for item in result["config"]["overrides"]:
        key, _, value = item.partition("=")
        parts = key.split(".")
        if parts[0] not in cfg:
            continue
        node = cfg[parts[0]]
        for p in parts[1:-1]:
            node = node[p]
        node[parts[-1]] = yaml.safe_load(value)
    return cfg


def embedded_trace(result: dict[str, Any]) -> tuple[Trace, RunSource, list[str]]:
    """The bench.elastic setup as a trace; the runs replay the harness's own think times."""
    cal, cfg = result["calibration"], embedded_setup(result)
    wl, sch, cl = cfg["workload"], cfg["scheduler"], cfg["cluster"]
    missing = [k for k in ("microstep_s", "microsteps_per_step", "to_train_s", "to_serve_s", "weight_transfer_s",
                           "apply_s", "call_s_p25", "launch_s") if not isinstance(cal.get(k), (int, float))]
    if missing:
        raise CalibrationError(f"not measured in the result file: {missing} (microstep times need the "
                               "controller's 'microstep' metrics events)")
    per_group = max(1, round(cal["microsteps_per_step"] / wl["groups_per_step"]))
    # With emulated accelerators (trainer.device_s_per_token) a microstep mostly sleeps, so cells
    # train side by side as on separate nodes; without, the cells share the machine's cores.
    paced = float(cfg["trainer"].get("device_s_per_token") or 0) > 0
    cpus = int(result["host"]["cpu_count"])
    cells = CellCosts(
        num_cells=cl["num_cells"], nodes_per_cell=1, capacity_per_cell=sch["capacity_per_cell"],
        to_train_s=cal["to_train_s"], to_serve_s=cal["to_serve_s"], weight_transfer_s=cal["weight_transfer_s"],
        grad_transfer_s=GRAD_TRANSFER_S_ASSUMED, microstep_s=cal["microstep_s"], apply_s=cal["apply_s"],
        compute_slots=max(cpus, cl["num_cells"]) if paced else cpus, reroute_s=0.0,
    )
    shape = WorkloadShape(
        steps=result["config"]["steps"], groups_per_step=wl["groups_per_step"], group_size=wl["group_size"],
        timeout_s=float(wl["timeout_s"]), microsteps_per_group=per_group,
        launch_s=0.0 if cal.get("run_overhead_s_quantiles") else cal["launch_s"],
        grade_s=cal.get("grade_s") or GRADE_S_ASSUMED, staleness=result["config"]["staleness"], async_train_cells=sch["train_cells"] or 1,
    )
    trace = Trace(name="embedded", description="bench.elastic's setup, measured costs", generator="bench.simulate",
                  cells=cells, workload=shape, reference_h=None, phases=(Phase(name="all", first_step=0, runs=(0, 1)),),
                  executions=((0.0, 0.0),))
    think, turns, call_s = wl["think_time"], wl["max_turns"], cal["call_s_p25"]
    # The first call of a run carries its prompt's prefill and starts with the rest of its step;
    # older result files lack the figure and fall back to the typical call.
    first_s = cal.get("first_call_s_median") or call_s
    overheads = cal.get("run_overhead_s_quantiles")

    def runs(execution_id: str, _step: int) -> tuple[float, ...]:
        out: list[float] = []
        if overheads:  # the run's own overhead, drawn from the measured spread: (no call, overhead) first
            out += [0.0, draw(overheads, execution_id)]
        if think["kind"] == "none":
            return tuple(out) + (first_s, 0.0) + (call_s, 0.0) * (turns - 1)
        for i, t in enumerate(think_times(seed=think["seed"], execution_id=execution_id, median_s=think["median_s"],
                                          sigma=think["sigma"], max_s=think["max_s"], turns=turns)):
            out += [first_s if i == 0 else call_s, t]
        return tuple(out)

    assumed = [f"grad_transfer_s={GRAD_TRANSFER_S_ASSUMED}"] + ([] if cal.get("grade_s") else [f"grade_s={GRADE_S_ASSUMED}"])
    return trace, runs, assumed


def draw(quantiles: list[float], key: str) -> float:
    """A value from the measured quantiles, at a point fixed by ``key`` (linear between them)."""
    u = random.Random(f"gyre-overhead/{key}").random() * (len(quantiles) - 1)
    i = min(int(u), len(quantiles) - 2)
    return quantiles[i] + (u - i) * (quantiles[i + 1] - quantiles[i])


def calibrate(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {"error": None, "reason": "no bench.elastic result file given (--calibrate runs/bench-elastic/result.json)"}
    try:
        result = load_result(path)
        trace, runs, assumed = embedded_trace(result)
    except (CalibrationError, TraceError, OSError, KeyError, TypeError) as exc:
        return {"error": None, "reason": f"cannot calibrate: {exc}"}
    release = embedded_setup(result)["algo"].get("release", "group")
    sims: dict[str, SimResult] = {k: simulate(trace, k, runs=runs, release=release) for k in POLICIES}
    predicted = _ratios(sims)
    bound = makespan_bound(trace, runs, release=release)
    measured = {k: result[k] for k in predicted}
    errors = {k: abs(predicted[k] - measured[k]) / measured[k] for k in predicted}
    # The same, each policy's microsteps at the mean its own run measured: on a machine whose
    # cores the cells share with the rollouts, a cell that trains while others serve (elastic)
    # pays for it, which the one pooled median leaves out (the simulator models no CPU contention).
    own = own_microstep_costs(result)
    own_sims = {k: simulate(_with_microstep(trace, own[k]), k, runs=runs, release=release) for k in POLICIES} if own else None
    own_errors = ({k: abs(v - measured[k]) / measured[k] for k, v in _ratios(own_sims).items()} if own_sims else None)
    return {
        "error": max(errors.values()), "errors": errors, "predicted": predicted, "measured": measured,
        "own_microstep_s": own, "predicted_own": _ratios(own_sims) if own_sims else None,
        "error_own": max(own_errors.values()) if own_errors else None,
        "predicted_s": {k: r.makespan_s for k, r in sims.items()},
        "measured_s": {k: result.get(f"{k}_s") for k in POLICIES},
        "result_file": str(path), "trace": dataclasses.asdict(trace.cells) | dataclasses.asdict(trace.workload),
        "assumed": assumed, "reason": "",
        "bound_s": bound, "ceiling": {f"elastic_vs_{k}": sims[k].makespan_s / bound for k in ("async", "colocate")},
        "release": release,
        "what_if_run_release": (None if release == "run" else
                                _ratios({k: simulate(trace, k, runs=runs, release="run") for k in POLICIES})),
    }


def _fmt(d: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:.3f}" for k, v in d.items()) + "}"


def own_microstep_costs(result: dict[str, Any]) -> dict[str, float] | None:
    """Each policy's mean microstep seconds in its own run (``raw`` of the result file), if all have them."""
    raw = result.get("raw") or {}
    costs = {k: raw[k]["microstep_s"] for k in POLICIES if k in raw and raw[k].get("microstep_s")}
    if len(costs) < len(POLICIES):
        return None
    return {k: sum(v) / len(v) for k, v in costs.items()}


def _with_microstep(trace: Trace, microstep_s: float) -> Trace:
    return dataclasses.replace(trace, cells=dataclasses.replace(trace.cells, microstep_s=microstep_s))


def _ratios(sims: dict[str, SimResult]) -> dict[str, float]:
    return {f"elastic_vs_{k}": sims[k].makespan_s / sims["elastic"].makespan_s for k in ("async", "colocate")}


def what_if_run_release(trace_dir: Path, *, quick: bool, seed: int) -> dict[str, Any] | None:
    """The 2.4T-like trace with each run's microsteps released as it is graded (an upper bound)."""
    path = trace_dir / "p2_4t.json"
    if not path.exists():
        return None
    trace = load_trace(path)
    if quick:
        trace = dataclasses.replace(trace, workload=dataclasses.replace(trace.workload, steps=QUICK_STEPS))
    sims = {k: simulate(trace, k, seed=seed, release="run") for k in POLICIES}
    bound = makespan_bound(trace, pool_source(trace, seed), release="run")
    return {"hours": {k: r.makespan_h for k, r in sims.items()}, "bound_h": bound / 3600.0,
            "ceiling_vs_async": sims["async"].makespan_s / bound,
            "ceiling_vs_colocate": sims["colocate"].makespan_s / bound} | {
        k.replace("elastic", "p2_4t"): v for k, v in _ratios(sims).items()}


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"only the first {QUICK_STEPS} steps of each trace")
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--calibrate", type=Path, default=None, help="a bench.elastic result file")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    rows = table(args.traces, quick=args.quick, seed=args.seed)
    if not rows:
        ap.error(f"no traces in {args.traces}")
    print_table(rows)
    cal = calibrate(args.calibrate)
    if cal["error"] is None:
        print(f"calibration: none ({cal['reason']})")
    else:
        print(f"calibration against {cal['result_file']} (release={cal['release']}): predicted {cal['predicted']}, measured {cal['measured']}, "
              f"error {cal['error']:.3f}; no policy beats {cal['bound_s']:.1f} s there (ceilings "
              f"{cal['ceiling']['elastic_vs_async']:.2f}x / {cal['ceiling']['elastic_vs_colocate']:.2f}x)")
        if cal["error_own"] is not None:
            print(f"  with each policy's own mean microstep {_fmt(cal['own_microstep_s'])} s: predicted "
                  f"{_fmt(cal['predicted_own'])}, error {cal['error_own']:.3f}")
    what_if = what_if_run_release(args.traces, quick=args.quick, seed=args.seed)
    if what_if:
        print(f"what-if, runs released as graded (Megatron keeps no per-execution gradients): p2_4t "
              f"{what_if['p2_4t_vs_async']:.2f}x vs async, {what_if['p2_4t_vs_colocate']:.2f}x vs colocate "
              f"(its bound {what_if['bound_h']:.2f} h: ceilings {what_if['ceiling_vs_async']:.2f}x / "
              f"{what_if['ceiling_vs_colocate']:.2f}x)"
              + (f"; embedded predicted {cal['what_if_run_release']}" if cal.get("what_if_run_release") else ""))
    p24 = next((r for r in rows if r["trace"] == "p2_4t"), None)
    out = {
        "p2_4t_vs_async": p24["vs_async"] if p24 else None,
        "p2_4t_vs_colocate": p24["vs_colocate"] if p24 else None,
        "p2_4t_vs_best_async": p24["vs_best_async"] if p24 else None,
        "p2_4t_ceiling_vs_async": p24["ceiling_vs_async"] if p24 else None,
        "p2_4t_ceiling_vs_colocate": p24["ceiling_vs_colocate"] if p24 else None,
        "calibration_error": cal["error"], "calibration_error_own_microsteps": cal.get("error_own"),
        "calibration": cal, "table": rows, "what_if_run_release": what_if,
        "config": {"traces": str(args.traces), "quick": args.quick, "seed": args.seed,
                   "sim_wall_s": round(time.monotonic() - t0, 2)},
        "host": {"machine": platform.machine(), "system": f"{platform.system()} {platform.release()}",
                 "cpu_count": os.cpu_count()},
        "versions": {"python": sys.version.split()[0]},
    }
    print(json.dumps(out, sort_keys=True), flush=True)
    return out


if __name__ == "__main__":
    main()
