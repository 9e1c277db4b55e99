"""Tests of the ``viewer`` package, plus the helpers they share.

Run folders are written as a run leaves them: the processor's log by the processor's own service
(``ProcessorService``: frames logged before use, markers for what went out), ``processor.json``
and ``proxy.json`` as the controller hands them to the processor and the proxy.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from base import wire
from base.typed_config import to_dict
from tests.trajectory import algo
from trajectory.delivery import ProcessorService
from trajectory.log import AppendLog
from trajectory.processor import Processor

TOKENIZER = {"tokenizer": "qwen_compact", "compact_ranks": 4096}  # the proxy tests' TOK


def write_run(
    run_dir: Path,
    records: list[wire.Message],
    grades: list[wire.Grade],
    *,
    harness: str = "claude_code",
    min_usable: int = 1,
    max_trajectories: int = 5,
    attempt: int = 0,
) -> Counter:
    """A run folder for these records (CallRecords and ExecutionSealed, in arrival order) and
    grades (into attempt ``attempt``'s folders, ``processor.<k>/`` and ``work.<k>/``, when > 0);
    returns the policy tokens the processor sent to train, per execution."""
    suffix = f".{attempt}" if attempt else ""
    a = dataclasses.replace(algo(), max_trajectories_per_execution=max_trajectories)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "processor.json").write_text(json.dumps(
        {"algo": to_dict(a), "workload": {"min_usable_per_group": min_usable}}))
    (run_dir / "proxy.json").write_text(json.dumps({"model": TOKENIZER}))
    svc = ProcessorService(Processor(algo=a, min_usable=min_usable, max_trajectories=max_trajectories),
                           AppendLog(run_dir / f"processor{suffix}" / "processor.log", fsync=False))
    svc.replay()
    out = svc.on_record_frames([wire.encode(m) for m in records])
    out += svc.on_control_frames([wire.encode(g) for g in grades])
    svc.mark_delivered(out)
    svc.log.close()
    with open(run_dir / "metrics.jsonl", "a") as f:
        for g in grades:
            f.write(json.dumps({"kind": "execution", "id": g.execution_id, "step": g.step, "train": g.train,
                                "task": "t", "harness": harness, "outcome": g.outcome, "run_s": 12.5,
                                "reward": g.reward, "state": "graded"}) + "\n")
            work = run_dir / f"work{suffix}" / g.execution_id
            work.mkdir(parents=True, exist_ok=True)
            (work / "grade.json").write_text(json.dumps({"reward": g.reward, "error": None}))
            (work / "stdout.log").write_text(f"the harness's own words for {g.execution_id} in attempt {attempt}\n")
    sent: Counter = Counter()
    for m in out:
        if isinstance(m, wire.ShardReady):
            for s in m.shard.sequences:
                sent[s.execution_id] += sum(s.target_mask)
    return sent


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``folder`` with its size, mtime and bytes: to show nothing was written."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file()}
