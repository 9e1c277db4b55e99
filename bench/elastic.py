"""Elastic vs async vs colocate on the real embedded system: time to the same number of steps.

    .venv/bin/python -m bench.elastic [--workload stationary|drift|moving] [--quick | --cpu-bound] [--steps N]
                                      [--policies elastic,async,colocate] [--async-splits 2,3] [--lose-cell 3@10]
                                      [--[no-]colocate-sync] [--fit RESULT.json] [--release group|run]
                                      [--scale K] [--set KEY=VALUE ...] [--out FILE] [--root DIR]

Each policy runs once, in turn, as a real ``gyre`` (``python -m controller.main`` with Hydra
overrides, from ``--root``, this checkout by default): the same workload, the same 4 cells, the
same staleness bound (``scheduler.staleness``, the default 1). Async runs once per split (1
training cell, the conf's default, then ``--async-splits``) and colocate twice: as configured and
synchronous (``scheduler.staleness=0``: the next step's runs start when the cells serve again, so
none is stranded while every cell trains). The headline is what a user would compare:
``elastic_vs_best_async`` (the best split in hindsight) and ``elastic_vs_colocate`` (the better
colocate); ``elastic_vs_async`` (one training cell) and each run's ratio stay as details.

The workload is the bundled one with long-tailed harness durations (``workload.think_time``:
log-normal think time after each call, a function of the execution id, so every policy sees the
same runs) and a model large enough that training a step costs about as much as the rollout tail
(``BENCH_OVERRIDES``; the reasons are in the overrides' comments). ``--workload drift`` makes the
runs change as training goes (``DRIFT_OVERRIDES``, ``workloads/drift.py``): turns and think time
grow 4x from the first step to the last, and the task mix turns tool-heavy halfway.
``--workload moving`` alternates tool-heavy and token-heavy task families every 4 steps
(``MOVING_OVERRIDES``): the serving/training balance moves back and forth. ``--lose-cell 3@10``
kills satellite 3 (SIGKILL to its cellrunner) in every run once version 10 is applied: the
controller drops it and each policy finishes on the three left (the fixed splits keep a cell
serving), as the simulator's ``cell_losses`` do; ``bench.simulate --calibrate`` replays the loss.

Measured per run, from ``runs/<id>/``: ``train_s`` = time from the controller's first tick to the
last step's update (``metrics.jsonl``: ``progress`` and ``step`` events; process start-up is left
out), cells' switches and phases (``summary.json``), call latencies and the weight version of every
call (the processor's log of CallRecords: the staleness bound is checked on the real calls), and
microstep and weight-load times where the controller logs them (``microstep`` and
``weights_loaded`` events). The result file keeps everything ``bench.simulate --calibrate`` needs.
``calibration_error`` is the simulator's prediction of this run from *another* run's costs
(``--fit``; by default with ``--workload drift`` or ``moving``, ``bench/results/elastic-stationary.json``).

Ratios are ``train_s(other) / train_s(elastic)``: above 1, elastic reached the last step sooner.
One run per policy on a shared 2-core machine: expect +-10-20% between repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench.simulate import FIT_RESULT, calibrate, embedded_setup
from base import wire
from base.typed_config import build
from controller.traces import CellLoss
from trajectory.log import AppendLog, decode_marker
from workloads.config import WorkloadConfig
from workloads.drift import run_shape
from workloads.harness import think_times

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("elastic", "async", "colocate")
RUN_TIMEOUT_S = 900
"""Per run, times ``--scale``."""

# The workload: what every policy runs. Think time is long-tailed (log-normal, sigma 1, median
# 1.5 s over 3 calls) and runs past 10 s are killed and graded as they are (many near the
# timeout). 16 groups of 4 per step, so a step's shards arrive through its rollouts rather than
# all at the end; a serving cell holds 128 runs (two steps of 64: the tiny model's engine batches them).
#
# Each cell is an emulated accelerator (trainer.device_s_per_token, cellrunner/config.py): the
# tiny model's real forward-backward runs and the microstep is padded with sleep to 1.5 ms per
# token (~0.24 s per ~160-token shard, ~61 shards, ~15 s of device time per step), so training a
# step on one cell takes longer than the rollout tail: the regime where the policies differ
# (the pace came from the calibrated simulator: 1.1 ms measured 2.19x / 1.31x, predicted
# 2.14x / 1.28x; 1.5 ms predicted 2.75x / 1.55x; beyond it elastic itself runs out of cells).
# Without pacing the four cells' trainers share this machine's two cores and training on three
# cells is no faster than on one (``--cpu-bound`` runs that setup: a 448-wide model computing
# for real).
LONG_TAILED = (  # both setups' runs
    "run.eval_at_start=false", "run.eval_at_end=false", "run.progress_every_s=5",
    "workload.max_turns=3", "workload.timeout_s=10",
    "workload.think_time.kind=lognormal", "workload.think_time.median_s=1.5",
    "workload.think_time.sigma=1.0", "workload.think_time.max_s=12", "workload.think_time.seed=0",
)
BENCH_OVERRIDES = (
    *LONG_TAILED, "workload.groups_per_step=16", "workload.group_size=4", "workload.min_usable_per_group=2",
    "scheduler.capacity_per_cell=128", "trainer.device_s_per_token=0.0015", "algo.max_tokens_per_microstep=300",
)
# The model is 4 layers x 448 wide and shards hold ~400 tokens, so a step is 16 microsteps of
# ~0.7 s on one core, sharing the machine's cores with the other cells.
CPU_BOUND_OVERRIDES = (
    *LONG_TAILED, "model.hidden_size=448", "model.intermediate_size=1792", "model.num_hidden_layers=4",
    "algo.max_tokens_per_microstep=400",
)
# --workload drift: the balance moves as training goes (workloads/drift.py), the same for every
# policy. Turns and think time grow 4x from the first step to the last (1 to 4 turns, a 0.75 s
# to 3 s median: tokens per run grow with the turns), and from the middle step on the task mix
# is tool-heavier (twice the think time), so more runs reach the timeout.
DRIFT_OVERRIDES = tuple(o for o in BENCH_OVERRIDES if not o.startswith(("workload.max_turns=", "workload.think_time.median_s="))) + (
    "workload.max_turns=1", "workload.think_time.median_s=0.75", "workload.drift.growth=4.0",
    "workload.drift.mix_think=2.0", "workload.drift.mix_turns=1.0",
)
"""``workload.drift.over_steps`` and ``mix_step`` follow ``--steps`` (``drift_overrides``)."""
# --workload moving: the balance moves back and forth (workloads/drift.py, block_steps). Task
# families alternate in blocks of 4 steps, tool-heavy first. Tool-heavy runs: one turn and 4x the
# think time (a 6 s median against the 10 s timeout: many runs near it), so a step holds its 64
# slots for long and makes few tokens; at 32 runs a cell, a step needs two serving cells to run
# at once. Token-heavy runs: six turns and a quarter of the think time (0.4 s), so a step is
# short and has six times the turns to train. The best fixed split differs per family. Not yet
# measured: which split wins each family here is the bench's to say.
MOVING_OVERRIDES = tuple(o for o in BENCH_OVERRIDES
                         if not o.startswith(("workload.max_turns=", "scheduler.capacity_per_cell="))) + (
    "workload.max_turns=2", "scheduler.capacity_per_cell=32", "workload.drift.block_steps=4",
    "workload.drift.tool_think=4.0", "workload.drift.tool_turns=0.5",
    "workload.drift.token_think=0.25", "workload.drift.token_turns=3.0",
)
WORKLOADS = ("stationary", "drift", "moving")
FULL_STEPS = 20
# --quick: the plumbing only (tiny default model, short think time), a couple of steps. The
# timeout leaves room for 32 harnesses starting at once on 2 cores with a cold page cache (a fresh
# CI clone): at 5 s every run of a policy once timed out before its first call, leaving no call
# to check staleness on.
QUICK_OVERRIDES = (
    "run.eval_at_start=false", "run.eval_at_end=false", "run.progress_every_s=5",
    "workload.max_turns=2", "workload.timeout_s=30",
    "workload.think_time.kind=lognormal", "workload.think_time.median_s=0.3",
    "workload.think_time.sigma=1.0", "workload.think_time.max_s=2", "workload.think_time.seed=0",
)
QUICK_STEPS = 2


SCALED_KEYS = ("trainer.device_s_per_token", "workload.timeout_s", "workload.think_time.median_s",
               "workload.think_time.max_s")
"""``--scale K`` multiplies these: the emulated device's pace and the harnesses' time together, so
the workload keeps its shape (training against the rollout tail) while the real CPU work a step
needs (harness start-ups, the serving engine's compute, the microsteps' own forward-backward)
is spread over K times the wall time. On a slow or loaded 2-core machine that real work can
otherwise outlast the pace, and the bench measures the CPU instead of the scheduler."""


def scaled(overrides: tuple[str, ...], k: float) -> tuple[str, ...]:
    out = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key in SCALED_KEYS:
            value = repr(float(value) * k)
        out.append(f"{key}={value}")
    return tuple(out)


def drift_overrides(steps: int) -> tuple[str, ...]:
    return (*DRIFT_OVERRIDES, f"workload.drift.over_steps={steps}", f"workload.drift.mix_step={steps // 2}")


class BenchError(RuntimeError):
    pass


def run_policy(policy: str, *, root: Path, runs_dir: Path, steps: int, overrides: tuple[str, ...],
               label: str = "", timeout_s: float = RUN_TIMEOUT_S, lose: CellLoss | None = None) -> Path:
    """Run gyre once; return its run directory. ``label`` names the run (default: the policy).
    ``lose``: SIGKILL that satellite's cellrunner once that weight version is applied (the
    controller drops it and the run goes on with the rest); the run fails if it never was."""
    label = label or policy
    args = [sys.executable, "-m", "controller.main", f"scheduler={policy}", f"run.steps={steps}",
            f"run.runs_dir={runs_dir}", f"run.name=bench-{label}", *overrides]
    log_path = runs_dir / f"bench-{label}.log"
    runs_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(root)}
    before = {p for p in runs_dir.iterdir() if p.is_dir()}
    t0 = time.monotonic()
    done, killed = threading.Event(), {}
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(args, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
        if lose is not None:
            threading.Thread(target=_lose_cell, args=(runs_dir, before, lose, done, killed), daemon=True).start()
        try:
            returncode = proc.wait(timeout=timeout_s)
        finally:
            done.set()
            if proc.poll() is None:
                proc.kill()
    if returncode != 0:
        text = log_path.read_text(errors="replace")
        raise BenchError(f"{policy}: gyre exited {returncode}; see {log_path}:\n{text[-2000:]}")
    if lose is not None and "at_version" not in killed:
        raise BenchError(f"{label}: cell {lose.cell} was never lost (version {lose.at_version} not applied in time "
                         f"or its process not found): {killed.get('why', 'the run ended first')}")
    run_dir = run_dir_of(log_path, root)
    print(f"{label}: done in {time.monotonic() - t0:.0f}s -> {run_dir}", file=sys.stderr, flush=True)
    return run_dir


def parse_loss(text: str) -> CellLoss:
    """``CELL@VERSION`` -> the satellite to lose once that weight version is applied."""
    cell, sep, version = text.partition("@")
    try:
        if not sep:
            raise ValueError
        loss = CellLoss(cell=int(cell), at_version=int(version))
    except ValueError:
        raise BenchError(f"--lose-cell {text!r}: want CELL@VERSION, e.g. 3@10") from None
    if loss.cell < 1 or loss.at_version < 1:
        raise BenchError(f"--lose-cell {text!r}: a satellite (cell >= 1; cell 0 is the core) at a version >= 1")
    return loss


def _lose_cell(runs_dir: Path, before: set[Path], lose: CellLoss, done: threading.Event, report: dict) -> None:
    """Wait for the run's folder and for ``lose.at_version`` in its metrics, then ``kill_cell``."""
    run_dir = None
    while not done.is_set():
        if run_dir is None:
            new = [p for p in runs_dir.iterdir() if p.is_dir() and not p.is_symlink() and p not in before]
            run_dir = new[0] if len(new) == 1 else None
        elif _applied_version(run_dir) >= lose.at_version:
            if kill_cell(run_dir, lose.cell):
                report["at_version"] = _applied_version(run_dir)
            else:
                report["why"] = f"no cellrunner process for cell {lose.cell} of {run_dir}"
            return
        time.sleep(0.2)


def kill_cell(run_dir: Path, cell: int) -> bool:
    """SIGKILL the cellrunner of ``cell`` in the run at ``run_dir`` (its command line names both);
    False if there is none."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if ("cellrunner.main" in cmd and "--cell-id" in cmd and cmd[cmd.index("--cell-id") + 1] == str(cell)
                and any(str(run_dir) in c for c in cmd)):
            p.send_signal(signal.SIGKILL)
            return True
    return False


def _applied_version(run_dir: Path) -> int:
    """The newest weight version the run's metrics say was applied (0 before the first)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    newest = 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
            if event.get("kind") == "step":
                newest = max(newest, int(event["weight_version"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a line still being written
    return newest


def run_dir_of(log_path: Path, root: Path) -> Path:
    """The run folder a bench run's log names (its ``report in <dir>/report...`` line)."""
    marker = "report in "
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    line = next((ln for ln in text.splitlines() if marker in ln), "")
    if not line:
        raise BenchError(f"no 'report in' line in {log_path}")
    run_dir = Path(line.split(marker, 1)[1].strip()).parent
    return run_dir if run_dir.is_absolute() else root / run_dir


def read_metrics(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    events: dict[str, list[dict[str, Any]]] = {}
    for i, line in enumerate((run_dir / "metrics.jsonl").read_text().splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            raise BenchError(f"{run_dir}/metrics.jsonl:{i + 1}: not JSON") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str) or not isinstance(obj.get("t"), (int, float)):
            raise BenchError(f"{run_dir}/metrics.jsonl:{i + 1}: want an object with 'kind' and 't'")
        events.setdefault(obj["kind"], []).append(obj)
    return events


def read_calls(run_dir: Path) -> list[wire.CallRecord]:
    """Every CallRecord the processor accepted (its crash-safe log), decoded and validated."""
    log = AppendLog(run_dir / "processor" / "processor.log", fsync=False)
    try:
        out = []
        for payload in log.replay():
            if decode_marker(payload) is not None:
                continue
            msg = wire.decode(payload)  # ProtocolError on a bad frame: the bench stops, loudly
            if isinstance(msg, wire.CallRecord):
                out.append(msg)
        return out
    finally:
        log.close()


def step_of(execution_id: str) -> int | None:
    """Training executions are named ``s<step>-<group>-e<i>`` by the controller."""
    head = execution_id.split("-", 1)[0]
    return int(head[1:]) if head.startswith("s") and head[1:].isdigit() else None


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure(policy: str, run_dir: Path, *, steps: int, staleness: int, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run's figures; ``config`` (``{"steps", "overrides"}``) lets it check the think times."""
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("steps") != steps or summary.get("scheduler") != policy:
        raise BenchError(f"{policy}: {run_dir}/summary.json says steps={summary.get('steps')} "
                         f"scheduler={summary.get('scheduler')}, want {steps} and {policy}")
    ev = read_metrics(run_dir)
    if not ev.get("progress") or len(ev.get("step", [])) != steps:
        raise BenchError(f"{policy}: {run_dir}/metrics.jsonl lacks progress events or {steps} step events")
    t_start = ev["progress"][0]["t"]
    step_t = sorted(e["t"] for e in ev["step"])
    calls = read_calls(run_dir)
    # Only what an engine produced: the proxy's hang-up records (cell -1, no output) carry no tokens.
    lags = [s - c.weight_version for c in calls
            if c.cell_id >= 0 and c.output_ids and (s := step_of(c.execution_id)) is not None]
    switches = ev.get("switch", [])
    work = run_dir / "work"
    logs = sorted(work.glob("s*-e*/stdout.log"))  # each execution's folder (controller/executions.py)
    think = think_seconds(logs)
    return {
        "run_dir": str(run_dir),
        "train_s": step_t[-1] - t_start,
        "step_done_s": [t - t_start for t in step_t],
        "cells": summary["cells"],
        "switches": sum(c["switches"] for c in summary["cells"]),
        "executions_timed_out": summary.get("executions_timed_out"),
        "executions_crashed": summary.get("executions_crashed"),
        "groups_dropped": summary.get("groups_dropped"),
        "num_calls": len(calls),
        "max_staleness_seen": max(lags) if lags else None,
        "stale_calls": sum(1 for lag in lags if lag > staleness),
        # what a stale call was, to find out why (its step, the version it was served with, where)
        "stale_examples": [
            {"execution": c.execution_id, "call": c.call_index, "weight_version": c.weight_version, "cell": c.cell_id,
             "started_at": c.started_at}
            for c in calls if c.cell_id >= 0 and c.output_ids and (s := step_of(c.execution_id)) is not None
            and s - c.weight_version > staleness][:5],
        "staleness_ok": bool(lags) and max(lags) <= staleness,
        "engine_calls": len(lags),  # 0: no call to judge staleness on (every run timed out before its first)
        "think_time_applied": bool(logs) and len(think) == len(logs),
        "think_time_replayed": think_replayed(think, config),
        "call_s": sorted(c.finished_at - c.started_at for c in calls),
        "first_call_s": first_call_seconds(calls),
        "to_train_s": [e["total_s"] for e in switches if e.get("role") == "train"],
        "to_serve_s": [e["total_s"] for e in switches if e.get("role") == "serve"],
        "pull_s": [e["phases_s"]["pull"] for e in switches if "pull" in e.get("phases_s", {})],
        "apply_s": [e["apply_s"] for e in ev["step"] if "apply_s" in e],
        "microstep_s": [e["fb_s"] for e in ev.get("microstep", [])],
        "microstep_tokens": [e.get("num_tokens", 0) for e in ev.get("microstep", [])],
        "microsteps": len(ev.get("microstep", [])),
        # what the workload made each step (the same runs for every policy; cut runs make fewer)
        "microsteps_by_step": per_step(ev.get("microstep", []), steps, lambda e: 1),
        "tokens_by_step": per_step(ev.get("microstep", []), steps, lambda e: e.get("num_tokens", 0)),
        "load_s": [e["load_s"] for e in ev.get("weights_loaded", [])],
        "shard_latency_s": [e["shard_latency_s"] for e in ev.get("group", []) if e.get("shard_latency_s") is not None],
        "run_overhead_s": run_overheads(ev.get("execution", []), calls, think),
        # cells the controller dropped, with the newest version applied when it did
        "cells_lost": [{"cell": e["cell"], "at_version": max((s["weight_version"] for s in ev["step"] if s["t"] <= e["t"]),
                                                            default=0)} for e in ev.get("cell_lost", [])],
    }


def think_replayed(think: dict[str, float], config: dict[str, Any] | None) -> bool | None:
    """Whether every training run thought what ``think_times`` gives for its execution id and
    step (what bench.simulate replays); None without the config to check against."""
    if config is None or not think:
        return None
    workload = build(WorkloadConfig, embedded_setup({"config": config})["workload"])
    tt = workload.think_time
    for eid, seconds in think.items():
        step = step_of(eid)
        if step is None:
            continue
        shape = run_shape(workload, step)
        want = sum(think_times(seed=tt.seed, execution_id=eid, median_s=tt.median_s * shape.think_scale, sigma=tt.sigma,
                               max_s=tt.max_s, turns=shape.max_turns))
        if abs(want - seconds) > 2e-3:  # the log has three decimals
            return False
    return True


def per_step(events: list[dict[str, Any]], steps: int, value: Any) -> list[float]:
    out = [0.0] * steps
    for e in events:
        if isinstance(e.get("step"), int) and 0 <= e["step"] < steps:
            out[e["step"]] += value(e)
    return out


def microstep_fit(tokens: list[float], seconds: list[float]) -> dict[str, float] | None:
    """Least squares ``seconds = s + s_per_token * tokens`` over every microstep measured (the
    slowest 1% left out: a cell's first microstep also warms it up), so a run whose shards hold
    other token counts can be predicted."""
    pairs = sorted(zip(seconds, tokens))[: max(2, int(len(seconds) * 0.99))]
    if len(pairs) < 2:
        return None
    ys, xs = [p[0] for p in pairs], [p[1] for p in pairs]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var <= 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return {"s": my - b * mx, "s_per_token": b, "microsteps": len(pairs)}


def think_seconds(logs: list[Path]) -> dict[str, float]:
    """Execution id (the log's folder) -> the think time its harness applied (the log's
    ``harness: think <s>s ...`` line)."""
    think = {}
    for p in logs:
        words = p.read_text(errors="replace").split()
        if words[:2] == ["harness:", "think"]:
            think[p.parent.name] = float(words[2].rstrip("s"))
    return think


def run_overheads(executions: list[dict[str, Any]], calls: list[wire.CallRecord], think: dict[str, float]) -> list[float]:
    """Per finished training run: its wall time minus its think time minus its calls' latencies,
    i.e. harness start-up, per-turn harness and proxy work, and the controller noticing the end.
    The simulator's runs are only calls and think time, so this is the launch cost it is given."""
    in_calls: dict[str, float] = {}
    for c in calls:
        in_calls[c.execution_id] = in_calls.get(c.execution_id, 0.0) + (c.finished_at - c.started_at)
    return sorted(e["run_s"] - think[e["id"]] - in_calls[e["id"]] for e in executions
                  if e.get("train") and e.get("outcome") == "finished" and e["id"] in think and e["id"] in in_calls)


def first_call_seconds(calls: list[wire.CallRecord]) -> list[float]:
    """Each execution's first call: it carries the whole prompt's prefill, and it is the call that
    waits when a step's executions start together (the simulator needs it apart from the rest)."""
    first: dict[str, wire.CallRecord] = {}
    for c in calls:
        if c.cell_id >= 0 and (c.execution_id not in first or c.started_at < first[c.execution_id].started_at):
            first[c.execution_id] = c
    return sorted(c.finished_at - c.started_at for c in first.values())


def harness_start_s(root: Path, repeats: int = 5) -> float:
    """Seconds from spawning the bundled harness to its first line of work (interpreter + imports)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    times = []
    for _ in range(repeats):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "import workloads.harness"], cwd=root, env=env, check=True)
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def quantiles(values: list[float], n: int = 20) -> list[float]:
    """The 0, 1/n, ..., 1 quantiles of ``values`` (nearest rank), negatives as 0."""
    v = sorted(max(0.0, x) for x in values)
    return [v[round(i * (len(v) - 1) / n)] for i in range(n + 1)]


def pooled(results: dict[str, dict[str, Any]], key: str) -> float | None:
    return median([v for r in results.values() for v in r[key]])


def summarise(results: dict[str, dict[str, Any]], *, config: dict[str, Any], launch_s: float) -> dict[str, Any]:
    """The JSON line: ratios, per-policy figures, and the pooled timings the simulator needs."""
    e = results.get("elastic")
    ratio = {k: results[k]["train_s"] / e["train_s"] for k in results if e and k != "elastic"}
    # Async's pool split is a choice: the conf default (scheduler.train_cells=1) is the headline,
    # and the best of the splits run is reported beside it, so the comparison is not a strawman.
    splits = {k: v for k, v in ratio.items() if k == "async" or k.startswith("async-")}
    best_async = min(splits, key=splits.get) if splits else None
    # Colocate as run (staleness 1: the next step's runs start, then wait out every training
    # phase without a cell) and as a synchronous user runs it (staleness 0): the better one counts.
    colocates = {k: v for k, v in ratio.items() if k in ("colocate", "colocate-sync")}
    best_colocate = min(colocates, key=colocates.get) if colocates else None
    microsteps_per_step = [r["microsteps"] / config["steps"] for r in results.values() if r["microsteps"]]
    calibration = {
        "to_train_s": pooled(results, "to_train_s"), "to_serve_s": pooled(results, "to_serve_s"),
        "weight_transfer_s": pooled(results, "load_s") or pooled(results, "pull_s"),
        "apply_s": pooled(results, "apply_s"), "microstep_s": pooled(results, "microstep_s"),
        "microsteps_per_step": median(microsteps_per_step),
        "microstep_fit": microstep_fit([t for r in results.values() for t in r["microstep_tokens"]],
                                       [v for r in results.values() for v in r["microstep_s"]]),
        # per step, the median over the runs: the workload's shards and tokens as training moved it
        "microsteps_by_step": [median([r["microsteps_by_step"][s] for r in results.values()])
                               for s in range(config["steps"])],
        "tokens_by_step": [median([r["tokens_by_step"][s] for r in results.values()]) for s in range(config["steps"])],
        "call_s_p25": median([r["call_s"][len(r["call_s"]) // 4] for r in results.values() if r["call_s"]]),
        "call_s_median": pooled(results, "call_s"), "first_call_s_median": pooled(results, "first_call_s"),
        # A run's own overhead, measured where runs are never stalled (elastic); else harness start alone.
        # Its spread matters (a group waits for its slowest run), so the quantiles go too.
        "launch_s": median(e["run_overhead_s"]) if e and e["run_overhead_s"] else launch_s,
        "run_overhead_s_quantiles": quantiles(e["run_overhead_s"]) if e and e["run_overhead_s"] else None,
        "harness_start_s": launch_s, "grade_s": pooled(results, "shard_latency_s"),
    }
    per_policy = compact_raw(results)
    return {
        # The headline: the best fixed async split in hindsight and the better colocate.
        "elastic_vs_best_async": splits.get(best_async) if best_async else None,
        "elastic_vs_colocate": colocates.get(best_colocate) if best_colocate else None,
        "best_async": best_async, "best_colocate": best_colocate,
        # Details: async with one training cell (the conf's default), and each run as it came.
        "elastic_vs_async": ratio.get("async"), "elastic_vs_async_splits": splits,
        "elastic_vs_colocate_staleness_1": ratio.get("colocate"), "elastic_vs_colocate_sync": ratio.get("colocate-sync"),
        **{f"{k}_s": r["train_s"] for k, r in results.items()},
        "staleness_ok": all(r["staleness_ok"] for r in results.values()),
        "think_time_applied": all(r["think_time_applied"] for r in results.values()),
        "policies": per_policy, "calibration": calibration, "config": config, **run_info(),
    }


PER_CALL_KEYS = ("call_s", "first_call_s", "to_train_s", "to_serve_s", "pull_s", "apply_s", "load_s",
                 "shard_latency_s", "run_overhead_s", "microstep_tokens")


def compact_raw(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each run's figures for the result file: the per-call and per-event lists are summed up in
    ``calibration`` already, so they stay in the run folders; microsteps keep their mean."""
    out = {}
    for label, r in results.items():
        kept = {k: v for k, v in r.items() if k not in PER_CALL_KEYS and k != "microstep_s"}
        kept["microstep_s_mean"] = statistics.mean(r["microstep_s"]) if r.get("microstep_s") else None
        out[label] = kept
    return out


def run_info() -> dict[str, Any]:
    load = os.getloadavg()
    return {
        "host": {"machine": platform.machine(), "system": f"{platform.system()} {platform.release()}",
                 "cpu_count": os.cpu_count(), "loadavg_1m_at_end": round(load[0], 2)},
        "versions": {"python": sys.version.split()[0]},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def print_table(results: dict[str, dict[str, Any]]) -> None:
    e = results.get("elastic", {}).get("train_s")
    print(f"{'policy':9s} {'train_s':>8s} {'vs elastic':>10s} {'switches':>8s} {'timed out':>9s} {'max lag':>7s}")
    for k, r in results.items():
        rel = f"{r['train_s'] / e:.2f}x" if e else "-"
        print(f"{k:9s} {r['train_s']:8.1f} {rel:>10s} {r['switches']:8d} {r['executions_timed_out']!s:>9s} "
              f"{r['max_staleness_seen']!s:>7s}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny model, short think time, 2 steps")
    ap.add_argument("--cpu-bound", action="store_true",
                    help="no emulated accelerators: a larger model whose four trainers share this machine's cores")
    ap.add_argument("--workload", choices=WORKLOADS, default="stationary",
                    help="drift: runs grow 4x over the steps and the task mix changes halfway (DRIFT_OVERRIDES); "
                         "moving: tool-heavy and token-heavy task families alternate every 4 steps (MOVING_OVERRIDES)")
    ap.add_argument("--fit", type=Path, default=None,
                    help="a stationary bench.elastic result file whose costs predict this run (calibration_error, "
                         "out of sample); default with --workload drift or moving: bench/results/elastic-stationary.json")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--async-splits", default="2,3",
                    help="extra async runs with scheduler.train_cells=K (the plain async run uses the conf's, 1)")
    ap.add_argument("--colocate-sync", action=argparse.BooleanOptionalAction, default=True,
                    help="also run colocate as a synchronous user runs it (scheduler.staleness=0: the next "
                         "step's runs start when the cells serve again, none waits out its timeout stranded)")
    ap.add_argument("--release", choices=("group", "run"), default=None,
                    help="algo.release for every policy (default: conf/algo/gspo.yaml's)")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply the device pace, think time and timeout by this (SCALED_KEYS)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="one more Hydra override for every policy (repeatable), e.g. workload.harness_nice=19")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to run gyre from")
    ap.add_argument("--remeasure", action="store_true",
                    help="run nothing: measure the runs an earlier bench left in --runs-dir (same options)")
    ap.add_argument("--runs-dir", type=Path, default=None, help="default: <root>/runs/bench-elastic")
    ap.add_argument("--lose-cell", default=None, metavar="CELL@VERSION",
                    help="in every run, SIGKILL that satellite once that weight version is applied (e.g. 3@10)")
    ap.add_argument("--out", type=Path, default=None, help="result file; default <runs-dir>/result.json")
    args = ap.parse_args(argv)
    policies = tuple(p for p in args.policies.split(",") if p)
    if not policies or any(p not in POLICIES for p in policies):
        ap.error(f"--policies: a comma list of {POLICIES}")
    steps = args.steps or (QUICK_STEPS if args.quick else FULL_STEPS)
    try:
        lose = parse_loss(args.lose_cell) if args.lose_cell else None
    except BenchError as exc:
        ap.error(str(exc))
    if lose is not None and lose.at_version >= steps:
        ap.error(f"--lose-cell: version {lose.at_version} is not applied before the run's last step ({steps})")
    if args.workload != "stationary" and (args.quick or args.cpu_bound):
        ap.error(f"--workload {args.workload}: runs the paced bench setup (not with --quick or --cpu-bound)")
    overrides = (QUICK_OVERRIDES if args.quick else CPU_BOUND_OVERRIDES if args.cpu_bound
                 else drift_overrides(steps) if args.workload == "drift"
                 else MOVING_OVERRIDES if args.workload == "moving" else BENCH_OVERRIDES)
    if args.scale <= 0:
        ap.error("--scale: want > 0")
    overrides = scaled(overrides, args.scale) if args.scale != 1.0 else overrides
    if args.release:
        overrides = (*overrides, f"algo.release={args.release}")
    overrides = (*overrides, *args.set)
    runs_dir = (args.runs_dir or args.root / "runs" / "bench-elastic").resolve()
    staleness = 1  # conf/scheduler/*.yaml: the same bound for all three policies
    # (label, policy, extra overrides, staleness): every run of the bench, in order
    plan = [(p, p, (), staleness) for p in policies]
    splits = [int(k) for k in args.async_splits.split(",") if k] if "async" in policies and not args.quick else []
    plan += [(f"async-{k}", "async", (f"scheduler.train_cells={k}",), staleness) for k in splits]
    if "colocate" in policies and args.colocate_sync and not args.quick:
        plan.append(("colocate-sync", "colocate", ("scheduler.staleness=0",), 0))
    results = {}
    for label, policy, extra, bound in plan:
        if args.remeasure:
            run_dir = run_dir_of(runs_dir / f"bench-{label}.log", args.root)
        else:
            run_dir = run_policy(policy, root=args.root, runs_dir=runs_dir, steps=steps, label=label, lose=lose,
                                 timeout_s=RUN_TIMEOUT_S * max(1.0, args.scale), overrides=(*overrides, *extra))
        results[label] = measure(policy, run_dir, steps=steps, staleness=bound,
                                 config={"steps": steps, "overrides": list(overrides)})
    if not args.quick and not all(r["think_time_applied"] for r in results.values()):
        raise BenchError("the harness ran without think time: controller/executions.py must pass "
                         "workload.think_time to workloads.harness (--think-* arguments)")
    if not args.quick and not all(r["think_time_replayed"] for r in results.values()):
        raise BenchError("a harness's think time differs from workloads.harness.think_times for its execution id "
                         "(what bench.simulate replays): is the bundled harness told --think-key?")
    config = {"steps": steps, "workload": args.workload, "policies": list(policies), "overrides": list(overrides),
              "staleness": staleness, "scale": args.scale,
              "lose_cell": None if lose is None else {"cell": lose.cell, "at_version": lose.at_version},
              "quick": args.quick, "cpu_bound": args.cpu_bound, "root": str(args.root)}
    out = summarise(results, config=config, launch_s=harness_start_s(args.root))
    out_path = args.out or runs_dir / "result.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({**out, "raw": compact_raw(results)}, indent=1))
    # Out of sample: the simulator, given the costs another run measured, predicts this one.
    fit = args.fit or (FIT_RESULT if args.workload != "stationary" else None)
    cal = calibrate(out_path, fit) if fit is not None else {
        "error": None, "reason": "no --fit result file: an out-of-sample prediction needs another run's costs"}
    out |= {"calibration_error": cal["error"], "prediction": cal}
    out_path.write_text(json.dumps({**out, "raw": compact_raw(results)}, indent=1))
    print_table(results)
    print(f"result file: {out_path}", file=sys.stderr)
    print(json.dumps(out, sort_keys=True), flush=True)
    return out


if __name__ == "__main__":
    main()
