"""bench.soak: the embedded default trained for a long while as a chaos loop SIGKILLs one of its
processes every 20-60 s, then checked for what must hold whatever was killed.

    python -m bench.soak                       # 30 minutes (make bench)
    python -m bench.soak --minutes 3 --kill-every 5,10   # a short look
    python -m bench.soak --minutes 60 --no-kills         # the same run left alone: the baseline

The run is one ``run.run_id``. Victims, drawn at random among those alive: the trajectory
processor (the controller restarts it in place), the harness proxy, the core cell, a satellite
cell (dropped in place), or the controller itself. A kill the run cannot ride out stops that
attempt with the reason; the soak then starts the same ``run.run_id`` again, which resumes from
the newest checkpoint (as an operator, or a requeued Slurm job, would). After ``--minutes`` the
chaos stops, the attempt in flight is stopped, and a last attempt trains two more steps and runs
the end eval.

Prints one JSON object last:

- ``kills`` (and ``kills_by_kind``), ``attempts`` (of ours: ``gyre`` also resumes by itself after
  a core's death, ``run.auto_resume``; ``resumes`` counts every resume);
- ``versions_applied_once``: each attempt applies consecutive versions from where it resumed,
  and the run's final line of versions (each attempt's, cut where the next resumed) is 1..N, once
  each (a checkpoint one past an attempt's last logged step counts: the core applied and saved it);
- ``records_lost``: calls a harness was answered (its ``harness: answered <id>`` lines, in every
  attempt's workspaces) whose CallRecord is in no attempt's processor log (``answered_calls``);
- ``shards_trained_twice``: per applied step, shards trained more than once by the cells whose
  gradients the step counted (a lost cell's microsteps are trained again and not counted twice);
- ``recovery_s``: per kind of kill, the median and the longest time from the kill to the next
  step applied (a restart in place, or a new attempt's start and resume: what a kill costs);
- ``core_kills_resumed``: each core kill against ``gyre``'s own resume before the controller was
  next killed (``every_core_kill_resumed_by_gyre``);
- ``train_reward_by_5min``: the mean training reward of the steps applied in each 5 minutes, and
  whether the last 5 minutes are not below minutes 5-10 (a collapse shows there);
- ``eval_reward_end``: the last attempt's end eval; ``final_version``; ``orphans``: processes
  of a dead attempt still alive 60 s after it ended (killed then, and counted).

``python -m bench.soak --report RUNS_DIR`` prints the same object for a soak kept in ``RUNS_DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from base import wire
from trajectory.log import AppendLog, decode_marker

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = (
    "workload.groups_per_step=2", "workload.group_size=4", "workload.min_usable_per_group=2",
    "workload.num_eval_tasks=4", "run.progress_every_s=30", "run.checkpoint_every=1",
    "run.eval_at_start=false", "run.eval_at_end=false",
)
LONG_RUN_STEPS = 100_000
"""Steps of a chaos attempt: more than 30 minutes can train, so the chaos ends them, not the count."""
ORPHAN_GRACE_S = 60.0
KINDS = ("processor", "proxy", "core", "satellite", "controller")


class Soak:
    def __init__(self, runs: Path, run_id: str, rng: random.Random):
        self.runs, self.run_id, self.rng = runs, run_id, rng
        self.run_dir = runs / run_id
        self.proc: subprocess.Popen | None = None
        self.attempts: list[dict[str, Any]] = []
        self.kills: list[dict[str, Any]] = []
        self.orphans = 0
        self.lock = threading.Lock()

    # -------------------------------------------------------------- attempts

    def start(self, *extra: str) -> None:
        metrics = self.run_dir / "metrics.jsonl"
        start_line = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        argv = [sys.executable, "-m", "controller.main", f"run.runs_dir={self.runs}", f"run.run_id={self.run_id}",
                *OVERRIDES, *extra]
        log = open(self.runs / f"attempt{len(self.attempts)}.log", "wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.attempts.append({"start_line": start_line, "pid": self.proc.pid, "extra": list(extra)})

    def end_attempt(self) -> None:
        """Wait for what is left of the attempt to exit (a dead controller's children leave on
        their own); kill and count what is still there after ORPHAN_GRACE_S."""
        assert self.proc is not None
        rc = self.proc.wait()
        self.attempts[-1]["rc"] = rc
        deadline = time.monotonic() + ORPHAN_GRACE_S
        while (left := self.run_processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        for p in self.run_processes():
            self.orphans += 1
            try:
                p.kill()
            except psutil.Error:
                pass

    def run_processes(self) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter(["cmdline", "status"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if str(self.run_dir) in cmd and p.info["status"] != psutil.STATUS_ZOMBIE and p.pid != os.getpid():
                out.append(p)
        return out

    # -------------------------------------------------------------- chaos

    def victims(self) -> dict[str, list[psutil.Process]]:
        found: dict[str, list[psutil.Process]] = {k: [] for k in KINDS}
        if self.proc is None or self.proc.poll() is not None:
            return found
        found["controller"].append(psutil.Process(self.proc.pid))
        for p in self.run_processes():
            cmd = p.info["cmdline"] or []
            if "trajectory.main" in cmd:
                found["processor"].append(p)
            elif "harness_proxy.main" in cmd:
                found["proxy"].append(p)
            elif "cellrunner.main" in cmd and "--cell-id" in cmd:
                found["core" if cmd[cmd.index("--cell-id") + 1] == "0" else "satellite"].append(p)
        return found

    def kill_one(self, t0: float) -> None:
        alive = {k: ps for k, ps in self.victims().items() if ps}
        if not alive:
            return
        kind = self.rng.choice(sorted(alive))
        victim = self.rng.choice(alive[kind])
        try:
            victim.send_signal(signal.SIGKILL)
        except psutil.Error:
            return
        with self.lock:
            self.kills.append({"t": round(time.monotonic() - t0, 1), "wall": time.time(), "kind": kind,
                               "attempt": len(self.attempts) - 1})
        print(f"soak: {time.monotonic() - t0:7.1f}s killed the {kind} (pid {victim.pid})", file=sys.stderr, flush=True)

    def chaos(self, t0: float, deadline: float, every: tuple[float, float], stop: threading.Event) -> None:
        while not stop.wait(self.rng.uniform(*every)) and time.monotonic() < deadline:
            self.kill_one(t0)


# ------------------------------------------------------------------ the checks


def events_by_attempt(run_dir: Path, attempts: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    out = []
    for i, a in enumerate(attempts):
        end = attempts[i + 1]["start_line"] if i + 1 < len(attempts) else len(lines)
        events = []
        for line in lines[a["start_line"]:end]:
            try:
                events.append(json.loads(line))
            except ValueError:
                continue  # a line torn by a kill
        out.append(events)
    return out


def segments(slices: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Each attempt's events, cut again at each ``resumed`` event: ``gyre`` resumes by itself after
    a core's death (``run.auto_resume``), within one process of ours."""
    out: list[list[dict[str, Any]]] = []
    for events in slices:
        out.append([])
        for e in events:
            if e.get("kind") == "resumed" and out[-1]:
                out.append([])
            out[-1].append(e)
    return out


def check_versions(slices: list[list[dict[str, Any]]]) -> tuple[bool, list[int], list[str]]:
    line: list[int] = []
    problems = []
    for i, events in enumerate(slices):
        resumed = [e["weight_version"] for e in events if e.get("kind") == "resumed"]
        versions = [e["weight_version"] for e in events if e.get("kind") == "step"]
        if not resumed and not versions:
            continue  # killed before it resumed anything: the line is as it was
        start = resumed[0] if resumed else 0  # no "resumed": it started from scratch
        if start > len(line) + 1:
            problems.append(f"attempt {i} resumed at {start}, its predecessor logged {len(line)}")
        line = line[:start] + list(range(len(line) + 1, start + 1))  # the one applied and saved, unlogged
        if versions != list(range(start + 1, start + 1 + len(versions))):
            problems.append(f"attempt {i} from {start} applied {versions}")
        line += versions
    ok = not problems and line == list(range(1, len(line) + 1))
    return ok, line, problems


def shards_trained_twice(slices: list[list[dict[str, Any]]]) -> int:
    twice = 0
    for events in slices:
        micro: dict[int, list[tuple[int, str]]] = {}
        for e in events:
            if e.get("kind") == "microstep":
                micro.setdefault(e["step"], []).append((e["cell"], e["shard"]))
        for e in events:
            if e.get("kind") == "step":
                counted = Counter(shard for cell, shard in micro.get(e["step"], []) if cell in e["trainers"])
                twice += sum(n - 1 for n in counted.values() if n > 1)
    return twice


def applied_times(run_dir: Path) -> list[float]:
    """Wall times of the controller's ``step N applied`` lines, every attempt's (its log appends)."""
    out = []
    for line in (run_dir / "controller.log").read_text(errors="replace").splitlines():
        if " applied -> version " in line:
            try:
                stamp, millis = line[:23].split(",")
                out.append(time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000)
            except ValueError:
                continue
    return sorted(out)


def recovery(kills: list[dict[str, Any]], applied: list[float]) -> dict[str, dict[str, float]]:
    """Per kind: median and longest seconds from a kill to the next step applied."""
    by_kind: dict[str, list[float]] = {}
    for k in kills:
        later = [t for t in applied if t > k["wall"]]
        if later:
            by_kind.setdefault(k["kind"], []).append(later[0] - k["wall"])
    return {kind: {"median": round(statistics.median(v), 1), "max": round(max(v), 1), "n": len(v)}
            for kind, v in sorted(by_kind.items())}


def answered_calls(run_dir: Path) -> set[str]:
    ids = set()
    for log in run_dir.glob("work*/*/stdout.log"):
        ids.update(re.findall(r"^harness: answered (\S+)$", log.read_text(errors="replace"), re.MULTILINE))
    return ids


def logged_calls(run_dir: Path) -> set[str]:
    ids = set()
    for path in run_dir.glob("processor*/processor.log"):
        log = AppendLog(path, fsync=False)
        try:
            for payload in log.scan():
                if decode_marker(payload) is None:
                    msg = wire.decode(payload)
                    if isinstance(msg, wire.CallRecord):
                        ids.add(msg.call_id)
        finally:
            log.close()
    return ids


def latest_version(run_dir: Path) -> int:
    from base.checkpoints import latest_checkpoint

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    return ckpt.version if ckpt else 0


# ------------------------------------------------------------------ figures


APPLIED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .* applied -> version (\d+) \(reward ([-\d.e]+)")
RESUMED_BY_GYRE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*gyre: resuming at step")


def _wall(stamp: str, millis: str) -> float:
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000


def reward_over_time(run_dir: Path, started_wall: float, minutes: float, bin_s: float = 300.0) -> list[float | None]:
    """The mean training reward of the steps applied in each ``bin_s`` of the soak (from the
    controller's ``step N applied -> version V (reward R, ...)`` lines, every attempt's), until
    ``minutes``: a collapse shows as a late bin far below an early one."""
    bins: list[list[float]] = [[] for _ in range(max(1, int(round(minutes * 60 / bin_s))))]
    for line in (run_dir / "controller.log").read_text(errors="replace").splitlines():
        m = APPLIED.match(line)
        if m:
            k = int((_wall(m[1], m[2]) - started_wall) // bin_s)
            if 0 <= k < len(bins):
                bins[k].append(float(m[4]))
    return [round(statistics.fmean(b), 3) if b else None for b in bins]


def core_kills_resumed(kills: list[dict[str, Any]], run_dir: Path) -> dict[str, Any]:
    """Each core kill against ``gyre``'s own resume (``run.auto_resume``: its controller logs
    ``gyre: resuming at step``) before the next kill of the controller (which ends the attempt; the
    soak's restart is not gyre's resume). A core kill in the chaos's last minute has no time to."""
    resumes = [_wall(m[1], m[2]) for m in map(RESUMED_BY_GYRE.match,
               (run_dir / "controller.log").read_text(errors="replace").splitlines()) if m]
    controller_kills = sorted(k["wall"] for k in kills if k["kind"] == "controller")
    last_kill = max((k["wall"] for k in kills), default=0.0)
    out = {"core_kills": 0, "resumed_by_gyre": 0, "controller_killed_first": 0, "too_late": 0, "not_resumed": 0}
    for k in (k for k in kills if k["kind"] == "core"):
        out["core_kills"] += 1
        until = min((w for w in controller_kills if w > k["wall"]), default=float("inf"))
        if any(k["wall"] < w < until for w in resumes):
            out["resumed_by_gyre"] += 1
        elif until < float("inf"):
            out["controller_killed_first"] += 1
        elif last_kill - k["wall"] < 60:
            out["too_late"] += 1
        else:
            out["not_resumed"] += 1
    out["every_core_kill_resumed_by_gyre"] = out["not_resumed"] == 0
    return out


def summarize(run_dir: Path, attempts: list[dict[str, Any]], kills: list[dict[str, Any]], *, started_wall: float,
              minutes: float, orphans: Any) -> dict[str, Any]:
    """What the soak checks and measures, from its run folder (see the module docstring)."""
    slices = segments(events_by_attempt(run_dir, attempts))
    ok, line, problems = check_versions(slices)
    answered, logged = answered_calls(run_dir), logged_calls(run_dir)
    evals = [e for e in slices[-1] if e.get("kind") == "eval"]
    rewards = reward_over_time(run_dir, started_wall, minutes)
    early, late = rewards[1] if len(rewards) > 2 else None, rewards[-1]
    return {
        "kills": len(kills), "kills_by_kind": dict(Counter(k["kind"] for k in kills)),
        "attempts": len(attempts), "attempt_exit_codes": [a.get("rc") for a in attempts],
        "resumes": sum(1 for s in slices for e in s if e.get("kind") == "resumed"),
        "core_kills_resumed": core_kills_resumed(kills, run_dir),
        "versions_applied_once": ok, "version_problems": problems[:5], "final_version": len(line),
        "records_lost": len(answered - logged), "answered_calls": len(answered),
        "shards_trained_twice": shards_trained_twice(slices),
        "recovery_s": recovery(kills, applied_times(run_dir)),
        "processor_restarts": sum(1 for s in slices for e in s if e.get("kind") == "service_restarted"),
        "train_reward_by_5min": rewards,
        "reward_last_5min_not_below_5_to_10": None if early is None or late is None else late >= early,
        "eval_reward_end": evals[-1].get("reward") if evals else None,
        "last_attempt_rc": attempts[-1].get("rc"), "orphans": orphans, "minutes": minutes, "run_dir": str(run_dir),
    }


def report(runs: Path) -> dict[str, Any]:
    """``summarize`` a soak kept in ``runs`` (its ``--runs-dir``): its ``soak.json`` and run folder."""
    saved = json.loads((runs / "soak.json").read_text())
    (run_dir,) = [p for p in runs.iterdir() if p.is_dir() and p.name.startswith("soak-")]
    started = saved.get("started_wall")
    if started is None:  # a soak from before started_wall was saved: its controller log's first line
        first = (run_dir / "controller.log").read_text(errors="replace").splitlines()[0]
        started = _wall(*first[:23].split(","))
    minutes = saved.get("minutes") or round((max(k["wall"] for k in saved["kills"]) - started) / 60)
    return summarize(run_dir, saved["attempts"], saved["kills"], started_wall=started, minutes=minutes,
                     orphans=saved.get("orphans"))


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--kill-every", default="20,60", help="seconds between kills: LOW,HIGH (uniform)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs-dir", type=Path, default=None, help="default: a temporary folder, removed")
    ap.add_argument("--keep", action="store_true", help="keep the run folder (with --runs-dir it is always kept)")
    ap.add_argument("--no-kills", action="store_true",
                    help="no chaos: the same run and checks without a kill, to compare training against")
    ap.add_argument("--report", type=Path, default=None, metavar="RUNS_DIR",
                    help="no run: the checks and figures of a soak kept in RUNS_DIR (its --runs-dir)")
    args = ap.parse_args(argv)
    if args.report is not None:
        result = report(args.report)
        print(json.dumps(result))
        return result
    low, high = (float(x) for x in args.kill_every.split(","))
    if not 0 < low <= high or args.minutes <= 0:
        ap.error("--kill-every LOW,HIGH with 0 < LOW <= HIGH, and --minutes > 0")
    tmp = None
    runs = args.runs_dir
    if runs is None:
        tmp = tempfile.mkdtemp(prefix="bench-soak-", dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None)
        runs = Path(tmp)
    runs.mkdir(parents=True, exist_ok=True)
    soak = Soak(runs.resolve(), f"soak-{args.seed}-{int(time.time())}", random.Random(args.seed))
    started_wall = time.time()
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    stop = threading.Event()
    chaos = threading.Thread(target=soak.chaos, args=(t0, deadline, (low, high), stop), daemon=True)
    try:
        soak.start(f"run.steps={LONG_RUN_STEPS}")
        if not args.no_kills:
            chaos.start()
        while time.monotonic() < deadline:
            assert soak.proc is not None
            if soak.proc.poll() is None:
                time.sleep(0.5)
                continue
            soak.end_attempt()
            print(f"soak: {time.monotonic() - t0:7.1f}s attempt {len(soak.attempts) - 1} ended "
                  f"{soak.attempts[-1]['rc']}; resuming", file=sys.stderr, flush=True)
            soak.start(f"run.steps={LONG_RUN_STEPS}")
        stop.set()
        if chaos.is_alive():
            chaos.join()
        assert soak.proc is not None
        if soak.proc.poll() is None:
            soak.proc.send_signal(signal.SIGKILL)  # the end of the chaos, not a kill of it
        soak.end_attempt()
        final_steps = latest_version(soak.run_dir) + 2
        soak.start(f"run.steps={final_steps}", "run.eval_at_end=true")
        soak.end_attempt()
        (soak.runs / "soak.json").write_text(json.dumps({
            "attempts": soak.attempts, "kills": soak.kills, "started_wall": started_wall, "minutes": args.minutes,
            "orphans": soak.orphans}))
        result = summarize(soak.run_dir, soak.attempts, soak.kills, started_wall=started_wall,
                           minutes=args.minutes, orphans=soak.orphans)
        result["minutes_total"] = round((time.monotonic() - t0) / 60, 1)
    finally:
        stop.set()
        if soak.proc is not None and soak.proc.poll() is None:
            soak.proc.kill()
        for p in soak.run_processes():
            p.kill()
        if tmp is not None and not args.keep:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
