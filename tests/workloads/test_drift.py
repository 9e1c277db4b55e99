"""workload.drift: a run's turns and think time as a function of its step, and what the bundled
harness is told (the simulator replays the same function, bench/simulate.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from base.typed_config import ConfigError, build
from workloads.config import BundledHarnessConfig, ThinkTimeConfig, WorkloadConfig
from workloads.drift import RunShape, run_shape
from workloads.harnesses import make_harness
from tests.workloads.test_harnesses import launch

ROOT = Path(__file__).resolve().parents[2]


def workload(**drift) -> WorkloadConfig:
    raw = yaml.safe_load((ROOT / "conf/workload/wordmap.yaml").read_text())
    raw["max_turns"] = 1
    raw["drift"].update(drift)
    return build(WorkloadConfig, raw)


def test_no_drift_by_default():
    wl = workload()
    assert {run_shape(wl, s) for s in range(50)} == {run_shape(wl, 0)}
    assert run_shape(wl, 7).max_turns == 1 and run_shape(wl, 7).think_scale == 1.0


def test_turns_and_think_time_grow_geometrically_to_the_last_step_and_stay():
    wl = workload(growth=4.0, over_steps=20)
    shapes = [run_shape(wl, s) for s in range(25)]
    assert shapes[0].think_scale == 1.0 and shapes[19].think_scale == pytest.approx(4.0)
    assert shapes[24] == shapes[19]  # past over_steps it stays at the growth
    assert shapes[0].max_turns == 1 and shapes[19].max_turns == 4
    assert [s.max_turns for s in shapes] == sorted(s.max_turns for s in shapes)
    assert shapes[10].think_scale == pytest.approx(4.0 ** (10 / 19))


def test_the_task_mix_changes_from_its_step_and_eval_runs_keep_the_configured_shape():
    wl = workload(growth=4.0, over_steps=20, mix_step=10, mix_think=2.0, mix_turns=0.5)
    before, after = run_shape(wl, 9), run_shape(wl, 10)
    assert after.think_scale == pytest.approx(2.0 * 4.0 ** (10 / 19))
    assert after.max_turns == max(1, round(4.0 ** (10 / 19) * 0.5)) and before.think_scale < after.think_scale
    assert run_shape(wl, 15, train=False) == run_shape(workload(), 0)


def test_bad_drift_is_refused_in_words():
    with pytest.raises(ConfigError, match="drift"):
        workload(growth=0.0)
    with pytest.raises(ConfigError, match="drift"):
        workload(over_steps=0)


def test_the_bundled_harness_is_told_this_runs_think_time(tmp_path):
    think = ThinkTimeConfig(kind="lognormal", median_s=2.0, sigma=1.0, max_s=9.0, seed=3)
    harness = make_harness(BundledHarnessConfig(kind="bundled"), think_time=think)
    argv = harness.command(dataclasses.replace(launch(tmp_path), max_turns=3, think_scale=2.5)).argv
    assert argv[argv.index("--think-median-s") + 1] == "5.0" and argv[argv.index("--max-turns") + 1] == "3"
    assert argv[argv.index("--think-max-s") + 1] == "9.0"  # the cap (past the timeout) does not move


def test_task_families_alternate_in_blocks_tool_heavy_first():
    wl = workload(block_steps=3, tool_think=4.0, tool_turns=0.5, token_think=0.25, token_turns=3.0)
    wl = dataclasses.replace(wl, max_turns=2)
    shapes = [run_shape(wl, s) for s in range(12)]
    assert [s.family for s in shapes] == ["tool"] * 3 + ["token"] * 3 + ["tool"] * 3 + ["token"] * 3
    tool, token = shapes[0], shapes[3]
    assert (tool.max_turns, tool.think_scale) == (1, 4.0) and (token.max_turns, token.think_scale) == (6, 0.25)
    assert shapes[6] == tool and shapes[9] == token  # the same family has the same shape in every block
    assert run_shape(wl, 4, train=False) == RunShape(max_turns=2, think_scale=1.0)  # held-out eval keeps its shape
    assert run_shape(workload(), 4).family == ""


def test_families_compose_with_growth():
    wl = workload(growth=4.0, over_steps=5, block_steps=2, tool_think=2.0)
    assert run_shape(wl, 4).think_scale == pytest.approx(4.0 * 2.0) and run_shape(wl, 4).family == "tool"
    assert run_shape(wl, 2).think_scale == pytest.approx(4.0 ** 0.5) and run_shape(wl, 2).family == "token"


def test_bad_families_are_refused_in_words():
    with pytest.raises(ConfigError, match="block_steps"):
        workload(block_steps=-1)
    with pytest.raises(ConfigError, match="tool_think"):
        workload(block_steps=2, tool_think=0.0)
