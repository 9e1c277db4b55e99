"""A run folder read for the viewer, read-only and forgiving: a half-written or killed run's files
(missing, empty, a torn last line, a torn processor log) give what can be read and a note saying
what could not, never an exception to the page."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller import wire
from trajectory.log import decode_marker, read_entries
from trajectory.sampling import select
from trajectory.tree import TokenTree, Trajectory

LOG_TAIL_BYTES = 8000


class RunFolderError(ValueError):
    """Not a run folder the viewer can show (the page says why)."""


@dataclass
class Run:
    path: Path
    notes: list[str] = field(default_factory=list)
    """What could not be read, for the page."""
    summary: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    executions: dict[str, dict[str, Any]] = field(default_factory=dict)
    """execution id -> its ``execution`` event (and ``execution_facts`` under ``facts``)."""
    records: dict[str, list[wire.CallRecord]] = field(default_factory=dict)
    grades: dict[str, wire.Grade] = field(default_factory=dict)
    tokenizer: Any = None
    max_trajectories: int = 5


@dataclass
class Tree:
    tree: TokenTree
    trajectories: list[Trajectory]
    kept: list[Trajectory]
    trained: bool
    """The execution's grade made it a training one that counted (its kept trajectories trained)."""
    refused: list[str]


def open_run(path: Path) -> Run:
    if not path.is_dir():
        raise RunFolderError(f"no run folder at {path}")
    run = Run(path=path)
    if not (path / "metrics.jsonl").exists() and not (path / "processor").exists():
        raise RunFolderError(f"{path} has neither metrics.jsonl nor processor/: not a Gyre run folder")
    run.summary = _json_file(run, path / "summary.json") or {}
    _read_metrics(run)
    _read_processor_log(run)
    _read_config(run)
    return run


def _json_file(run: Run, path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        run.notes.append(f"{path.name}: unreadable ({exc})")
        return None


def _read_metrics(run: Run) -> None:
    path = run.path / "metrics.jsonl"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        run.notes.append("metrics.jsonl: missing (the run has not written an event yet)")
        return
    bad = 0
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if not isinstance(ev, dict):
            bad += 1
        elif ev.get("kind") == "step":
            run.steps.append(ev)
        elif ev.get("kind") == "execution" and isinstance(ev.get("id"), str):
            run.executions.setdefault(ev["id"], {}).update(ev)
        elif ev.get("kind") == "execution_facts" and isinstance(ev.get("execution_id"), str):
            run.executions.setdefault(ev["execution_id"], {"id": ev["execution_id"]})["facts"] = ev
    if bad:
        run.notes.append(f"metrics.jsonl: {bad} line(s) not JSON (a run killed mid-write), skipped")


def _read_processor_log(run: Run) -> None:
    logs = sorted(run.path.glob("processor*/processor.log"))
    if not logs:
        run.notes.append("processor/processor.log: missing (no call recorded yet)")
    for path in logs:
        try:
            payloads, torn = read_entries(path)
        except OSError as exc:
            run.notes.append(f"{path.relative_to(run.path)}: unreadable ({exc})")
            continue
        if torn:
            run.notes.append(f"{path.relative_to(run.path)}: ends in {torn} bytes of a torn entry after "
                             f"{len(payloads)} good ones (the processor was killed mid-write); shown up to there")
        for payload in payloads:
            try:
                if decode_marker(payload) is not None:
                    continue
                msg = wire.decode(payload)
            except (ValueError, wire.ProtocolError):
                continue  # the processor refused it too
            if isinstance(msg, wire.CallRecord):
                run.records.setdefault(msg.execution_id, []).append(msg)
                run.executions.setdefault(msg.execution_id, {"id": msg.execution_id})
            elif isinstance(msg, wire.Grade):
                run.grades[msg.execution_id] = msg


def _read_config(run: Run) -> None:
    from harness_proxy.tokenizer import get_tokenizer

    cfg = _json_file(run, run.path / "cellrunner.json") or {}
    model = cfg.get("model") if isinstance(cfg, dict) else None
    algo = cfg.get("algo") if isinstance(cfg, dict) else None
    if isinstance(algo, dict) and isinstance(algo.get("max_trajectories_per_execution"), int):
        run.max_trajectories = algo["max_trajectories_per_execution"]
    try:
        run.tokenizer = get_tokenizer(model["tokenizer"], int(model["compact_ranks"]))
    except (TypeError, KeyError, ValueError):
        run.notes.append("cellrunner.json: no model tokenizer; tokens are shown as ids")


def build_tree(run: Run, execution_id: str) -> Tree:
    """The execution's call tree as the processor built it, and which trajectories the cap kept."""
    tree = TokenTree(execution_id)
    refused = []
    seen: set[str] = set()
    for r in run.records.get(execution_id, []):
        if r.call_id in seen:
            continue  # a resent record: the processor counts it once
        seen.add(r.call_id)
        try:
            tree.insert(r)
        except ValueError as exc:
            refused.append(f"{r.call_id}: {exc}")
    trajectories = tree.trajectories()
    kept = select(trajectories, max_trajectories=run.max_trajectories)
    g = run.grades.get(execution_id)
    trained = g is not None and g.train and g.outcome in ("finished", "timed_out") and g.reward is not None
    return Tree(tree=tree, trajectories=trajectories, kept=kept, trained=trained and not refused, refused=refused)


def work_file(run: Run, execution_id: str, name: str) -> str | None:
    """The tail of ``work/<execution>/<name>`` (any attempt's), or None."""
    for work in sorted(run.path.glob("work*")):
        path = work / execution_id / name
        if path.is_file() and path.resolve().is_relative_to(run.path.resolve()):
            with open(path, "rb") as f:
                f.seek(max(path.stat().st_size - LOG_TAIL_BYTES, 0))
                return f.read().decode(errors="replace")
    return None
