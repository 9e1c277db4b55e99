"""The logger group: TensorBoard event files read back with TensorBoard's own reader, Prometheus
scraped over real HTTP and parsed with its own parser, W&B offline; one scalar mapping for all."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from controller.loggers import build_loggers
from controller.loggers.config import LoggerConfig, PrometheusConfig, TensorBoardConfig, WandbConfig
from controller.loggers.scalars import ScalarView
from controller.loggers.wandb_logger import resolve_mode
from controller.report import MetricsSink
from tests.controller.test_config import load

STEP = {"t": 12.3, "step": 2, "reward_mean": 0.25, "loss": 0.5, "clip_fraction": 0.1, "kl": None,
        "num_tokens": 40, "prompt_tokens": 300, "dedup_saved_tokens": 120, "adv_std": 1.0}
PROGRESS = {"t": 7.9, "queued": 5, "running": 3, "version": 2, "phases": {0: "training", 1: "serving", 2: "to_train"},
            "versions": {0: 2, 1: 2, 2: 1}}


def test_default_is_tensorboard_and_any_set_can_be_chosen():
    c = load()
    assert c.logger.tensorboard is not None and c.logger.prometheus is None and c.logger.wandb is None
    assert load("cluster=slurm").logger.prometheus is None  # no open port on a shared node unless asked
    c = load("logger=[tensorboard,prometheus]")
    assert c.logger.prometheus is not None and c.logger.prometheus.host == "127.0.0.1"  # loopback unless told
    c = load("logger=[tensorboard,wandb]", "logger.wandb.project=p")
    assert c.logger.wandb is not None and c.logger.wandb.project == "p" and c.logger.prometheus is None
    c = load("logger=[]")
    assert (c.logger.tensorboard, c.logger.wandb, c.logger.prometheus) == (None, None, None)


def test_scalars_per_step_and_live():
    view = ScalarView()
    step = {s.tag: (s.value, s.axis, s.x) for s in view.scalars("step", STEP)}
    assert step["train/reward_mean"] == (0.25, "step", 2)
    assert step["tokens/deduplicated_away"] == (120.0, "step", 2)
    assert "train/kl_to_behaviour" not in step  # None is not plotted as 0
    live = {s.tag: (s.value, s.axis, s.x) for s in view.scalars("progress", PROGRESS)}
    assert live["water/queued"] == (5.0, "seconds", 7) and live["cells/switching"][0] == 1.0
    view.scalars("execution", {"t": 1, "outcome": "finished", "state": "grade_failed"})
    got = {s.tag: s.value for s in view.scalars("execution", {"t": 2, "outcome": "timed_out", "state": "graded"})}
    assert got == {"executions/finished": 1.0, "executions/timed_out": 1.0, "executions/crashed": 0.0,
                   "executions/grader_failures": 1.0}


def test_tensorboard_event_files_read_back(tmp_path):
    (tb,) = build_loggers(LoggerConfig(tensorboard=TensorBoardConfig(subdir="tb", flush_secs=1), wandb=None,
                                       prometheus=None), tmp_path)
    tb.event("step", STEP)
    tb.event("step", {**STEP, "step": 3, "reward_mean": 0.5})
    tb.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/reward_mean")] == [(2, 0.25), (3, 0.5)]


class Broken:
    name = "broken"

    def event(self, kind, ev):
        raise OSError("disk full")

    def close(self):
        pass


def test_a_failing_logger_is_dropped_and_metrics_jsonl_goes_on(tmp_path):
    sink = MetricsSink(tmp_path / "metrics.jsonl", [Broken()])
    sink.log("step", **STEP)
    sink.log("step", **STEP)
    sink.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert sink.loggers == []


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_prometheus_scraped_over_http(tmp_path):
    (prom,) = build_loggers(LoggerConfig(tensorboard=None, wandb=None,
                                         prometheus=PrometheusConfig(host="127.0.0.1", port=0)), tmp_path)
    try:
        url = (tmp_path / "prometheus.url").read_text().strip()
        assert url.startswith("http://127.0.0.1:")
        prom.event("progress", PROGRESS)
        prom.event("step", STEP)
        prom.event("execution", {"t": 1, "outcome": "crashed", "state": "crashed"})
        got = scrape(url)
        assert got[("gyre_cell_phase", (("cell", "0"), ("phase", "training")))] == 1.0
        assert got[("gyre_cell_phase", (("cell", "0"), ("phase", "serving")))] == 0.0
        assert got[("gyre_cell_weight_version", (("cell", "2"),))] == 1.0
        assert got[("gyre_train_reward_mean", ())] == 0.25
        assert got[("gyre_water_queued", ())] == 5.0
        assert got[("gyre_executions_total", (("outcome", "crashed"),))] == 1.0
    finally:
        prom.close()


def test_wandb_mode_auto(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert resolve_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert resolve_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert resolve_mode("auto") == "offline" and resolve_mode("online") == "online"


def test_wandb_offline_run_holds_the_scalars(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (wb,) = build_loggers(LoggerConfig(tensorboard=None, prometheus=None, wandb=WandbConfig(
        project="gyre-test", entity="", mode="auto", tags=["t"])), tmp_path, run_config=None)
    wb.event("step", STEP)
    wb.event("progress", PROGRESS)
    summary = dict(wb.run.summary)  # W&B's own view of what was logged
    wb.close()
    assert summary["train/reward_mean"] == 0.25 and summary["step"] == 2 and summary["water/queued"] == 5
    assert summary["elapsed_s"] == 7  # live figures on their own axis, not W&B's step
    (record,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # what `wandb sync` uploads later
    # W&B's service process writes the file behind finish(); on a loaded machine, a moment later
    deadline = time.monotonic() + 30
    while b"train/reward_mean" not in record.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"train/reward_mean" in record.read_bytes()
