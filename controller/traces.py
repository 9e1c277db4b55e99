"""Trace files for the simulator: what a cluster costs and how long its harness runs take.

A trace is one JSON object (``FORMAT`` below), validated field by field on load; anything else is a
``TraceError`` naming the field. It holds no policy: the simulator runs every policy on the same
trace, with the staleness bound the trace names, so comparisons are matched.

    {"format": "gyre-trace/1", "name": ..., "description": ..., "generator": ...,
     "cells": {...CellCosts...}, "workload": {...WorkloadShape...},
     "reference_h": {"elastic": h, "async": h, "colocate": h} | null,
     "phases": [{"name": str, "first_step": int, "runs": [lo, hi],
                 "microsteps_per_group": int?, "microstep_s": float?}, ...],
     "executions": [[call_s, think_s, call_s, think_s, ...], ...],
     "eval": {"every": int, "runs": int}?,
     "cell_losses": [{"cell": int, "at_version": int}, ...]?}

``executions`` is a pool of harness runs. Each run alternates *call* segments (model time: it
needs a serving cell and stalls without one) and *think* segments (tool time: it runs whether or
not anything serves). ``phases`` say which slice ``executions[lo:hi]`` the runs of a step come
from (the last phase whose ``first_step`` is <= the step; the first phase starts at step 0), so a
trace can drift as training goes, e.g. runs that sit near the timeout in one stretch of steps.
The simulator draws each planned execution's run from its step's slice with a seeded generator,
so a small file describes a long run.

Two optional keys (absent: none, so older files load as they were): ``eval`` plans a held-out
round of ``runs`` runs at every ``every``-th weight version (not the last), drawn from that step's
slice; they need serving and train nothing. ``cell_losses`` kills a satellite (never cell 0, the
core) once a weight version is applied: its calls move elsewhere, its microsteps are trained
again, and it never comes back. ``workload.launch_cpus`` is optional too (absent: 0, each start
takes ``launch_s``).
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

FORMAT = "gyre-trace/1"
MAX_POOL = 100_000
MAX_SEGMENTS = 512


class TraceError(ValueError):
    """A trace file that is not a valid gyre-trace; the text names the field."""


@dataclass(frozen=True, kw_only=True)
class CellCosts:
    num_cells: int
    nodes_per_cell: int
    capacity_per_cell: int
    """Live executions one serving cell holds (the water level's unit)."""
    to_train_s: float
    """Serve -> train: drain, release the engine, start the trainer, pull the weights."""
    to_serve_s: float
    """Train -> serve: stop the trainer, pull the weights, start the engine."""
    weight_transfer_s: float
    """A satellite (serving or training) pulling a newly published weight version from the core."""
    grad_transfer_s: float
    """A satellite pushing its gradient sum to the core."""
    microstep_s: float
    """One microstep (one shard) on one cell running alone."""
    apply_s: float
    """The core's optimizer step once every gradient is in."""
    compute_slots: int
    """Cells that compute at full speed at once, counting a training cell in a microstep and a
    serving cell with calls in flight: ``num_cells`` on a cluster (each cell has its own GPUs, so
    it never binds); the CPU cores on the embedded machine, where every cell shares them."""
    reroute_s: float
    """Extra model time a call pays when its cell leaves serving mid-call (prefix recompute)."""

    def check(self) -> None:
        _positive("cells", num_cells=self.num_cells, nodes_per_cell=self.nodes_per_cell,
                  capacity_per_cell=self.capacity_per_cell, compute_slots=self.compute_slots,
                  microstep_s=self.microstep_s)
        _non_negative("cells", to_train_s=self.to_train_s, to_serve_s=self.to_serve_s,
                      weight_transfer_s=self.weight_transfer_s, grad_transfer_s=self.grad_transfer_s,
                      apply_s=self.apply_s, reroute_s=self.reroute_s)


@dataclass(frozen=True, kw_only=True)
class WorkloadShape:
    steps: int
    groups_per_step: int
    group_size: int
    timeout_s: float
    """A run past this (wall clock since launch, stalls included) is killed and graded as is."""
    microsteps_per_group: int
    """Shards the processor makes of one group."""
    launch_s: float
    """Harness start before its first call (workspace, process)."""
    grade_s: float
    """Last run of a group ended -> its shards are ready (grading, tree building, packing)."""
    staleness: int
    """Step s trains on data from weight versions >= s - staleness; the same for every policy."""
    async_train_cells: int
    """The fixed training pool of the ``async`` baseline."""
    launch_cpus: int = 0
    """0 (the key left out): every harness starts in ``launch_s``. N > 0: ``launch_s`` is the CPU
    time one start takes, and the starts under way share N CPUs, as on the embedded machine, where
    a step's harnesses start together on a few cores; a start alone still takes ``launch_s``."""

    def check(self) -> None:
        _positive("workload", steps=self.steps, groups_per_step=self.groups_per_step, group_size=self.group_size,
                  timeout_s=self.timeout_s, microsteps_per_group=self.microsteps_per_group,
                  async_train_cells=self.async_train_cells)
        _non_negative("workload", launch_s=self.launch_s, grade_s=self.grade_s, staleness=self.staleness,
                      launch_cpus=self.launch_cpus)


@dataclass(frozen=True, kw_only=True)
class Phase:
    name: str
    first_step: int
    runs: tuple[int, int]
    """``executions[lo:hi]``: the runs steps of this phase draw from."""
    microsteps_per_group: int = 0
    """Shards of one group in this phase's steps (runs with more tokens make more); 0: the
    workload's ``microsteps_per_group``."""
    microstep_s: float = 0.0
    """One microstep of this phase's steps (shards with more tokens take longer); 0: the cells'."""


@dataclass(frozen=True, kw_only=True)
class EvalRounds:
    every: int
    """A round at every this-many-th weight version applied (not the last)."""
    runs: int
    """Runs a round holds: serving only, never trained on."""

    def check(self) -> None:
        _positive("eval", every=self.every, runs=self.runs)


@dataclass(frozen=True, kw_only=True)
class CellLoss:
    cell: int
    """A satellite: 1..cells.num_cells-1 (cell 0 is the core)."""
    at_version: int
    """Lost once this weight version is applied."""

    def check(self) -> None:
        _positive("cell_losses", cell=self.cell, at_version=self.at_version)


@dataclass(frozen=True, kw_only=True)
class Trace:
    name: str
    description: str
    generator: str
    cells: CellCosts
    workload: WorkloadShape
    reference_h: dict[str, float] | None
    phases: tuple[Phase, ...]
    executions: tuple[tuple[float, ...], ...]
    eval: EvalRounds | None = None
    cell_losses: tuple[CellLoss, ...] = ()

    def check(self) -> None:
        self.cells.check()
        self.workload.check()
        if not 1 <= self.workload.async_train_cells < self.cells.num_cells:
            raise TraceError("workload.async_train_cells: want 1..cells.num_cells-1")
        if not self.executions:
            raise TraceError("executions: empty pool")
        if not self.phases or self.phases[0].first_step != 0:
            raise TraceError("phases: want at least one, the first with first_step 0")
        for i, ph in enumerate(self.phases):
            if i and ph.first_step <= self.phases[i - 1].first_step:
                raise TraceError(f"phases[{i}].first_step: want increasing")
            lo, hi = ph.runs
            if not 0 <= lo < hi <= len(self.executions):
                raise TraceError(f"phases[{i}].runs: want 0 <= lo < hi <= {len(self.executions)}, got {[lo, hi]}")
        if self.eval is not None:
            self.eval.check()
        lost = [loss.cell for loss in self.cell_losses]
        for loss in self.cell_losses:
            loss.check()
            if loss.cell >= self.cells.num_cells or loss.at_version >= self.workload.steps:
                raise TraceError(f"cell_losses: want a satellite 1..{self.cells.num_cells - 1} lost at a version "
                                 f"1..{self.workload.steps - 1}, got cell {loss.cell} at {loss.at_version}")
        if len(set(lost)) != len(lost) or len(lost) > self.cells.num_cells - 2:
            raise TraceError("cell_losses: each cell once, and at least two cells left (one to serve, one to train)")

    def phase_of_step(self, step: int) -> Phase:
        return [ph for ph in self.phases if ph.first_step <= step][-1]

    def runs_of_step(self, step: int) -> tuple[tuple[float, ...], ...]:
        phase = self.phase_of_step(step)
        return self.executions[phase.runs[0]:phase.runs[1]]

    def microsteps_of_step(self, step: int) -> int:
        return self.phase_of_step(step).microsteps_per_group or self.workload.microsteps_per_group

    def microstep_s_of_step(self, step: int) -> float:
        return self.phase_of_step(step).microstep_s or self.cells.microstep_s


def load_trace(path: str | Path) -> Trace:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TraceError(f"{path}: not a readable JSON file: {exc}") from None
    try:
        return parse_trace(raw)
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None


def parse_trace(raw: Any) -> Trace:
    optional = {"eval", "cell_losses"} & (set(raw) if isinstance(raw, dict) else set())
    obj = _mapping(raw, "trace", {"format", "name", "description", "generator", "cells", "workload",
                                  "reference_h", "phases", "executions"} | optional)
    if obj["format"] != FORMAT:
        raise TraceError(f"format: want {FORMAT!r}, got {obj['format']!r}")
    for key in ("name", "description", "generator"):
        if not isinstance(obj[key], str):
            raise TraceError(f"{key}: want a string")
    trace = Trace(
        name=obj["name"], description=obj["description"], generator=obj["generator"],
        cells=_dataclass(CellCosts, obj["cells"], "cells"),
        workload=_dataclass(WorkloadShape, obj["workload"], "workload"),
        reference_h=_reference(obj["reference_h"]),
        phases=_phases(obj["phases"]),
        executions=_pool(obj["executions"]),
        eval=_dataclass(EvalRounds, obj["eval"], "eval") if obj.get("eval") is not None else None,
        cell_losses=_cell_losses(obj.get("cell_losses", [])),
    )
    try:
        trace.check()
    except ValueError as exc:
        raise TraceError(str(exc)) from None
    return trace


def trace_to_json(trace: Trace) -> dict[str, Any]:
    """The file form; ``parse_trace(trace_to_json(t)) == t``."""
    return {
        "format": FORMAT, "name": trace.name, "description": trace.description, "generator": trace.generator,
        "cells": {f.name: getattr(trace.cells, f.name) for f in fields(CellCosts)},
        "workload": _fields_json(trace.workload),
        "reference_h": trace.reference_h,
        "phases": [{"name": ph.name, "first_step": ph.first_step, "runs": list(ph.runs)}
                   | ({"microsteps_per_group": ph.microsteps_per_group} if ph.microsteps_per_group else {})
                   | ({"microstep_s": ph.microstep_s} if ph.microstep_s else {})
                   for ph in trace.phases],
        "executions": [list(run) for run in trace.executions],
    } | ({"eval": {"every": trace.eval.every, "runs": trace.eval.runs}} if trace.eval is not None else {}) | (
        {"cell_losses": [{"cell": x.cell, "at_version": x.at_version} for x in trace.cell_losses]}
        if trace.cell_losses else {})


def write_trace(trace: Trace, path: str | Path) -> None:
    trace.check()
    Path(path).write_text(json.dumps(trace_to_json(trace), separators=(",", ":")) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- validation helpers


def _mapping(raw: Any, where: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise TraceError(f"{where}: want an object, got {type(raw).__name__}")
    if set(raw) != keys:
        missing, unknown = sorted(keys - set(raw)), sorted(set(raw) - keys)
        raise TraceError(f"{where}: missing {missing}, unknown {unknown}")
    return raw


def _fields_json(obj: Any) -> dict[str, Any]:
    """A dataclass's fields, less the optional ones left at their default (older readers and
    files stay as they were)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)
            if f.default is MISSING or getattr(obj, f.name) != f.default}


def _dataclass(cls: type, raw: Any, where: str) -> Any:
    names = {f.name: f.type for f in fields(cls)}
    optional = {f.name for f in fields(cls) if f.default is not MISSING}
    obj = _mapping(raw, where, (set(names) - optional) | (optional & (set(raw) if isinstance(raw, dict) else set())))
    kwargs = {}
    for name, hint in names.items():
        if name not in obj:
            continue
        value = obj[name]
        if hint in ("int", int):
            if type(value) is not int:
                raise TraceError(f"{where}.{name}: want an integer, got {value!r}")
        elif not _number(value):
            raise TraceError(f"{where}.{name}: want a finite number, got {value!r}")
        kwargs[name] = value if hint in ("int", int) else float(value)
    try:
        out = cls(**kwargs)
        out.check()
    except ValueError as exc:
        raise TraceError(str(exc)) from None
    return out


def _reference(raw: Any) -> dict[str, float] | None:
    if raw is None:
        return None
    obj = _mapping(raw, "reference_h", {"elastic", "async", "colocate"})
    for key, value in obj.items():
        if not _number(value) or value <= 0:
            raise TraceError(f"reference_h.{key}: want hours > 0, got {value!r}")
    return {k: float(v) for k, v in obj.items()}


def _phases(raw: Any) -> tuple[Phase, ...]:
    if not isinstance(raw, list) or not 1 <= len(raw) <= 1000:
        raise TraceError("phases: want a list of 1..1000 phases")
    out = []
    for i, item in enumerate(raw):
        optional = {"microsteps_per_group", "microstep_s"} & (set(item) if isinstance(item, dict) else set())
        obj = _mapping(item, f"phases[{i}]", {"name", "first_step", "runs"} | optional)
        microstep_s = obj.get("microstep_s", 0.0)
        if not _number(microstep_s) or microstep_s < 0:
            raise TraceError(f"phases[{i}].microstep_s: want seconds >= 0 (0 or absent: the cells')")
        runs = obj["runs"]
        per_group = obj.get("microsteps_per_group", 0)
        if type(per_group) is not int or per_group < 0:
            raise TraceError(f"phases[{i}].microsteps_per_group: want an integer >= 0 (0 or absent: the workload's)")
        if not isinstance(obj["name"], str):
            raise TraceError(f"phases[{i}].name: want a string")
        if type(obj["first_step"]) is not int or obj["first_step"] < 0:
            raise TraceError(f"phases[{i}].first_step: want an integer >= 0")
        if not (isinstance(runs, list) and len(runs) == 2 and all(type(v) is int for v in runs)):
            raise TraceError(f"phases[{i}].runs: want [lo, hi] integers")
        out.append(Phase(name=obj["name"], first_step=obj["first_step"], runs=(runs[0], runs[1]),
                         microsteps_per_group=per_group, microstep_s=float(microstep_s)))
    return tuple(out)


def _cell_losses(raw: Any) -> tuple[CellLoss, ...]:
    if not isinstance(raw, list) or len(raw) > 1000:
        raise TraceError("cell_losses: want a list of {cell, at_version} objects")
    return tuple(_dataclass(CellLoss, item, f"cell_losses[{i}]") for i, item in enumerate(raw))


def _pool(raw: Any) -> tuple[tuple[float, ...], ...]:
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_POOL:
        raise TraceError(f"executions: want a list of 1..{MAX_POOL} runs")
    out = []
    for i, run in enumerate(raw):
        if not isinstance(run, list) or not 1 <= len(run) <= MAX_SEGMENTS or len(run) % 2:
            raise TraceError(f"executions[{i}]: want [call_s, think_s, ...], an even count of 2..{MAX_SEGMENTS}")
        for j, seg in enumerate(run):
            if not _number(seg) or seg < 0:
                raise TraceError(f"executions[{i}][{j}]: want seconds >= 0, got {seg!r}")
        out.append(tuple(float(s) for s in run))
    return tuple(out)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(where: str, **values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise TraceError(f"{where}.{name}: want > 0, got {value!r}")


def _non_negative(where: str, **values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise TraceError(f"{where}.{name}: want >= 0, got {value!r}")
