"""Training-health warnings: each signal fires on the pattern it names and stays quiet on a
healthy run; the warnings reach the log, metrics.jsonl and every logger's scalars."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from controller.health import HealthConfig, HealthMonitor, HealthState, observe, replay, resume_state
from controller.loggers.scalars import ScalarView
from base.typed_config import ConfigError, build
from tests.controller.test_config import load


def cfg(**over) -> HealthConfig:
    return dataclasses.replace(load().health, **over)


def healthy(step: int, rng: random.Random) -> dict:
    """A step of a run that learns: some advantages non-zero, small KL, steady norms, reward ~0.5."""
    return {"kind": "step", "step": step, "adv_zero_fraction": rng.choice([0.0, 0.25, 0.5]),
            "kl": rng.uniform(0.002, 0.02), "grad_norm": rng.uniform(0.5, 2.0), "reward_mean": rng.uniform(0.4, 0.6)}


def run(c: HealthConfig, events: list[dict]) -> list:
    return replay(c, events)


def test_the_shipped_thresholds_build_and_a_healthy_run_is_quiet():
    c = load().health
    assert c.enabled and c.zero_advantage_steps == 20
    rng = random.Random(0)
    assert run(c, [healthy(s, rng) for s in range(2000)]) == []


def test_zero_advantage_streak_at_n_steps_then_each_doubling():
    c = cfg(zero_advantage_steps=5)
    rng = random.Random(1)
    events = [healthy(s, rng) for s in range(20)]
    events += [{**healthy(s, rng), "adv_zero_fraction": 1.0, "grad_norm": 0.0} for s in range(20, 62)]
    warnings = run(c, events)
    assert [(w.signal, w.step, w.value) for w in warnings] == [
        ("zero_advantage_streak", 24, 5.0), ("zero_advantage_streak", 29, 10.0),
        ("zero_advantage_streak", 39, 20.0), ("zero_advantage_streak", 59, 40.0)]
    assert "5 steps in a row with every advantage 0" in warnings[0].message
    # An almost-zero step (one execution of four with an advantage) breaks the streak; the next
    # five in a row make a new one.
    events[26]["adv_zero_fraction"] = 0.75
    assert [w.step for w in run(c, events)] == [24, 31, 36, 46]


def test_kl_spike_against_the_rolling_median_and_the_floor():
    c = cfg(kl_spike_factor=10.0, kl_spike_min=0.1, min_history=10)
    rng = random.Random(2)
    events = [healthy(s, rng) for s in range(40)]
    events[30]["kl"] = 3.6  # the soak's collapse step
    warnings = run(c, events)
    assert [(w.signal, w.step) for w in warnings] == [("kl_spike", 30)]
    assert warnings[0].value == 3.6 and 0.1 <= warnings[0].threshold < 0.2
    # Ten times a tiny median but under the floor: not a spike.
    events[30]["kl"] = 0.09
    assert run(c, events) == []
    # Too little history for a verdict.
    assert run(c, [{**healthy(0, rng), "kl": 0.001}, {**healthy(1, rng), "kl": 5.0}]) == []


def test_grad_norm_outlier_and_a_non_finite_norm():
    c = cfg(grad_norm_factor=10.0, min_history=10)
    rng = random.Random(3)
    events = [healthy(s, rng) for s in range(40)]
    events[25]["grad_norm"] = 80.0
    events[33]["grad_norm"] = math.nan
    warnings = run(c, events)
    assert [(w.signal, w.step) for w in warnings] == [("grad_norm_outlier", 25), ("grad_norm_outlier", 33)]
    assert "update was skipped" in warnings[1].message
    # A zero norm (a step without data, no update) is neither an outlier nor history.
    state, _ = observe(c, HealthState(), {**healthy(0, rng), "grad_norm": 0.0})
    assert state.grad_norms == ()


def test_reward_that_falls_and_stays_warns_once_and_rearms_on_recovery():
    c = cfg(reward_window=10, reward_drop=0.3, reward_drop_steps=10)
    rng = random.Random(4)
    events = [{**healthy(s, rng), "reward_mean": 0.63} for s in range(100)]
    events += [{**healthy(s, rng), "reward_mean": 0.0} for s in range(100, 200)]
    warnings = [w for w in run(c, events) if w.signal == "reward_collapse"]
    # The window's mean is 0.3 or more below the best from step 104 (5 of its 10 at 0); it warns
    # on the 10th such step.
    assert [w.step for w in warnings] == [113]
    assert warnings[0].value == pytest.approx(0.0) and "down from its best 0.630" in warnings[0].message
    # A dip that recovers within the patience is not a collapse.
    dip = [{**healthy(s, rng), "reward_mean": 0.63 if not 100 <= s < 108 else 0.0} for s in range(200)]
    assert [w for w in run(c, dip) if w.signal == "reward_collapse"] == []
    # Recovered, then fallen again: warned again.
    again = events + [{**healthy(s, rng), "reward_mean": 0.63} for s in range(200, 230)] + \
        [{**healthy(s, rng), "reward_mean": 0.0} for s in range(230, 300)]
    assert [w.step for w in run(c, again) if w.signal == "reward_collapse"] == [113, 243]


def test_the_soaks_collapse_is_seen_by_every_signal_it_showed():
    """The pattern bench.soak once showed: reward ~0.63, ~150 zero-advantage steps, one step with
    KL 3.6, then reward 0 and zero advantage for good."""
    c = load().health
    rng = random.Random(5)
    events = [{**healthy(s, rng), "reward_mean": 0.63} for s in range(1100)]
    events += [{**healthy(s, rng), "reward_mean": 0.63, "adv_zero_fraction": 1.0, "grad_norm": 0.0}
               for s in range(1100, 1256)]
    events += [{**healthy(1256, rng), "kl": 3.6, "grad_norm": 40.0}]
    events += [{**healthy(s, rng), "reward_mean": 0.0, "adv_zero_fraction": 1.0, "grad_norm": 0.0}
               for s in range(1257, 1320)]
    signals = {w.signal for w in run(c, events)}
    assert signals == {"zero_advantage_streak", "kl_spike", "grad_norm_outlier", "reward_collapse"}


def test_disabled_is_silent_and_adds_nothing():
    c = cfg(enabled=False, zero_advantage_steps=1)
    monitor = HealthMonitor(c)
    assert monitor.observe({"step": 0, "adv_zero_fraction": 1.0, "kl": 99.0}) == ({}, [])


def test_a_resumed_controller_carries_the_streak_on(tmp_path):
    """The monitor reads the run's metrics.jsonl (earlier attempts' step events) when it starts,
    so a streak spanning a resume warns on time; a line torn by a kill is skipped."""
    c = cfg(zero_advantage_steps=5)
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"kind": "step", "step": s, "adv_zero_fraction": 1.0}) for s in range(3)]
    path.write_text("\n".join([json.dumps({"kind": "progress", "t": 1}), *lines, '{"kind": "st']) + "\n")
    monitor = HealthMonitor(c, path)
    assert monitor.state.zero_streak == 3
    fields, warnings = monitor.observe({"step": 3, "adv_zero_fraction": 1.0})
    assert fields == {"zero_adv_streak": 4} and warnings == []
    _, warnings = monitor.observe({"step": 4, "adv_zero_fraction": 1.0})
    assert [w.step for w in warnings] == [4]
    # Only the tail is read on a long file (its first, partial line dropped).
    assert resume_state(c, path, max_bytes=len(lines[-1]) + 30).zero_streak == 1


def test_warnings_become_scalars_for_every_logger():
    view = ScalarView()
    [w] = replay(cfg(zero_advantage_steps=1), [{"kind": "step", "step": 7, "adv_zero_fraction": 1.0}])
    scalars = view.scalars("health", {"t": 3.0, **w.fields()})
    assert [(s.tag, s.value, s.axis, s.x) for s in scalars] == [("health/zero_advantage_streak", 1.0, "step", 7)]
    assert [(s.tag, s.value) for s in view.scalars("step", {"step": 7, "zero_adv_streak": 1})] == [
        ("health/zero_advantage_streak", 1.0)]


def test_bad_thresholds_are_refused():
    data = {f.name: getattr(load().health, f.name) for f in dataclasses.fields(HealthConfig)}
    with pytest.raises(ConfigError, match="kl_spike_factor"):
        build(HealthConfig, {**data, "kl_spike_factor": 0.5}, "health")
    with pytest.raises(ConfigError, match="min_history: want <= window"):
        build(HealthConfig, {**data, "min_history": 100}, "health")
    with pytest.raises(ConfigError, match="missing key"):
        build(HealthConfig, {k: v for k, v in data.items() if k != "window"}, "health")
