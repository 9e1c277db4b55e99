"""A run folder read for the viewer: read-only, forgiving, and as the run's own processes saw it.

Each processor log is fed, frame by frame, to the processor's own state machine
(``trajectory.processor.Processor``, built from the ``processor.json`` the run gave it), so what
the page says trained is what the processor sent to train, not a second opinion. Logs are read
from where the last read stopped (a live run costs only its new entries), and only the entries'
offsets are kept: an execution's CallRecords are read again when its page is asked for.

A half-written or killed run (files missing, empty, a torn last line or log entry) gives what can
be read and a note saying what could not, never an exception. Nothing in the folder is written.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from base import wire
from base.typed_config import build
from base.tokenizer import QwenTokenizer, get_tokenizer
from trajectory.delivery import ProcessorService
from trajectory.log import decode_marker, read_from
from trajectory.main import ProcessorConfig
from trajectory.processor import Processor

LOG_TAIL_BYTES = 8000
"""Of the harness's stdout.log and stderr.log, the page shows this much of the end."""
ATTEMPT_DIR = re.compile(r"(processor|work)(?:\.([1-9][0-9]*))?")
"""``processor/`` and ``work/`` of a run's first attempt, ``processor.<k>/`` and ``work.<k>/`` of
attempt k of a resumed run (controller ``attempt_dir``)."""


class RunFolderError(ValueError):
    """Not a run folder the viewer can show (the page says why)."""


@dataclass
class LogScan:
    """One processor log (``processor/`` or a resumed attempt's ``processor.<k>/``), read so far."""

    path: Path
    attempt: int
    processor: Processor | None
    """The processor's state machine, fed what the log holds; None when the run's config is
    unknown or it refused the log (``failure``): then nothing is known about what trained."""
    read_to: int = 0
    """End of the last good entry: the next read starts here."""
    num_entries: int = 0
    torn_bytes: int = 0
    failure: str = ""
    records: dict[str, list[int]] = field(default_factory=dict)
    """execution id -> offsets of its CallRecords, as the processor took them (not late, no resend)."""
    grades: dict[str, wire.Grade] = field(default_factory=dict)
    sealed: dict[str, wire.ExecutionSealed] = field(default_factory=dict)
    targets: Counter = field(default_factory=Counter)
    """execution id -> policy tokens the processor sent to train (its ShardReady sequences)."""
    dropped: dict[str, str] = field(default_factory=dict)
    """group id -> why the processor dropped it."""

    def advance(self) -> None:
        for start, end, payload in read_from(self.path, self.read_to):
            self.read_to = end
            self.num_entries += 1
            try:
                if decode_marker(payload) is not None:
                    continue  # what went out; the state machine rebuilds the same from the frames
                msg = wire.decode(payload, expect=ProcessorService.RECORD_MESSAGES + (wire.Grade,))
            except ValueError:
                continue  # the processor refused it on replay too
            self._take(start, msg)
        self.torn_bytes = self.path.stat().st_size - self.read_to

    def _take(self, offset: int, msg: wire.Message) -> None:
        if isinstance(msg, wire.Grade):
            self.grades.setdefault(msg.execution_id, msg)
        elif isinstance(msg, wire.ExecutionSealed):
            self.sealed.setdefault(msg.execution_id, msg)
        before = self._ignored()
        if self.processor is not None:
            try:
                outs = self.processor.on_message(msg)
            except Exception as exc:  # the run's log broke the processor: say so, keep indexing
                self.failure = f"the processor's state machine failed on entry {self.num_entries}: {exc!r}"
                self.processor = None
                outs = []
            for out in outs:
                if isinstance(out, wire.ShardReady):
                    for s in out.shard.sequences:
                        self.targets[s.execution_id] += sum(s.target_mask)
                elif isinstance(out, wire.GroupDone) and out.dropped:
                    self.dropped[out.group_id] = out.dropped
        if isinstance(msg, wire.CallRecord) and self._ignored() == before:
            self.records.setdefault(msg.execution_id, []).append(offset)

    def _ignored(self) -> int:
        """Records the processor passed over (late, or sent again): they are not in its tree."""
        c = self.processor.counters if self.processor else None
        return c.num_late_records + c.num_duplicate_records if c else 0


@dataclass
class Run:
    """The run as read at one moment (a snapshot the pages render)."""

    path: Path
    notes: list[str]
    """What could not be read, for the page."""
    summary: dict[str, Any]
    steps: list[dict[str, Any]]
    executions: dict[str, dict[str, Any]]
    """execution id -> its ``execution`` event (``execution_facts`` under ``facts``)."""
    logs: list[LogScan]
    """In attempt order."""
    tokenizer: QwenTokenizer | None
    config: ProcessorConfig | None

    def scans_of(self, execution_id: str) -> list[LogScan]:
        """The logs that hold the execution, oldest attempt first. A resumed run runs its interrupted
        step again under the same execution ids; the last attempt's is the one that counted."""
        return [s for s in self.logs if execution_id in s.records or execution_id in s.grades]

    def scan_of(self, execution_id: str) -> LogScan | None:
        scans = self.scans_of(execution_id)
        return scans[-1] if scans else None

    def records(self, execution_id: str) -> list[wire.CallRecord]:
        scan = self.scan_of(execution_id)
        out = []
        for offset in scan.records.get(execution_id, []) if scan else []:
            _, _, payload = next(read_from(scan.path, offset))
            msg = wire.decode(payload)
            assert isinstance(msg, wire.CallRecord)  # it was one when the offset was taken
            out.append(msg)
        return out


class RunReader:
    """The run folder, read again as it grows; thread-safe (the server answers in threads)."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._scans: dict[Path, LogScan] = {}
        self._config: tuple[ProcessorConfig | None, QwenTokenizer | None, list[str]] | None = None
        self._metrics_key: tuple[int, int] | None = None
        self._metrics: tuple[list[dict], dict[str, dict], list[str]] = ([], {}, [])

    def read(self) -> Run:
        if not self.path.is_dir():
            raise RunFolderError(f"no run folder at {self.path}")
        if not (self.path / "metrics.jsonl").exists() and not any(self.path.glob("processor*")):
            raise RunFolderError(f"{self.path} has neither metrics.jsonl nor processor/: not a Gyre run folder")
        with self._lock:
            if self._config is None or self._config[0] is None:  # a starting run writes it soon
                fresh = read_config(self.path)
                if self._config is None or fresh[0] is not None:
                    self._config = fresh
                    self._scans.clear()  # fed without the processor's config: feed them again with it
            config, tokenizer, notes = self._config
            notes = list(notes)
            steps, executions, metric_notes = self._read_metrics()
            notes += metric_notes
            summary = _json_file(self.path / "summary.json", notes) or {}
            logs = self._read_logs(config, notes)
        executions = {k: dict(v) for k, v in executions.items()}
        for scan in logs:
            for eid in scan.records.keys() | scan.grades.keys():
                executions.setdefault(eid, {"id": eid})
        return Run(path=self.path, notes=notes, summary=summary if isinstance(summary, dict) else {},
                   steps=steps, executions=executions, logs=logs, tokenizer=tokenizer, config=config)

    def _read_metrics(self) -> tuple[list[dict], dict[str, dict], list[str]]:
        path = self.path / "metrics.jsonl"
        try:
            st = path.stat()
        except OSError:
            return [], {}, ["metrics.jsonl: missing (the run has not written an event yet)"]
        if (st.st_size, st.st_mtime_ns) != self._metrics_key:
            self._metrics_key = (st.st_size, st.st_mtime_ns)
            self._metrics = parse_metrics(path.read_text(errors="replace"))
        return self._metrics

    def _read_logs(self, config: ProcessorConfig | None, notes: list[str]) -> list[LogScan]:
        paths = sorted((attempt, p) for p in self.path.glob("processor*/processor.log")
                       if (attempt := attempt_of(p.parent.name)) is not None)
        if not paths:
            notes.append("processor/processor.log: missing (no call recorded yet)")
        for attempt, path in paths:
            scan = self._scans.get(path)
            try:
                if scan is None or path.stat().st_size < scan.read_to:  # new, or not the file we read
                    scan = self._scans[path] = LogScan(path, attempt, new_processor(config))
                scan.advance()
            except OSError as exc:
                notes.append(f"{path.relative_to(self.path)}: unreadable ({exc})")
                continue
            name = path.relative_to(self.path)
            if scan.torn_bytes:
                notes.append(f"{name}: log ends in a torn entry after {scan.num_entries} entries ({scan.torn_bytes} "
                             "bytes: a processor killed, or still writing, mid-entry); shown up to there")
            if scan.failure:
                notes.append(f"{name}: {scan.failure}; what trained is not known past it")
        return [self._scans[p] for _, p in paths if p in self._scans]


def parse_metrics(text: str) -> tuple[list[dict], dict[str, dict], list[str]]:
    """``step`` events, and ``execution`` (with ``execution_facts``) events by execution id."""
    steps: list[dict] = []
    executions: dict[str, dict] = {}
    bad = 0
    for line in text.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if not isinstance(ev, dict):
            bad += 1
        elif ev.get("kind") == "step":
            steps.append(ev)
        elif ev.get("kind") == "execution" and isinstance(ev.get("id"), str):
            executions.setdefault(ev["id"], {}).update(ev)  # a resumed run's later attempt wins
        elif ev.get("kind") == "execution_facts" and isinstance(ev.get("execution_id"), str):
            executions.setdefault(ev["execution_id"], {"id": ev["execution_id"]})["facts"] = ev
    notes = [f"metrics.jsonl: {bad} line(s) not JSON (a run killed mid-write), skipped"] if bad else []
    return steps, executions, notes


def read_config(path: Path) -> tuple[ProcessorConfig | None, QwenTokenizer | None, list[str]]:
    """The processor's config and the proxy's tokenizer, from the files the controller gave them."""
    notes: list[str] = []
    config = tokenizer = None
    data = _json_file(path / "processor.json", notes)
    try:
        config = build(ProcessorConfig, data)
    except (ValueError, TypeError) as exc:
        notes.append(f"processor.json: {'missing' if data is None else exc}; what the cap kept and what "
                     "trained are not known")
    model = (_json_file(path / "proxy.json", notes) or {}).get("model")
    try:
        tokenizer = get_tokenizer(model["tokenizer"], int(model["compact_ranks"]))
    except (TypeError, KeyError, ValueError):
        notes.append("proxy.json: no model tokenizer; tokens are shown as ids")
    return config, tokenizer, notes


def new_processor(config: ProcessorConfig | None) -> Processor | None:
    if config is None:
        return None
    return Processor(algo=config.algo, min_usable=config.workload.min_usable_per_group,
                     max_trajectories=config.algo.max_trajectories_per_execution)


def _json_file(path: Path, notes: list[str]) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        notes.append(f"{path.name}: unreadable ({exc})")
        return None


def attempt_of(name: str) -> int | None:
    m = ATTEMPT_DIR.fullmatch(name)
    return int(m.group(2) or 0) if m else None


def work_file(run: Run, execution_id: str, name: str) -> str | None:
    """The tail of ``work/<execution>/<name>`` of the attempt whose log shows the execution (the
    latest with the file when no log does), or None."""
    scan = run.scan_of(execution_id)
    works = sorted(((attempt_of(p.name), p) for p in run.path.glob("work*") if attempt_of(p.name) is not None),
                   reverse=True)
    for attempt, work in works:
        if scan is not None and attempt != scan.attempt:
            continue
        path = work / execution_id / name
        if path.is_file() and path.resolve().is_relative_to(run.path.resolve()):
            with open(path, "rb") as f:
                f.seek(max(path.stat().st_size - LOG_TAIL_BYTES, 0))
                return f.read().decode(errors="replace")
    return None
