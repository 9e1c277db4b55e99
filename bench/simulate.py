"""The simulator's table (workload x policy, hours) and its calibration against the embedded system.

    .venv/bin/python -m bench.simulate [--quick] [--drift] [--traces bench/traces]
                                       [--calibrate RESULT.json [--fit OTHER_RESULT.json]]
    .venv/bin/python -m bench.simulate --trace FILE.json [--staleness S] [--partial] [--stragglers K]
    .venv/bin/python -m bench.simulate --moving [--partial] [--stragglers K]

``--trace``: any trace file in the format ``controller.traces`` loads (a user's own workload, or one
of ``bench/traces``), alone: every policy, every fixed split and both colocates, the bound and the
stall-free bound, in hours, and elastic's ratios against them, as one JSON object last
(``trace_summary``), with each phase's best fixed split at every policy's throughput
(``controller.bounds.phase_balance``). ``--staleness`` replaces the trace's staleness bound for
every policy. ``--moving``: the shipped moving-balance 2.4T-like trace (``p2_4t_moving``) at
staleness 1 and 2, with ``moving_vs_best_async``, ``moving_st2_vs_best_async``,
``moving_vs_colocate`` and ``moving_vs_bound`` (over the larger of the two bounds) last, and under
``variants`` the same runs with held-out eval rounds (``p2_4t_moving_eval``) and with a satellite
lost halfway (``p2_4t_moving_loss``): every policy's hours and elastic's ratios. ``--partial`` adds
``partial_rollouts``, a what-if per staleness bound: every policy, split and colocate again with
partial rollouts as slime runs them (``controller.simulator.simulate(partial=True)``: a step trains
on the first groups graded and the groups still running train in a later step, kept whole), their
hours beside the whole-step ones (``gain``), elastic's ratios, the groups carried and what it costs
in staleness (``max_staleness``). With ``--trace``, ``--partial`` adds the same for that trace, at its
staleness bound. ``--stragglers K`` adds ``stragglers`` (per staleness bound with ``--moving``):
elastic again with ``scheduler.straggler_runs=K``, which lets up to K running executions of later
steps wait without a serving cell while microsteps wait for one, its hours and ratios beside elastic
as shipped, and what it costs the runs (the share cut at the timeout, the model time cut).

Table: every trace in ``--traces`` (``bench/traces/*.json``, written by ``bench.traces.generate``)
run through ``controller.simulator`` with each policy (``scheduler.decide`` itself, the trace's
staleness bound for all three): hours to the trace's last step. The headline ratios are those a
user would compare: elastic against **the best fixed async split in hindsight** (every split of
1..N-1 training cells is simulated) and against **the better colocate** (as configured, at the
trace's staleness, and synchronous, staleness 0: the next step's runs start only when the cells
serve again, so none waits out a training phase), and elastic over the bound (below). Async with
the trace's own split (one training cell) and colocate at staleness 1 are details. The share of
runs cut at the timeout is printed beside them (a policy that stalls running work while every
cell trains lets more runs hit the timeout: it trains on shorter runs). The reference's hours are
printed beside the trace that carries them.

``--drift``: the headline keys (``p2_4t_vs_best_async``, ``p2_4t_vs_colocate``,
``p2_4t_vs_bound``) come from ``p2_4t_drift``, the 2.4T-like setup whose runs and tokens grow 4x
over the steps and whose task mix turns tool-heavy halfway (``bench/traces/generate.py``), and the
calibration is out of sample (below).

Calibration: ``--calibrate`` takes a ``bench.elastic`` result file and predicts its run: the
simulator is given that run's setup (4 cells, capacity, workload with its drift, staleness, and
the think time of every execution, from the same function the harness used) and measured costs
(median switch times, weight loads, microstep and apply times, call latency, the shard latency,
and harness starts that share the machine's cores: the CPU time of one start is fitted so that the
cost run's own elastic run starts its runs in the median overhead it measured, ``launch_cpu_s``;
a policy that starts a whole step's runs at once then waits longer for them than one whose runs
start a few at a time, as measured: 3.9 s against 0.7 s on 2026-12-06), simulates every policy the run
measured (each async split, both colocates), and ``calibration_error`` is the larger of
|predicted ratio - measured ratio| / measured over ``elastic_vs_best_async`` and
``elastic_vs_colocate``. With ``--fit`` the costs come from *another* run (out of sample: a
stationary run predicting a drifting one); without, from the run itself (in sample: that shows
consistency, not prediction). Out of sample, what is taken from the run predicted is only its
workload, as the think times are: the shards and tokens each step made; what they cost (seconds
per microstep and per token, fitted) and every other cost come from the other run. ``--drift`` defaults to
``bench/results/elastic-stationary.json`` predicting ``bench/results/elastic-drift.json``.
Without a result file the error is null, with the reason. In sample, ``error_own`` is the same
with each policy's microsteps at the mean its own run measured (``own_microstep_s``): the
simulator has no CPU contention, and on a machine whose cores the cells share with the rollouts
a cell that trains while others serve pays for it. No value is ever filled in that was not
measured; ``assumed`` lists those that are not (the gradient push, and for older result files
the shards per step and the shard latency).

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

Throughput what-if (``throughput_vs_best_async``, ``p2_4t_throughput_vs_best_async``):
``controller.bounds.throughput_what_if``. Both bounds above keep Gyre's step semantics, in which a
step waits for its slowest run. Partial rollouts or a preempted tail would loosen that for every
policy alike; if every policy then ran at its throughput, only the work would bind, and elastic
would be the best fixed split's throughput time over any policy's. Not a bound: a fixed split held
back by the step chain can trail its throughput by more than elastic does (nl2repo_122b: 1.18x
measured, 1.05x at throughput), which is where elastic's gain comes from today.

Release: the calibration simulates the run's own ``algo.release`` (``group``: a group's microsteps
come when it closes; ``run``: each run's as it is graded, the embedded trainer's run release).
``what_if_run_release`` runs the 2.4T-like trace with ``release="run"`` as well: a what-if there,
never in the headline figures, because Megatron does not keep the per-execution gradients run
release needs (``cellrunner/run_release.py``).
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

from controller.bounds import makespan_bound, phase_balance, serving_bound, throughput_what_if
from controller.simulator import Release, RunSource, SimResult, pool_source, simulate
from controller.traces import CellCosts, CellLoss, Phase, Trace, TraceError, WorkloadShape, load_trace
from base.typed_config import build
from workloads.config import WorkloadConfig
from workloads.drift import run_shape
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
        rows.append(trace_row(trace, seed=seed))
    return rows


def trace_row(trace: Trace, *, seed: int) -> dict[str, Any]:
    """One trace through every policy, every fixed split and both colocates, with its bounds."""
    res = {k: simulate(trace, k, seed=seed) for k in POLICIES}
    e = res["elastic"].makespan_s
    bound = makespan_bound(trace, pool_source(trace, seed))
    served = serving_bound(trace, pool_source(trace, seed))
    # elastic never leaves a running execution without a slot, so both bounds hold for it
    elastic_bound = max(bound, served)
    fluid = throughput_what_if(trace, pool_source(trace, seed))
    # The trace's async split is the reference's; every other split is run too, so the
    # comparison against the best fixed pools is in the table beside it.
    splits: dict[str, float] = {}  # training cells (a JSON key) -> async h / elastic h
    for k in range(1, trace.cells.num_cells):
        shape = dataclasses.replace(trace.workload, async_train_cells=k)
        splits[str(k)] = (res["async"] if k == trace.workload.async_train_cells
                     else simulate(dataclasses.replace(trace, workload=shape), "async", seed=seed)).makespan_s / e
    sync = simulate(dataclasses.replace(trace, workload=dataclasses.replace(trace.workload, staleness=0)),
                    "colocate", seed=seed)
    return {
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
        "stalled_call_h": {k: r.stalled_call_s / 3600.0 for k, r in res.items()},
        "async_train_cells": trace.workload.async_train_cells, "vs_async_splits": splits,
        "vs_best_async": min(splits.values()),
        # colocate as a synchronous user runs it (staleness 0: no run waits out a training
        # phase), and the better of the two colocates
        "colocate_sync_h": sync.makespan_h, "vs_colocate_sync": sync.makespan_s / e,
        "vs_best_colocate": min(res["colocate"].makespan_s, sync.makespan_s) / e,
        "vs_bound": e / elastic_bound,
        # the most any policy could gain over the best split and the better colocate here
        "ceiling_vs_best_async": min(splits.values()) * e / bound,
        "ceiling_vs_best_colocate": min(res["colocate"].makespan_s, sync.makespan_s) / bound,
        # a what-if, not a bound: elastic over the best split if every policy ran at its
        # throughput (no step waiting for its slowest run); the balance of the work decides it
        "throughput_vs_best_async": fluid["ratio"],
        "throughput_best_split_cells": fluid["best_split_cells"],
        "timed_out_share": {k: r.num_timed_out / max(1, r.num_executions) for k, r in res.items()},
        "switches": {k: sum(r.switches) for k, r in res.items()},
        "max_staleness": {k: r.max_staleness for k, r in res.items()},
        "reference_h": trace.reference_h,
        "async_split_h": {k: v * res["elastic"].makespan_h for k, v in splits.items()},
    }


def trace_summary(trace: Trace, *, seed: int) -> dict[str, Any]:
    """``trace_row`` as the figures a user compares: hours per policy and split, both bounds, the
    ratios of elastic against the best split in hindsight, the better colocate and the bound."""
    row = trace_row(trace, seed=seed)
    print_table([row])
    hours = {"elastic": row["hours"]["elastic"], "colocate": row["hours"]["colocate"],
             "colocate_sync": row["colocate_sync_h"],
             **{f"async_{k}": h for k, h in row["async_split_h"].items()}}
    best_split = min(row["async_split_h"], key=row["async_split_h"].get)
    return {
        "trace": trace.name, "steps": trace.workload.steps, "staleness": trace.workload.staleness,
        "cells": trace.cells.num_cells, "hours": hours,
        "bound_h": row["bound_h"], "stall_free_bound_h": row["served_bound_h"],
        "best_split_cells": int(best_split),
        "elastic_vs_best_async": row["vs_best_async"], "elastic_vs_colocate": row["vs_best_colocate"],
        "elastic_vs_bound": row["vs_bound"],
        "throughput_vs_best_async": row["throughput_vs_best_async"],
        "timed_out_share": row["timed_out_share"], "max_staleness": row["max_staleness"],
        "cut_call_share": row["cut_call_share"], "stalled_call_h": row["stalled_call_h"],
        # per phase: the split that would suit it best at every policy's throughput
        "phases": phase_balance(trace, pool_source(trace, seed)),
    }


def moving_summary(path: Path, *, seed: int, partial: bool = False, straggler_runs: int | None = None) -> dict[str, Any]:
    """The moving-balance trace at staleness 1 and 2: elastic against the best split in hindsight,
    the better colocate and the larger bound, side by side from one run of each."""
    base = load_trace(path)
    at = {s: trace_summary(dataclasses.replace(base, workload=dataclasses.replace(base.workload, staleness=s)),
                           seed=seed) for s in (1, 2)}
    # The same runs with held-out eval rounds, and with a satellite lost halfway (their bounds
    # count neither: they stay valid, only looser).
    variants = {}
    for suffix in ("eval", "loss"):
        other = path.with_name(f"{path.stem}_{suffix}.json")
        if other.exists():
            summary = trace_summary(load_trace(other), seed=seed)
            variants[summary["trace"]] = {key: summary[key] for key in (
                "hours", "bound_h", "stall_free_bound_h", "best_split_cells", "elastic_vs_best_async",
                "elastic_vs_colocate", "elastic_vs_bound")}
    out = {
        "trace": base.name, "moving_vs_best_async": at[1]["elastic_vs_best_async"],
        "moving_st2_vs_best_async": at[2]["elastic_vs_best_async"],
        "moving_vs_colocate": at[1]["elastic_vs_colocate"], "moving_vs_bound": at[1]["elastic_vs_bound"],
        "moving_st2_vs_colocate": at[2]["elastic_vs_colocate"], "moving_st2_vs_bound": at[2]["elastic_vs_bound"],
        "by_staleness": {str(s): summary for s, summary in at.items()},
        "variants": variants,
    }
    if partial:
        out["partial_rollouts"] = {
            str(s): partial_rollouts(dataclasses.replace(base, workload=dataclasses.replace(base.workload, staleness=s)),
                                     seed=seed, whole_h=at[s]["hours"]) for s in (1, 2)}
    if straggler_runs is not None:
        out["stragglers"] = {
            str(s): stragglers_what_if(dataclasses.replace(base, workload=dataclasses.replace(base.workload, staleness=s)),
                                       seed=seed, straggler_runs=straggler_runs, summary=at[s]) for s in (1, 2)}
    return out


def partial_rollouts(trace: Trace, *, seed: int, whole_h: dict[str, float]) -> dict[str, Any]:
    """What-if: every policy, every fixed split and both colocates with partial rollouts
    (``simulate(partial=True)``: a step trains on the first groups graded, and the ones still
    running train in a later step), beside ``whole_h``, the same runs without (``trace_summary``'s
    hours). ``max_staleness`` is what they cost: the versions between a trained call and the
    update it went into. No bound is given: both bounds keep a step waiting for its slowest run,
    which partial rollouts drop."""
    labels = ["elastic", "colocate", "colocate-sync"] + [f"async-{k}" for k in range(1, trace.cells.num_cells)]
    # keyed as trace_summary's hours; each run draws from a pool of its own (pool_source is consumed)
    sims = {label.replace("-", "_"): sim_policy(trace, label, pool_source(trace, seed), partial=True) for label in labels}
    hours = {k: r.makespan_h for k, r in sims.items()}

    def ratios(h: dict[str, float]) -> dict[str, float]:
        best = min(v for k, v in h.items() if k.startswith("async_"))
        return {"elastic_vs_best_async": best / h["elastic"],
                "elastic_vs_colocate": min(h["colocate"], h["colocate_sync"]) / h["elastic"]}

    return {
        "hours": hours, **ratios(hours),
        "whole_steps": {"hours": whole_h, **ratios(whole_h)},
        "gain": {k: whole_h[k] / h for k, h in hours.items()},
        "max_staleness": {k: r.max_staleness for k, r in sims.items()},
        "carried_groups": {k: r.carried_groups for k, r in sims.items()},
        "groups": trace.workload.steps * trace.workload.groups_per_step,
    }


def stragglers_what_if(trace: Trace, *, seed: int, straggler_runs: int, summary: dict[str, Any]) -> dict[str, Any]:
    """Elastic with ``scheduler.straggler_runs`` (rule 1's opt-in exception: a few running
    executions of later steps wait without a cell so it trains) beside elastic as shipped, against
    ``summary``'s baselines (``trace_summary`` of the same trace). What it costs is in the runs:
    the share cut at the timeout and the model time they lost. Over the bound it counts
    ``makespan_bound`` alone: the stall-free bound holds only for policies that serve every
    running execution. Elastic as shipped is ``summary``'s own run."""
    late = simulate(trace, "elastic", seed=seed, straggler_runs=straggler_runs)
    hours = summary["hours"]
    best = min(h for k, h in hours.items() if k.startswith("async_"))

    def beside(key: str, value: float) -> dict[str, float]:
        return {"elastic": value, "elastic_all_served": summary[key]["elastic"]}

    return {
        "straggler_runs": straggler_runs,
        "hours": beside("hours", late.makespan_h),
        "elastic_vs_best_async": best / late.makespan_h,
        "elastic_vs_colocate": min(hours["colocate"], hours["colocate_sync"]) / late.makespan_h,
        "elastic_vs_bound": late.makespan_h / summary["bound_h"],
        "timed_out_share": beside("timed_out_share", late.num_timed_out / late.num_executions),
        "cut_call_share": beside("cut_call_share", late.cut_call_s / late.call_s),
        "stalled_call_h": beside("stalled_call_h", late.stalled_call_s / 3600.0),
        "max_staleness": late.max_staleness,
    }


def _load_user_trace(ap: argparse.ArgumentParser, path: Path, staleness: int | None) -> Trace:
    try:
        trace = load_trace(path)
    except (OSError, TraceError) as exc:
        ap.error(f"--trace {path}: {exc}")
    if staleness is not None:
        if staleness < 0:
            ap.error(f"--staleness: want >= 0, got {staleness}")
        trace = dataclasses.replace(trace, workload=dataclasses.replace(trace.workload, staleness=staleness))
    return trace


def by_staleness(trace_dir: Path, row: dict[str, Any], *, quick: bool, seed: int,
                 bounds: tuple[int, ...] = (1, 2, 3)) -> dict[str, Any]:
    """``row``'s trace at other staleness bounds (the same for every policy): elastic against the
    best fixed split and colocate, and over the bound (the larger of the two, as in the table). A
    looser bound lets steps overlap more, so the cells' split matters more and the step chain less
    (elastic's lookahead is for this). The trace's own bound is ``row``, already simulated."""
    base = load_trace(trace_dir / f"{row['trace']}.json")
    if quick:
        base = dataclasses.replace(base, workload=dataclasses.replace(base.workload, steps=QUICK_STEPS))
    out = {}
    for k in bounds:
        if k == base.workload.staleness:
            out[str(k)] = {key: row[key] for key in ("vs_best_async", "vs_colocate", "vs_bound")}
            continue
        trace = dataclasses.replace(base, workload=dataclasses.replace(base.workload, staleness=k))
        e = simulate(trace, "elastic", seed=seed).makespan_s
        best = min(simulate(dataclasses.replace(trace, workload=dataclasses.replace(trace.workload, async_train_cells=n)),
                            "async", seed=seed).makespan_s for n in range(1, trace.cells.num_cells))
        bound = max(makespan_bound(trace, pool_source(trace, seed)), serving_bound(trace, pool_source(trace, seed)))
        out[str(k)] = {"vs_best_async": best / e, "vs_colocate": simulate(trace, "colocate", seed=seed).makespan_s / e,
                       "vs_bound": e / bound}
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| workload | nodes | elastic h | async h | colocate h | vs best Async split | vs better Colocate (sync) "
          "| vs bound (ceilings vs best split / colocate; vs best split at every policy's throughput) | vs Async (1 cell trains) | vs Colocate (staleness 1) "
          "| timed out e/a/c | model time cut e/a/c | bound h (ceilings) | stall-free bound h (elastic's ceilings) "
          "| reference |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        h, to, cut, ref = r["hours"], r["timed_out_share"], r["cut_call_share"], r["reference_h"]
        ref_s = (f"{ref['elastic']:.2f} / {ref['async']:.2f} / {ref['colocate']:.2f} h = "
                 f"{ref['async'] / ref['elastic']:.2f}x / {ref['colocate'] / ref['elastic']:.2f}x") if ref else ""
        print(f"| {r['trace']} | {r['nodes']} | {h['elastic']:.2f} | {h['async']:.2f} | {h['colocate']:.2f} | "
              f"{r['vs_best_async']:.2f}x ({min(r['vs_async_splits'], key=r['vs_async_splits'].get)} of "
              f"{r['cells']} cells train) | {r['vs_best_colocate']:.2f}x ({r['vs_colocate_sync']:.2f}x) | "
              f"{r['vs_bound']:.2f}x (ceilings {r['ceiling_vs_best_async']:.2f}x / {r['ceiling_vs_best_colocate']:.2f}x; "
              f"at throughput {r['throughput_vs_best_async']:.2f}x) | "
              f"{r['vs_async']:.2f}x | {r['vs_colocate']:.2f}x | "
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


def embedded_trace(result: dict[str, Any], *, costs: dict[str, Any] | None = None,
                   launch_cpu_s: float | None = None) -> tuple[Trace, RunSource, list[str]]:
    """The bench.elastic setup of ``result`` as a trace. Its workload is replayed: the harness's
    own think times and ``workload.drift``'s shapes, and the shards and tokens each step made
    (``step_training``). ``costs`` (another run's ``calibration``, for an out-of-sample
    prediction) replaces the run's own measured costs: switches, transfers, calls, run overheads,
    seconds per microstep and per token."""
    cfg = embedded_setup(result)
    cal = costs if costs is not None else result["calibration"]
    wl, sch, cl = cfg["workload"], cfg["scheduler"], cfg["cluster"]
    missing = [k for k in ("microstep_s", "microsteps_per_step", "to_train_s", "to_serve_s", "weight_transfer_s",
                           "apply_s", "call_s_p25", "launch_s") if not isinstance(cal.get(k), (int, float))]
    if missing:
        raise CalibrationError(f"not measured in the result file: {missing} (microstep times need the "
                               "controller's 'microstep' metrics events)")
    workload = build(WorkloadConfig, wl)
    steps = result["config"]["steps"]
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
    per_step, assumed_shards = step_training(result["calibration"], cal, steps, wl["groups_per_step"])
    # Harness starts share the machine's cores: a step's runs start together and each waits for
    # the others (measured: a run's overhead was 3.9 s under elastic and 0.7 s with one serving
    # cell, whose runs start a few at a time). The CPU time of one start is fitted to the cost
    # run's own elastic overhead (``launch_cpu_s``); ``launch_cpu_s=None`` draws each run's
    # overhead from the measured spread instead, as if it did not depend on the policy.
    contended = launch_cpu_s is not None
    shape = WorkloadShape(
        steps=steps, groups_per_step=wl["groups_per_step"], group_size=wl["group_size"],
        timeout_s=float(wl["timeout_s"]), microsteps_per_group=per_step[0][0],
        launch_s=launch_cpu_s if contended else 0.0 if cal.get("run_overhead_s_quantiles") else cal["launch_s"],
        grade_s=cal.get("grade_s") or GRADE_S_ASSUMED, staleness=result["config"]["staleness"], async_train_cells=sch["train_cells"] or 1,
        launch_cpus=cpus if contended else 0,
    )
    phases = tuple(Phase(name=f"step{s}", first_step=s, runs=(0, 1), microsteps_per_group=n, microstep_s=t)
                   for s, (n, t) in enumerate(per_step) if s == 0 or (n, t) != per_step[s - 1])
    lost = result["config"].get("lose_cell")  # bench.elastic --lose-cell: every run lost that satellite
    trace = Trace(name="embedded", description="bench.elastic's setup, measured costs", generator="bench.simulate",
                  cells=cells, workload=shape, reference_h=None, phases=phases, executions=((0.0, 0.0),),
                  cell_losses=(CellLoss(cell=lost["cell"], at_version=lost["at_version"]),) if lost else ())
    think, call_s = wl["think_time"], cal["call_s_p25"]
    # The first call of a run carries its prompt's prefill and starts with the rest of its step;
    # older result files lack the figure and fall back to the typical call.
    first_s = cal.get("first_call_s_median") or call_s
    overheads = None if contended else cal.get("run_overhead_s_quantiles")

    def runs(execution_id: str, step: int) -> tuple[float, ...]:
        out: list[float] = []
        if overheads:  # the run's own overhead, drawn from the measured spread: (no call, overhead) first
            out += [0.0, draw(overheads, execution_id)]
        at = run_shape(workload, step)
        if think["kind"] == "none":
            return tuple(out) + (first_s, 0.0) + (call_s, 0.0) * (at.max_turns - 1)
        for i, t in enumerate(think_times(seed=think["seed"], execution_id=execution_id,
                                          median_s=think["median_s"] * at.think_scale, sigma=think["sigma"],
                                          max_s=think["max_s"], turns=at.max_turns)):
            out += [first_s if i == 0 else call_s, t]
        return tuple(out)

    assumed = [f"grad_transfer_s={GRAD_TRANSFER_S_ASSUMED}"] + ([] if cal.get("grade_s") else [f"grade_s={GRADE_S_ASSUMED}"])
    return trace, runs, assumed + assumed_shards


def fit_launch_cpu_s(result: dict[str, Any], *, iterations: int = 14) -> float | None:
    """The CPU seconds of one harness start on the machine of ``result``: the value for which the
    simulated elastic run of ``result``'s own setup starts its runs in the median overhead its
    elastic run measured (``launch_s``), the starts under way sharing the machine's cores. None
    for result files without the overhead's spread (older ones)."""
    cal = result["calibration"]
    target = cal.get("launch_s")
    if not cal.get("run_overhead_s_quantiles") or not isinstance(target, (int, float)) or target <= 0:
        return None
    lo, hi = 0.0, float(target)  # alone, a start takes its CPU time: never more than the overhead
    for _ in range(iterations):
        mid = (lo + hi) / 2
        trace, runs, _ = embedded_trace(result, launch_cpu_s=mid)
        if simulate(trace, "elastic", runs=runs).start_s_median < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def step_training(workload_cal: dict[str, Any], cost_cal: dict[str, Any], steps: int,
                  groups: int) -> tuple[list[tuple[int, float]], list[str]]:
    """Per step: (shards per group, seconds per microstep). The shards and tokens each step made
    are the workload's (``workload_cal``: the run predicted, like its think times); the seconds
    they cost come from ``cost_cal`` (``microstep_fit``: seconds = s + s_per_token x tokens), so
    a run whose shards grow is predicted from one whose shards did not. Result files without the
    per-step figures give every step the run's median shards and the cost run's microstep time
    (said in ``assumed``)."""
    by_step, tokens, fit = workload_cal.get("microsteps_by_step"), workload_cal.get("tokens_by_step"), cost_cal.get("microstep_fit")
    if by_step and tokens and len(by_step) == len(tokens) == steps:
        out = []
        for n, t in zip(by_step, tokens):
            seconds = n * fit["s"] + fit["s_per_token"] * t if fit else n * cost_cal["microstep_s"]
            per_group = max(1, round(n / groups))
            out.append((per_group, max(1e-3, seconds / (per_group * groups))))
        return out, ([] if fit else ["microstep seconds independent of tokens"])
    per_group = max(1, round(workload_cal["microsteps_per_step"] / groups))
    return [(per_group, cost_cal["microstep_s"])] * steps, ["the same shards every step"]


def draw(quantiles: list[float], key: str) -> float:
    """A value from the measured quantiles, at a point fixed by ``key`` (linear between them)."""
    u = random.Random(f"gyre-overhead/{key}").random() * (len(quantiles) - 1)
    i = min(int(u), len(quantiles) - 2)
    return quantiles[i] + (u - i) * (quantiles[i + 1] - quantiles[i])


def sim_policy(trace: Trace, label: str, runs: RunSource, release: Release = "group", *,
               partial: bool = False) -> SimResult:
    """One of bench.elastic's runs by its label: a policy, ``async-K`` (K training cells) or
    ``colocate-sync`` (colocate at staleness 0)."""
    if label.startswith("async-"):
        wl = dataclasses.replace(trace.workload, async_train_cells=int(label.split("-", 1)[1]))
        return simulate(dataclasses.replace(trace, workload=wl), "async", runs=runs, release=release, partial=partial)
    if label == "colocate-sync":
        wl = dataclasses.replace(trace.workload, staleness=0)
        return simulate(dataclasses.replace(trace, workload=wl), "colocate", runs=runs, release=release, partial=partial)
    return simulate(trace, label, runs=runs, release=release, partial=partial)


def headline(train_s: dict[str, float]) -> dict[str, float]:
    """bench.elastic's headline ratios from seconds per run label: the best async split, the
    better colocate, and async with the conf's one training cell as a detail."""
    e = train_s["elastic"]
    asyncs = [v for k, v in train_s.items() if k == "async" or k.startswith("async-")]
    colocates = [v for k, v in train_s.items() if k in ("colocate", "colocate-sync")]
    return {"elastic_vs_best_async": min(asyncs) / e, "elastic_vs_colocate": min(colocates) / e,
            "elastic_vs_async": train_s["async"] / e}


HEADLINE = ("elastic_vs_best_async", "elastic_vs_colocate")


def calibrate(path: Path | None, fit: Path | None = None) -> dict[str, Any]:
    """Predict the run of ``path`` from the costs measured in ``fit`` (out of sample: another run,
    another workload shape) or, without ``fit``, from its own (in sample: consistency only)."""
    if path is None:
        return {"error": None, "reason": "no bench.elastic result file given (--calibrate runs/bench-elastic/result.json)"}
    try:
        result = load_result(path)
        fitted = load_result(fit) if fit is not None else None
        launch_cpu_s = fit_launch_cpu_s(fitted or result)
        trace, runs, assumed = embedded_trace(result, costs=fitted["calibration"] if fitted else None,
                                              launch_cpu_s=launch_cpu_s)
    except (CalibrationError, TraceError, OSError, KeyError, TypeError, ValueError) as exc:
        return {"error": None, "reason": f"cannot calibrate: {exc}"}
    release = embedded_setup(result)["algo"].get("release", "group")
    labels = [k for k in ("elastic", "async", "colocate") if result.get(f"{k}_s")] + sorted(
        k for k in (result.get("raw") or {}) if k.startswith("async-") or k == "colocate-sync")
    sims: dict[str, SimResult] = {k: sim_policy(trace, k, runs, release) for k in labels}
    measured_s = {k: (result["raw"][k]["train_s"] if k in (result.get("raw") or {}) else result[f"{k}_s"]) for k in labels}
    predicted_all = headline({k: r.makespan_s for k, r in sims.items()})
    measured_all = headline(measured_s)
    predicted = {k: predicted_all[k] for k in HEADLINE}
    measured = {k: measured_all[k] for k in HEADLINE}
    errors = {k: abs(predicted[k] - measured[k]) / measured[k] for k in predicted}
    bound = makespan_bound(trace, runs, release=release)
    out = {
        "error": max(errors.values()), "errors": errors, "predicted": predicted, "measured": measured,
        "in_sample": fit is None, "fit_file": str(fit) if fit else None,
        "predicted_async_1_cell": predicted_all["elastic_vs_async"], "measured_async_1_cell": measured_all["elastic_vs_async"],
        "predicted_s": {k: r.makespan_s for k, r in sims.items()}, "measured_s": measured_s,
        "result_file": str(path), "trace": dataclasses.asdict(trace.cells) | dataclasses.asdict(trace.workload),
        "shards_per_group_by_step": [trace.microsteps_of_step(s) for s in range(trace.workload.steps)],
        "assumed": assumed, "reason": "",
        "bound_s": bound, "ceiling": {"elastic_vs_best_async": min(v.makespan_s for k, v in sims.items() if k.startswith("async")) / bound,
                                      "elastic_vs_colocate": min(v.makespan_s for k, v in sims.items() if k.startswith("colocate")) / bound},
        "release": release,
        "throughput_vs_best_async": throughput_what_if(trace, runs)["ratio"],
        # harness starts sharing the cores: one start's CPU seconds, fitted to the cost run's
        # elastic overhead, and the median start each policy then has (measured: bench.elastic's
        # run_overhead_s)
        "launch_cpu_s": launch_cpu_s, "predicted_start_s": {k: r.start_s_median for k, r in sims.items()},
    }
    if fit is None:
        # The same, each policy's microsteps at the mean its own run measured: on a machine whose
        # cores the cells share with the rollouts, a cell that trains while others serve (elastic)
        # pays for it, which the one pooled median leaves out (the simulator models no CPU contention).
        own = own_microstep_costs(result)
        own_sims = {k: simulate(_with_microstep(trace, own[k]), k, runs=runs, release=release) for k in POLICIES} if own else None
        own_ratios = _ratios(own_sims) if own_sims else None
        # _ratios compares with the policies as configured: colocate at the run's staleness
        as_run = {k: result.get(f"{k}_staleness_1") or result[k] for k in own_ratios or {}}
        out |= {"own_microstep_s": own, "predicted_own": own_ratios,
                "error_own": max(abs(v - as_run[k]) / as_run[k] for k, v in own_ratios.items()) if own_ratios else None}
    return out


def _fmt(d: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:.3f}" for k, v in d.items()) + "}"


def own_microstep_costs(result: dict[str, Any]) -> dict[str, float] | None:
    """Each policy's mean microstep seconds in its own run (``raw`` of the result file), if all have them."""
    raw = result.get("raw") or {}
    costs = {}
    for k in POLICIES:
        run = raw.get(k) or {}
        if run.get("microstep_s_mean"):
            costs[k] = run["microstep_s_mean"]
        elif run.get("microstep_s"):  # result files before compact_raw kept the list
            costs[k] = sum(run["microstep_s"]) / len(run["microstep_s"])
    return costs if len(costs) == len(POLICIES) else None


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


RESULTS = ROOT / "bench" / "results"
FIT_RESULT = RESULTS / "elastic-stationary.json"
DRIFT_RESULT = RESULTS / "elastic-drift.json"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"only the first {QUICK_STEPS} steps of each trace")
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--drift", action="store_true",
                    help="headline on the drifting 2.4T-like trace (p2_4t_drift), and calibrate out of sample: "
                         f"costs from {FIT_RESULT.relative_to(ROOT)}, predicting {DRIFT_RESULT.relative_to(ROOT)}")
    ap.add_argument("--calibrate", type=Path, default=None, help="a bench.elastic result file to predict")
    ap.add_argument("--fit", type=Path, default=None,
                    help="the bench.elastic result file whose costs predict --calibrate's (default: its own, in sample)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", type=Path, default=None, help="simulate this one trace file (any workload)")
    ap.add_argument("--staleness", type=int, default=None, help="with --trace: its staleness bound instead")
    ap.add_argument("--moving", action="store_true", help="the moving-balance 2.4T-like trace at staleness 1 and 2")
    ap.add_argument("--partial", action="store_true",
                    help="with --moving or --trace: the what-if of every policy with partial rollouts, beside it")
    ap.add_argument("--stragglers", type=int, default=None, metavar="K",
                    help="with --moving or --trace: elastic again with scheduler.straggler_runs=K, beside it")
    args = ap.parse_args(argv)
    if args.partial and not (args.moving or args.trace):
        ap.error("--partial goes with --moving or --trace")
    if args.stragglers is not None and not (args.moving or args.trace):
        ap.error("--stragglers goes with --moving or --trace")
    if args.stragglers is not None and args.stragglers < 1:
        ap.error(f"--stragglers: want >= 1, got {args.stragglers}")
    if args.moving:
        out = moving_summary(args.traces / "p2_4t_moving.json", seed=args.seed, partial=args.partial,
                             straggler_runs=args.stragglers)
        print(json.dumps(out, sort_keys=True), flush=True)
        return out
    if args.trace is not None:
        trace = _load_user_trace(ap, args.trace, args.staleness)
        out = trace_summary(trace, seed=args.seed)
        if args.partial:
            out["partial_rollouts"] = partial_rollouts(trace, seed=args.seed, whole_h=out["hours"])
        if args.stragglers is not None:
            out["stragglers"] = stragglers_what_if(trace, seed=args.seed, straggler_runs=args.stragglers, summary=out)
        print(json.dumps(out, sort_keys=True), flush=True)
        return out
    if args.staleness is not None:
        ap.error("--staleness goes with --trace")
    if args.drift:
        args.calibrate = args.calibrate or DRIFT_RESULT
        args.fit = args.fit or FIT_RESULT
    t0 = time.monotonic()
    rows = table(args.traces, quick=args.quick, seed=args.seed)
    if not rows:
        ap.error(f"no traces in {args.traces}")
    print_table(rows)
    cal = calibrate(args.calibrate, args.fit)
    if cal["error"] is None:
        print(f"calibration: none ({cal['reason']})")
    else:
        kind = "in sample" if cal["in_sample"] else f"out of sample, costs from {cal['fit_file']}"
        print(f"calibration ({kind}) predicting {cal['result_file']} (release={cal['release']}): predicted "
              f"{_fmt(cal['predicted'])}, measured {_fmt(cal['measured'])}, error {cal['error']:.3f}; no policy "
              f"beats {cal['bound_s']:.1f} s there (ceilings {_fmt(cal['ceiling'])}); at every policy's throughput, "
              f"elastic would be {cal['throughput_vs_best_async']:.3f}x the best split")
        if cal.get("error_own") is not None:
            print(f"  with each policy's own mean microstep {_fmt(cal['own_microstep_s'])} s: predicted "
                  f"{_fmt(cal['predicted_own'])}, error {cal['error_own']:.3f}")
    what_if = what_if_run_release(args.traces, quick=args.quick, seed=args.seed)
    if what_if:
        print(f"what-if, runs released as graded (Megatron keeps no per-execution gradients): p2_4t "
              f"{what_if['p2_4t_vs_async']:.2f}x vs async, {what_if['p2_4t_vs_colocate']:.2f}x vs colocate "
              f"(its bound {what_if['bound_h']:.2f} h: ceilings {what_if['ceiling_vs_async']:.2f}x / "
              f"{what_if['ceiling_vs_colocate']:.2f}x)")
    name = "p2_4t_drift" if args.drift else "p2_4t"
    p24 = next((r for r in rows if r["trace"] == name), None)
    if args.drift and p24 is None:
        ap.error(f"--drift: no {name}.json in {args.traces} (python -m bench.traces.generate writes it)")
    sweep = by_staleness(args.traces, p24, quick=args.quick, seed=args.seed) if p24 else None
    if sweep:
        print(f"{name} by staleness bound (elastic vs best split / vs colocate, over the bound): " + "; ".join(
            f"{k}: {v['vs_best_async']:.3f}x / {v['vs_colocate']:.3f}x, {v['vs_bound']:.3f}x" for k, v in sweep.items()))
    out = {
        "trace": name,
        # the headline: the best fixed async split in hindsight, the better colocate, the bound
        "p2_4t_vs_best_async": p24["vs_best_async"] if p24 else None,
        "p2_4t_vs_colocate": p24["vs_best_colocate"] if p24 else None,
        "p2_4t_vs_bound": p24["vs_bound"] if p24 else None,
        # details: the trace's own async split (one training cell), colocate at staleness 1
        "p2_4t_vs_async": p24["vs_async"] if p24 else None,
        "p2_4t_vs_colocate_staleness_1": p24["vs_colocate"] if p24 else None,
        "p2_4t_ceiling_vs_best_async": p24["ceiling_vs_best_async"] if p24 else None,
        "p2_4t_ceiling_vs_best_colocate": p24["ceiling_vs_best_colocate"] if p24 else None,
        "p2_4t_ceiling_vs_async": p24["ceiling_vs_async"] if p24 else None,
        "p2_4t_throughput_vs_best_async": p24["throughput_vs_best_async"] if p24 else None,
        "p2_4t_ceiling_vs_colocate": p24["ceiling_vs_colocate"] if p24 else None,
        "calibration_error": cal["error"], "calibration_in_sample": cal.get("in_sample"),
        "calibration_error_own_microsteps": cal.get("error_own"),
        "calibration": cal, "table": rows, "what_if_run_release": what_if, "by_staleness": sweep,
        "config": {"traces": str(args.traces), "quick": args.quick, "seed": args.seed, "drift": args.drift,
                   "sim_wall_s": round(time.monotonic() - t0, 2)},
        "host": {"machine": platform.machine(), "system": f"{platform.system()} {platform.release()}",
                 "cpu_count": os.cpu_count()},
        "versions": {"python": sys.version.split()[0]},
    }
    print(json.dumps(out, sort_keys=True), flush=True)
    return out


if __name__ == "__main__":
    main()
