"""A satellite cellrunner SIGKILLed while it trains: the run loses neither the step nor its data.

A short real run (real processes, sockets, HTTP). As soon as a satellite reports its switch to
training, the test SIGKILLs that cellrunner. The controller must drop it (``cell_lost``), hand
its microsteps back, and finish every step exactly once with consecutive weight versions, the
core's final checkpoint at the last version. With run release the satellite is killed once it
holds a run-released gradient that its group's statistics have not yet turned into an update.
"""

import json
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e import metrics, run_gyre_with

STEPS = 4


def kill_first_training_satellite(run_dir: Path, done: threading.Event, report: dict) -> None:
    while not done.is_set():
        switched = [m for m in metrics(run_dir) if m.get("kind") == "switch" and m["role"] == "train" and m["cell"] != 0]
        if switched and _kill_cell(run_dir, switched[0]["cell"]):
            report["killed"] = switched[0]["cell"]
            report["at_version"] = max(
                [m["weight_version"] for m in metrics(run_dir) if m.get("kind") == "step"], default=0
            )
            return
        time.sleep(0.02)


def kill_first_satellite_holding_run_released_grads(run_dir: Path, done: threading.Event, report: dict) -> None:
    while not done.is_set():
        events = metrics(run_dir)
        sent = {(m["cell"], m["step"]) for m in events if m.get("kind") == "grads_sent"}
        holding = [m for m in events if m.get("kind") == "microstep" and m["cell"] != 0 and m.get("run_released")
                   and (m["cell"], m["step"]) not in sent]
        if holding and _kill_cell(run_dir, holding[0]["cell"]):
            report["killed"] = holding[0]["cell"]
            report["at_version"] = max([m["weight_version"] for m in events if m.get("kind") == "step"], default=0)
            return
        time.sleep(0.02)


def _kill_cell(run_dir: Path, cell: int) -> bool:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "cellrunner.main" in cmd and "--cell-id" in cmd and cmd[cmd.index("--cell-id") + 1] == str(cell):
            if any(str(run_dir) in c for c in cmd):
                p.send_signal(signal.SIGKILL)
                return True
    return False


@pytest.mark.e2e
@pytest.mark.parametrize("release", ["group", "run"])
def test_satellite_killed_mid_step_loses_nothing(tmp_path, release):
    runs = tmp_path / "runs"
    meddle = kill_first_training_satellite if release == "group" else kill_first_satellite_holding_run_released_grads
    run_dir, report = run_gyre_with(runs, meddle, f"run.steps={STEPS}", "run.eval_at_start=false",
                                    f"algo.release={release}")
    assert "killed" in report, "no satellite was caught training"
    events = metrics(run_dir)
    lost = [m for m in events if m.get("kind") == "cell_lost"]
    assert [m["cell"] for m in lost] == [report["killed"]]
    assert report["at_version"] < STEPS  # it died before the run's last step was applied
    versions = [m["weight_version"] for m in events if m.get("kind") == "step"]
    assert versions == list(range(1, STEPS + 1))  # every step applied once, none lost or repeated
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert (run_dir / f"checkpoints/v{STEPS}/model.safetensors").stat().st_size > 0
