"""A satellite cellrunner SIGKILLed while it trains, or while it serves calls: the run loses
neither the step nor its data.

A short real run (real processes, sockets, HTTP). As soon as a satellite reports its switch to
training, the test SIGKILLs that cellrunner. The controller must drop it (``cell_lost``), hand
its microsteps back, and finish every step exactly once with consecutive weight versions, the
core's final checkpoint at the last version. With run release the satellite is killed once it
holds a run-released gradient that its group's statistics have not yet turned into an update.
A serving satellite is killed while the proxy has calls in flight on its engine: the proxy
re-routes them to another serving cell and every execution is graded.
"""

import json
import urllib.request
import threading
import time
from pathlib import Path

import pytest

from bench.elastic import kill_cell
from tests.e2e import metrics, run_gyre_with

STEPS = 4


def kill_first_training_satellite(run_dir: Path, done: threading.Event, report: dict) -> None:
    while not done.is_set():
        switched = [m for m in metrics(run_dir) if m.get("kind") == "switch" and m["role"] == "train" and m["cell"] != 0]
        if switched and kill_cell(run_dir, switched[0]["cell"]):
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
        if holding and kill_cell(run_dir, holding[0]["cell"]):
            report["killed"] = holding[0]["cell"]
            report["at_version"] = max([m["weight_version"] for m in events if m.get("kind") == "step"], default=0)
            return
        time.sleep(0.02)


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


def kill_a_serving_satellite_with_calls_in_flight(run_dir: Path, done: threading.Event, report: dict) -> None:
    while not done.is_set() and not (run_dir / "endpoints.json").exists():
        time.sleep(0.05)
    if done.is_set():
        return
    ep = json.loads((run_dir / "endpoints.json").read_text())
    satellites = {url: int(cell) for cell, url in ep["cells"].items() if cell != "0"}
    while not done.is_set():
        if any(m.get("kind") == "step" for m in metrics(run_dir)):  # once training has begun
            with urllib.request.urlopen(ep["proxy"] + "/stats", timeout=10) as r:
                in_flight = json.loads(r.read())["in_flight"]
            busy = [(n, url) for url, n in in_flight.items() if url in satellites and n > 0]
            if busy:
                n, url = max(busy)
                if kill_cell(run_dir, satellites[url]):
                    report.update(killed=satellites[url], calls_in_flight=n, at_version=max(
                        m["weight_version"] for m in metrics(run_dir) if m.get("kind") == "step"))
                    return
        time.sleep(0.01)


@pytest.mark.e2e
def test_serving_satellite_killed_with_calls_in_flight_loses_nothing(tmp_path):
    run_dir, report = run_gyre_with(tmp_path / "runs", kill_a_serving_satellite_with_calls_in_flight,
                                    f"run.steps={STEPS}", "run.eval_at_start=false")
    assert "killed" in report, "no serving satellite was caught with calls in flight"
    assert report["at_version"] < STEPS
    events = metrics(run_dir)
    assert [m["cell"] for m in events if m.get("kind") == "cell_lost"] == [report["killed"]]
    # the calls it held were tried again elsewhere, and no run was lost with them
    proxy_log = (run_dir / "logs/proxy.log").read_text()
    assert f"failed: cell {report['killed']} (" in proxy_log
    executions = [m for m in events if m.get("kind") == "execution"]
    assert executions and all(m["outcome"] == "finished" and m["state"] == "graded" for m in executions), [
        (m["id"], m["outcome"], m["state"]) for m in executions if m["outcome"] != "finished" or m["state"] != "graded"]
    versions = [m["weight_version"] for m in events if m.get("kind") == "step"]
    assert versions == list(range(1, STEPS + 1))
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS
