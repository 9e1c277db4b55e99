"""SIGKILL the trajectory processor, the harness proxy, the core cell or the controller at a
random moment of a run.

- The processor or the proxy is restarted in place and the run finishes: every weight version
  applied once, every call a harness was answered in the processor's log, every sealed execution's
  calls there, no shard trained twice.
- The core or the controller: the run stops at once with the reason and how to resume (never a
  silent hang; a dead controller leaves no process of the run behind), and the same
  ``run.run_id`` resumes from the newest checkpoint and finishes, each weight version of the final
  line applied once.
- A processor or proxy that is alive but stuck (SIGSTOP) falls silent: the controller kills it
  after ``cluster.heartbeat_timeout_s`` and restarts it; with ``cluster.service_restarts=0`` (and
  ``run.auto_resume=0``) a silent proxy stops the run with the reason."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from base import wire
from tests.e2e import metrics, start_gyre
from trajectory.log import AppendLog, decode_marker

STEPS = 6


def attempt(runs: Path, run_id: str, *extra: str) -> subprocess.Popen:
    return start_gyre(runs, f"run.steps={STEPS}", f"run.run_id={run_id}", "run.checkpoint_every=1",
                      "run.eval_at_start=false", "run.eval_at_end=false", *extra)


def kill_at_random(run_dir: Path, module: str, rng: random.Random, deadline: float, *also: str) -> str:
    """SIGKILL the run's ``python -m <module>`` (whose argv holds ``also`` too) some time after
    training started."""
    while time.monotonic() < deadline and not metrics(run_dir, "step"):
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 1.5))  # a step takes ~2 s here: the kill lands mid-run
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        line = " ".join(cmd)
        if module in cmd and any(str(run_dir) in a for a in cmd) and all(a in line for a in also):
            p.send_signal(signal.SIGKILL)
            return " ".join(cmd)
    raise AssertionError(f"no {module} process of {run_dir} found")


def processor_log(run_dir: Path) -> list[wire.Message]:
    log = AppendLog(run_dir / "processor" / "processor.log", fsync=False)
    try:
        return [wire.decode(p) for p in log.scan() if decode_marker(p) is None]
    finally:
        log.close()


def answered_calls(run_dir: Path) -> set[str]:
    """Every call id a harness was answered (the bundled harness's ``harness: answered <id>`` lines)."""
    return {line.split()[-1] for log in run_dir.glob("work/*/stdout.log")
            for line in log.read_text().splitlines() if line.startswith("harness: answered ")}


@pytest.mark.e2e
@pytest.mark.parametrize("name,module", [("processor", "trajectory.main"), ("proxy", "harness_proxy.main")])
def test_a_killed_service_is_restarted_in_place_and_nothing_is_lost(tmp_path, name, module):
    runs, run_id = tmp_path / "runs", f"kill-{name}"
    run_dir = runs / run_id
    proc = attempt(runs, run_id)
    try:
        killed = kill_at_random(run_dir, module, random.Random(), time.monotonic() + 300)
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    restarts = metrics(run_dir, "service_restarted")
    assert [(e["service"], e["why"]) for e in restarts] == [(name, "exited with -9")], killed
    # every weight version applied once, in order
    assert [e["weight_version"] for e in metrics(run_dir, "step")] == list(range(1, STEPS + 1))
    # a checkpoint every step, the newest 3 kept (run.keep_checkpoints)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"v{v}" for v in (4, 5, 6)]
    # no shard trained twice (no cell was lost, so no microstep was re-run)
    trained = [(e["step"], e["shard"]) for e in metrics(run_dir, "microstep")]
    assert trained and len(trained) == len(set(trained))
    # every call a harness was answered is in the processor's log
    logged = processor_log(run_dir)
    answered = answered_calls(run_dir)
    assert answered and answered <= {m.call_id for m in logged if isinstance(m, wire.CallRecord)}
    # every sealed execution's calls are in the log: all the proxy counted (a restarted proxy
    # counts only the calls made through it)
    calls: dict[str, set[str]] = {}
    for m in logged:
        if isinstance(m, wire.CallRecord):
            calls.setdefault(m.execution_id, set()).add(m.call_id)
    seals = {m.execution_id: m.num_calls for m in logged if isinstance(m, wire.ExecutionSealed)}
    assert seals and all(len(calls.get(e, ())) >= n for e, n in seals.items())
    if name == "processor":
        assert {e: len(calls.get(e, ())) for e in seals} == seals
    # every training run that finished was sealed and graded in the log
    finished = {e["id"] for e in metrics(run_dir, "execution") if e["train"] and e["outcome"] == "finished"}
    graded = {m.execution_id for m in logged if isinstance(m, wire.Grade)}
    assert finished and finished <= seals.keys() and finished <= graded
    # the harnesses rode the restart out: a call that failed meanwhile was retried, none gave up
    crashed = [e["id"] for e in metrics(run_dir, "execution") if e["outcome"] == "crashed"]
    assert not crashed, crashed


@pytest.mark.e2e
def test_a_killed_core_is_brought_back_from_its_checkpoint_by_gyre_itself(tmp_path):
    """The core owns the optimizer state no satellite holds: ``gyre`` starts a new attempt from the
    newest checkpoint by itself (``run.auto_resume``); the steps since it are trained again."""
    runs, run_id = tmp_path / "runs", "kill-core-auto"
    run_dir = runs / run_id
    proc = attempt(runs, run_id)
    try:
        kill_at_random(run_dir, "cellrunner.main", random.Random(), time.monotonic() + 300, "--cell-id 0")
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "run failed: the core cell 0 exited with -9" in out and f"resuming run {run_id} from its newest" in out
    check_resumed_line(run_dir)


@pytest.mark.e2e
def test_a_killed_core_stops_the_run_clearly_and_it_resumes(tmp_path):
    """With ``run.auto_resume=0``, what an operator sees and does."""
    runs, run_id = tmp_path / "runs", "kill-core"
    run_dir = runs / run_id
    proc = attempt(runs, run_id, "run.auto_resume=0")
    try:
        kill_at_random(run_dir, "cellrunner.main", random.Random(), time.monotonic() + 300, "--cell-id 0")
        out, _ = proc.communicate(timeout=120)  # stops promptly, not at some timeout
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    assert "run failed: the core cell 0 exited with -9" in out
    assert f"run.run_id={run_id} to resume" in out
    proc = attempt(runs, run_id)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:]
    check_resumed_line(run_dir)


def check_resumed_line(run_dir: Path) -> None:
    """One resume: the first attempt's versions up to the checkpoint, then the second's, once each."""
    done_first = []
    for e in metrics(run_dir):
        if e["kind"] == "resumed":
            break
        if e["kind"] == "step":
            done_first.append(e["weight_version"])
    assert len(done_first) < STEPS, "the kill landed after the last step: nothing was tested"
    resumed = [e["weight_version"] for e in metrics(run_dir, "resumed")]
    start = resumed[0] if resumed else 0
    assert start >= 1 or not (run_dir / "checkpoints" / "v1").exists()
    versions = [e["weight_version"] for e in metrics(run_dir, "step")]
    # The first attempt's line up to the checkpoint, then the second's from there: once each.
    second = versions[len(done_first):]
    assert second == list(range(start + 1, STEPS + 1)), (done_first, second)
    assert done_first == list(range(1, len(done_first) + 1))
    # A kill between the core's checkpoint of a step and the controller hearing of it leaves that
    # checkpoint one version past the first attempt's last logged step: applied once all the same.
    assert start <= len(done_first) + 1, (done_first, start)


def run_processes(run_dir: Path) -> list[str]:
    """Command lines of the processes still working for ``run_dir`` (any that names it)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
        if str(run_dir) in cmd and p.pid != psutil.Process().pid:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{p.pid}: {cmd[:200]}")
            except psutil.Error:
                continue
    return out


@pytest.mark.e2e
def test_a_killed_controller_leaves_nothing_running_and_the_run_resumes(tmp_path):
    """SIGKILL the controller mid-run: every process it started (processor, proxy, cells,
    harnesses in their sandboxes) ends by itself, since none may keep a shared node's cores or
    ports; a new controller with the same ``run.run_id`` resumes from the newest checkpoint (the
    runs cut by the kill are planned again, in a fresh processor log) and finishes, each weight
    version of the final line applied once."""
    runs, run_id = tmp_path / "runs", "kill-controller"
    run_dir = runs / run_id
    proc = attempt(runs, run_id)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not metrics(run_dir, "step"):
            time.sleep(0.05)
        time.sleep(random.Random().uniform(0.0, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    done_first = [e["weight_version"] for e in metrics(run_dir, "step")]
    assert len(done_first) < STEPS, "the kill landed after the last step: nothing was tested"
    deadline = time.monotonic() + 30
    while (left := run_processes(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"still running 30 s after the controller died: {left}"

    proc = attempt(runs, run_id)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:]
    resumed = [e["weight_version"] for e in metrics(run_dir, "resumed")]
    start = resumed[0] if resumed else 0
    versions = [e["weight_version"] for e in metrics(run_dir, "step")]
    second = versions[len(done_first):]
    assert second == list(range(start + 1, STEPS + 1)), (done_first, second)
    assert done_first == list(range(1, len(done_first) + 1)) and start <= len(done_first) + 1, (done_first, start)
    assert (run_dir / "processor.1").is_dir()  # the second attempt's processor, next to the first's log


def stop_at_random(run_dir: Path, module: str, rng: random.Random, deadline: float) -> psutil.Process:
    """SIGSTOP the run's ``python -m <module>`` once training started: alive, but its loop stopped."""
    while time.monotonic() < deadline and not metrics(run_dir, "step"):
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 1.5))
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if module in cmd and any(str(run_dir) in a for a in cmd):
            p.send_signal(signal.SIGSTOP)
            return p
    raise AssertionError(f"no {module} process of {run_dir} found")


@pytest.mark.e2e
def test_a_hung_processor_is_found_by_its_silence_killed_and_restarted(tmp_path):
    runs, run_id = tmp_path / "runs", "hung-processor"
    run_dir = runs / run_id
    proc = start_gyre(runs, f"run.steps={STEPS}", f"run.run_id={run_id}", "run.eval_at_start=false",
                      "run.eval_at_end=false", "cluster.heartbeat_timeout_s=4")
    try:
        stopped = stop_at_random(run_dir, "trajectory.main", random.Random(), time.monotonic() + 300)
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert not stopped.is_running() or stopped.status() == psutil.STATUS_ZOMBIE
    (restart,) = metrics(run_dir, "service_restarted")
    assert restart["service"] == "processor" and restart["why"].startswith("was silent for "), restart
    assert [e["weight_version"] for e in metrics(run_dir, "step")] == list(range(1, STEPS + 1))


@pytest.mark.e2e
def test_a_hung_proxy_stops_the_run_with_the_reason(tmp_path):
    runs, run_id = tmp_path / "runs", "hung-proxy"
    run_dir = runs / run_id
    proc = start_gyre(runs, f"run.steps={STEPS}", f"run.run_id={run_id}", "run.eval_at_start=false",
                      "run.eval_at_end=false", "cluster.heartbeat_timeout_s=4", "cluster.service_restarts=0",
                      "run.auto_resume=0")
    try:
        stop_at_random(run_dir, "harness_proxy.main", random.Random(), time.monotonic() + 300)
        out, _ = proc.communicate(timeout=120)  # within the timeout and a tick, not some later hang
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    assert "run failed: the proxy was silent for " in out
    assert f"run.run_id={run_id} to resume" in out
