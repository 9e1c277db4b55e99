"""A live run seen as an RL engineer watches one: Prometheus scraped while it trains, TensorBoard's
event files read back with TensorBoard's own reader, a W&B offline run, and the report's water level."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.e2e import run_gyre_with

# What issue 24 asks TensorBoard to hold, at least.
REQUIRED_TAGS = {
    "train/reward_mean", "eval/reward", "train/advantage_mean", "train/advantage_std", "train/clip_fraction",
    "train/gspo_loss", "train/kl_to_behaviour", "tokens/prompt", "tokens/trained", "tokens/deduplicated_away",
    "staleness/per_call_mean", "water/queued", "water/running", "cells/serving", "cells/training",
    "switch/to_train_s", "switch/to_serve_s", "microstep/latency_s", "executions/finished",
    "executions/timed_out", "executions/crashed", "executions/grader_failures", "proxy/call_latency_s_mean",
}


def scrape_while_training(run_dir: Path, done, report: dict) -> None:
    """Scrape /metrics until the run has applied a step (or ends); keep the last good scrape."""
    url_file = run_dir / "prometheus.url"
    while not url_file.exists() and not done.is_set():
        time.sleep(0.1)
    if done.is_set():
        return
    url = url_file.read_text().strip()
    report["url"] = url
    while not done.is_set():
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)
            continue
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(text) for s in fam.samples}
        report["samples"] = samples
        if samples.get(("gyre_step", ()), 0) >= 1 and ("gyre_train_reward_mean", ()) in samples:
            return
        time.sleep(0.1)


@pytest.mark.e2e
def test_a_live_run_in_tensorboard_prometheus_and_wandb(tmp_path):
    run_dir, report = run_gyre_with(
        # 3 steps: the scrape after the first step lands while the run still has two to go, even on
        # a loaded machine (with 2, CI once saw the run end between two scrapes)
        tmp_path / "runs", scrape_while_training, "run.steps=3", "run.progress_every_s=0.5",
        "logger=[tensorboard,prometheus,wandb]", env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    # Prometheus answered on loopback while the run went on, with each cell's phase and version.
    assert report["url"].startswith("http://127.0.0.1:")
    samples = report["samples"]
    assert samples[("gyre_step", ())] >= 1
    phases = {labels: v for (name, labels), v in samples.items() if name == "gyre_cell_phase" and v == 1.0}
    assert len(phases) == 4  # one current phase per cell
    assert any(name == "gyre_cell_weight_version" for name, _ in samples)
    assert sum(v for (name, _), v in samples.items() if name == "gyre_executions_total") > 0

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert REQUIRED_TAGS <= tags, sorted(REQUIRED_TAGS - tags)
    assert [e.step for e in acc.Scalars("train/reward_mean")] == [0, 1, 2]
    assert len(acc.Scalars("eval/reward")) == 2  # start and end

    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert (run_dir / "water.png").stat().st_size > 0
    assert "water.png" in (run_dir / "report.md").read_text()
    assert (run_dir / "runs.png").stat().st_size > 0 and "runs.png" in (run_dir / "report.md").read_text()
