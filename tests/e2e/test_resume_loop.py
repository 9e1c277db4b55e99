"""A core killed again and again inside one ``gyre`` process: every attempt resumes.

``run.auto_resume`` starts each new attempt in the same process as the last, so whatever an
attempt leaves behind (its sockets, its ZMQ context, the ZAP handler bound in it) meets the next
one. A timing-dependent leak of that kind once ended a resume at random ('Address already in use'
on the ZAP handler's inproc endpoint), so one kill proves little: this test kills the core
``KILLS`` times, each at a random moment after the attempt trained a step, and every one must
resume, the run reaching its last step with each weight version of the final line applied once."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e import metrics, start_gyre

pytestmark = pytest.mark.e2e

KILLS = 10
STEPS = 3 * KILLS + 2  # a kill may land a step or two after the attempt's first: room for all ten


def core_of(run_dir: Path) -> psutil.Process | None:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "cellrunner.main" in cmd and any(str(run_dir) in a for a in cmd) and "--cell-id" in cmd \
                and cmd[cmd.index("--cell-id") + 1] == "0":
            return p
    return None


def progress(run_dir: Path) -> tuple[int, int, int]:
    """(resumes so far, steps since the last of them, steps in all), from metrics.jsonl in order."""
    resumes = since = steps = 0
    for e in metrics(run_dir):
        if e["kind"] == "resumed":
            resumes, since = resumes + 1, 0
        elif e["kind"] == "step":
            since, steps = since + 1, steps + 1
    return resumes, since, steps


@pytest.mark.timeout(1000)
def test_every_one_of_ten_core_kills_resumes(tmp_path):
    runs, run_id = tmp_path / "runs", "resume-loop"
    run_dir = runs / run_id
    rng = random.Random()
    started = time.monotonic()
    proc = start_gyre(runs, f"run.steps={STEPS}", f"run.run_id={run_id}", "run.checkpoint_every=1",
                      f"run.auto_resume={KILLS}", "run.eval_at_start=false", "run.eval_at_end=false")
    killed = 0
    try:
        deadline = time.monotonic() + 900
        while killed < KILLS and time.monotonic() < deadline and proc.poll() is None:
            resumes, since, _ = progress(run_dir)
            if resumes < killed or since < 1:  # the last kill's attempt has not resumed and trained yet
                time.sleep(0.05)
                continue
            time.sleep(rng.uniform(0.0, 1.5))  # a step takes ~2 s here: the kill lands anywhere in one
            versions = [e["weight_version"] for e in metrics(run_dir, "step")]
            if versions and versions[-1] >= STEPS - 1:
                break  # the run is at its end: a kill now would find nothing left to resume
            core = core_of(run_dir)
            if core is not None:
                core.send_signal(signal.SIGKILL)
                killed += 1
        out, _ = proc.communicate(timeout=max(60.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert killed == KILLS, f"only {killed} kills landed before the run ended: {progress(run_dir)}"
    assert out.count(f"resuming run {run_id} from its newest") == KILLS, out[-4000:]
    resumed = metrics(run_dir, "resumed")
    assert len(resumed) == KILLS
    # The final line: the last resume's start, then every version after it once.
    start = resumed[-1]["weight_version"]
    versions = [e["weight_version"] for e in metrics(run_dir, "step")]
    assert versions[len(versions) - (STEPS - start):] == list(range(start + 1, STEPS + 1)), versions
    print(f"resume loop: {KILLS} core kills, every one resumed, {time.monotonic() - started:.1f}s")
