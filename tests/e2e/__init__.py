"""End-to-end runs of the real ``gyre`` (controller.main) as a subprocess, short and small."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["workload.groups_per_step=2", "workload.group_size=4", "workload.min_usable_per_group=2",
         "workload.num_eval_tasks=4", "run.progress_every_s=5"]
"""Overrides that keep a run to a few seconds a step on two cores."""


def start_gyre(runs: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "controller.main", f"run.runs_dir={runs}", *SMALL, *overrides]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def run_gyre_with(
    runs: Path, meddle: Callable[[Path, threading.Event, dict], None], *overrides: str, timeout_s: float = 400,
    env: dict[str, str] | None = None,
) -> tuple[Path, dict]:
    """Run gyre to the end while ``meddle(run_dir, done, report)`` interferes from a thread (it
    should return once ``done`` is set); assert the run succeeded; return (run_dir, report)."""
    proc = start_gyre(runs, *overrides, env=env)
    run_dir = run_dir_of(runs)
    done, report = threading.Event(), {}
    threading.Thread(target=meddle, args=(run_dir, done, report), daemon=True).start()
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        done.set()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    return run_dir, report


def run_dir_of(runs: Path, timeout_s: float = 30) -> Path:
    """The run folder the controller creates under ``runs`` (waits for it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [p for p in runs.glob("*") if p.is_dir() and not p.is_symlink()] if runs.exists() else []
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no run directory appeared under {runs}")


def metrics(run_dir: Path, kind: str | None = None) -> list[dict]:
    """metrics.jsonl as it stands (a line being written is skipped), optionally one kind only."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if kind is None or event.get("kind") == kind:
            out.append(event)
    return out


def call_records(run_dir: Path) -> list:
    """Every CallRecord in the run's processor log (the processor's own markers skipped)."""
    from base import wire
    from trajectory.log import AppendLog

    out = []
    for frame in AppendLog(run_dir / "processor/processor.log", fsync=False).scan():
        try:
            msg = wire.decode(frame)
        except wire.ProtocolError:
            continue
        if isinstance(msg, wire.CallRecord):
            out.append(msg)
    return out


def member_socket(ctx, run_dir: Path, name: str, kind: int, server: str):
    """A ZeroMQ socket holding run member ``name``'s CURVE key (from the run's keys folder), ready
    to connect to member ``server``: what a process of the run may do, for tests that misbehave
    as one."""
    import zmq

    from base import curve

    keys = curve.load_keys(run_dir / "keys", name)
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public_of(server))
    return sock
