"""Children of a controller that was SIGKILLed stop by themselves (base.lifecycle.exit_with_parent)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[2]

# A parent that starts the real processor, prints its pid, then waits to be SIGKILLed.
PARENT = r"""
import subprocess, sys, time
child = subprocess.Popen(
    [sys.executable, "-m", "trajectory.main", "--config-json", sys.argv[1], "--controller", "tcp://127.0.0.1:9",
     "--bind-records", "tcp://127.0.0.1:0", "--log-dir", sys.argv[2], "--ready-file", sys.argv[3]],
    start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_child_stops_when_its_controller_is_killed(tmp_path):
    algo = yaml.safe_load((ROOT / "conf/algo/gspo.yaml").read_text())
    cfg = tmp_path / "processor.json"
    cfg.write_text(json.dumps({"algo": algo, "workload": {"min_usable_per_group": 2}}))
    ready = tmp_path / "processor.ready"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(cfg), str(tmp_path / "log"), str(ready)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    child_pid = int(parent.stdout.readline())
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline, "the processor never became ready"
        time.sleep(0.1)
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    child = psutil.Process(child_pid)
    try:
        child.wait(timeout=20)  # SIGTERM within ~1 s, its graceful stop after that
    except psutil.TimeoutExpired:
        child.kill()
        raise AssertionError("the orphaned processor kept running") from None


# A child whose spawner died before the child looked: it was told its parent's pid at spawn.
ORPHAN = r"""
import sys, time
from base.lifecycle import exit_with_parent
exit_with_parent(poll_s=0.1, grace_s=5.0)
time.sleep(60)
"""


def test_a_child_orphaned_during_its_start_up_stops_too(tmp_path):
    """The race bench.elastic hit: the controller died while its cells were still importing torch,
    so each cell's first look at its parent already saw its adoptive one and it ran on forever."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is surely not our child's parent any more
    from base.lifecycle import PARENT_PID_ENV

    child = subprocess.Popen([sys.executable, "-c", ORPHAN], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT), PARENT_PID_ENV: str(gone.pid)})
    try:
        assert child.wait(timeout=20) != 0  # SIGTERM: it stops instead of sleeping its 60 s
    except subprocess.TimeoutExpired:
        child.kill()
        raise AssertionError("the orphan kept running") from None
    # Told the truth, a child keeps running while its parent lives.
    alive = subprocess.Popen([sys.executable, "-c", ORPHAN], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT), PARENT_PID_ENV: str(os.getpid())})
    time.sleep(1.5)
    assert alive.poll() is None
    alive.kill()
    alive.wait()
