"""What a run leaves behind: metrics.jsonl as it goes, then summary.json and the plots.

    runs/<id>/metrics.jsonl   one JSON object per event (kind: step | switch | eval | progress)
    runs/<id>/summary.json    the run's figures (see write_summary)
    runs/<id>/reward.png      mean training reward per step, eval rewards marked
    runs/<id>/roles.png       each cell's role over time
    runs/<id>/water.png       the water level: queued and running executions against serving cells
    runs/<id>/runs.png        the training runs' wall time per step (how the workload moved)
    runs/<id>/report.md       the figures and the plots in one page
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from controller.execution_report import harness_table, read_executions
from controller.cells import Cell  # noqa: E402
from controller.loggers import Logger  # noqa: E402

log = logging.getLogger(__name__)

PHASE_COLORS = {"serving": "#4c9be8", "draining": "#f0b04c", "training": "#d9534f", "to_serve": "#9bd17c", "starting": "#cccccc", "dead": "#333333"}


class MetricsSink:
    """metrics.jsonl, and the same events to the run's loggers (controller.loggers). A logger that
    fails (W&B's service gone, a full disk under tb/) is logged once and dropped: the run and its
    metrics.jsonl go on."""

    def __init__(self, path: Path, loggers: list[Logger] | None = None):
        self.path = path
        self._f = open(path, "a", buffering=1)
        self.loggers = list(loggers or [])

    def log(self, kind: str, **fields: Any) -> None:
        self._f.write(json.dumps({"kind": kind, **fields}, sort_keys=True) + "\n")
        for logger in list(self.loggers):
            try:
                logger.event(kind, fields)
            except Exception:
                log.exception("logger %s failed on a %s event; dropped for the rest of the run", logger.name, kind)
                self.loggers.remove(logger)

    def close(self) -> None:
        self._f.close()
        for logger in self.loggers:
            try:
                logger.close()
            except Exception:
                log.exception("logger %s failed to close", logger.name)
        self.loggers = []


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def write_summary(run_dir: Path, *, steps: int, wall_s: float, eval_start: float | None, eval_end: float | None,
                  cells: list[Cell], now: float, extra: dict[str, Any]) -> dict[str, Any]:
    to_train = [s["total_s"] for c in cells for s in c.switches if s["role"] == "train"]
    to_serve = [s["total_s"] for c in cells for s in c.switches if s["role"] == "serve"]
    summary = {
        "steps": steps,
        "wall_s": round(wall_s, 3),
        "eval_reward_start": eval_start,
        "eval_reward_end": eval_end,
        "cells": [
            {"id": c.cell_id, "served_s": round(c.accounted(now)[0], 3), "trained_s": round(c.accounted(now)[1], 3),
             "switches": len(c.switches), "core": c.is_core}
            for c in cells
        ],
        "switch_s": {"to_train_median": median_or_none(to_train), "to_serve_median": median_or_none(to_serve)},
        **extra,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def plot_rewards(run_dir: Path, step_rewards: list[tuple[int, float]], eval_points: list[tuple[int, float]]) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if step_rewards:
        xs, ys = zip(*step_rewards)
        ax.plot(xs, ys, marker=".", label="training reward (mean of groups)")
    if eval_points:
        xs, ys = zip(*eval_points)
        ax.plot(xs, ys, "s--", color="black", label="held-out eval (greedy)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(run_dir / "reward.png", dpi=100)
    plt.close(fig)


def plot_roles(run_dir: Path, cells: list[Cell], t0: float, t_end: float) -> None:
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(cells) + 1.2))
    for c in cells:
        marks = c.timeline + [(t_end, c.phase)]
        for (start, phase), (end, _) in zip(marks, marks[1:]):
            ax.barh(c.cell_id, end - start, left=start - t0, color=PHASE_COLORS.get(phase, "#999999"), edgecolor="none")
    ax.set_yticks([c.cell_id for c in cells], [f"cell {c.cell_id}{' (core)' if c.is_core else ''}" for c in cells])
    ax.set_xlabel("seconds since start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=col) for col in PHASE_COLORS.values()]
    ax.legend(handles, list(PHASE_COLORS), ncol=6, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(run_dir / "roles.png", dpi=100)
    plt.close(fig)


def read_water_level(metrics_path: Path) -> list[tuple[float, int, int, int, int]]:
    """(t, queued, running, serving cells, training cells) from the ``progress`` events."""
    points = []
    try:
        lines = metrics_path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:
            continue  # a torn last line of a killed run
        if not isinstance(ev, dict) or ev.get("kind") != "progress" or "queued" not in ev:
            continue
        phases = list((ev.get("phases") or {}).values())
        points.append((float(ev["t"]), int(ev["queued"]), int(ev["running"]),
                       phases.count("serving"), phases.count("training")))
    return points


def plot_water_level(run_dir: Path) -> None:
    """What the elastic scheduler follows: queued + running executions (the water level) against
    the cells serving them; training cells on the same axis of cells."""
    points = read_water_level(run_dir / "metrics.jsonl")
    fig, ax = plt.subplots(figsize=(8, 3.5))
    if points:
        t, queued, running, serving, training = zip(*points)
        ax.stackplot(t, running, queued, labels=["running executions", "queued executions"],
                     colors=["#4c9be8", "#f0b04c"], alpha=0.8, step="post")
        cells_ax = ax.twinx()
        cells_ax.step(t, serving, where="post", color="black", label="serving cells")
        cells_ax.step(t, training, where="post", color="#d9534f", linestyle="--", label="training cells")
        cells_ax.set_ylabel("cells")
        cells_ax.set_ylim(0, max(max(serving), max(training), 1) + 0.5)
        cells_ax.legend(loc="upper right", fontsize=7)
    _finish(fig, ax, run_dir / "water.png", xlabel="seconds since start", ylabel="executions")


def read_run_lengths(metrics_path: Path) -> dict[int, tuple[list[float], int]]:
    """Step -> (wall seconds of its training runs, how many of them timed out), from the
    ``execution`` events."""
    out: dict[int, tuple[list[float], int]] = {}
    for run in read_executions(metrics_path):
        if run.get("train") and isinstance(run.get("step"), int) and isinstance(run.get("run_s"), (int, float)):
            lengths, timed_out = out.setdefault(run["step"], ([], 0))
            lengths.append(float(run["run_s"]))
            out[run["step"]] = (lengths, timed_out + (run.get("outcome") == "timed_out"))
    return out


def plot_run_lengths(run_dir: Path) -> None:
    """Median and slowest training run per step, and the share cut at the timeout: the shape of
    the workload the scheduler followed (a drifting one, ``workload.drift``, moves here)."""
    per_step = read_run_lengths(run_dir / "metrics.jsonl")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if per_step:
        steps = sorted(per_step)
        ax.plot(steps, [statistics.median(per_step[s][0]) for s in steps], marker=".", label="median run")
        ax.plot(steps, [max(per_step[s][0]) for s in steps], marker=".", label="slowest run")
        cut = ax.twinx()
        cut.bar(steps, [per_step[s][1] / len(per_step[s][0]) for s in steps], color="#d9534f", alpha=0.25,
                label="share timed out")
        cut.set_ylim(0, 1)
        cut.set_ylabel("share timed out")
        cut.legend(loc="upper right", fontsize=7)
    _finish(fig, ax, run_dir / "runs.png", xlabel="step", ylabel="wall seconds")


def _finish(fig: Any, ax: Any, path: Path, *, xlabel: str, ylabel: str) -> None:
    """Label, legend and grid a plot with a second axis on the right, and write it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(loc="upper left", fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_markdown(run_dir: Path, summary: dict[str, Any]) -> None:
    rows = "\n".join(
        f"| {c['id']}{' (core)' if c['core'] else ''} | {c['served_s']:.1f} | {c['trained_s']:.1f} | {c['switches']} |"
        for c in summary["cells"]
    )
    text = f"""# Gyre run report

- steps: {summary['steps']}, wall time: {summary['wall_s']:.1f} s
- held-out eval reward (greedy): {summary['eval_reward_start']} -> {summary['eval_reward_end']}
- median switch: serve->train {summary['switch_s']['to_train_median']} s, train->serve {summary['switch_s']['to_serve_median']} s

| cell | served s | trained s | switches |
| --- | --- | --- | --- |
{rows}

## Executions by harness

{harness_table(read_executions(run_dir / "metrics.jsonl"))}

Per execution: `execution` (outcome, wall time, reward) and `execution_facts` (calls by lineage,
tokens, tool calls, sub-agents, compactions) events in `metrics.jsonl`; each run's folder under
`work/` keeps its workspace, the harness's stdout and stderr, and `grade.json`.

![reward per step](reward.png)

![cell roles over time](roles.png)

![water level: queued and running executions against serving cells](water.png)

![training runs' wall time per step and the share timed out](runs.png)
"""
    (run_dir / "report.md").write_text(text)
