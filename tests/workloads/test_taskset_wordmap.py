"""The wordmap task set: deterministic, train/eval disjoint, the TASK.md format the harness reads."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import yaml

from base.typed_config import build
from workloads import harness
from workloads.config import WorkloadConfig
from workloads.tasksets.wordmap import TOPICS, Task, make_tasks, task_file_text, write_task_file


def _cfg(**changes) -> WorkloadConfig:
    """conf/workload/wordmap.yaml, with ``changes``."""
    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf/workload/wordmap.yaml").read_text())
    return dataclasses.replace(build(WorkloadConfig, raw), **changes)


def test_deterministic():
    assert make_tasks(_cfg()) == make_tasks(_cfg())
    assert make_tasks(_cfg()) != make_tasks(_cfg(task_seed=99))


def test_train_and_eval_are_disjoint_and_sized():
    train, held_out = make_tasks(_cfg())
    assert len(train) == 256 and len(held_out) == 16
    assert not {t.prompt for t in train} & {t.prompt for t in held_out}
    assert not {t.task_id for t in train} & {t.task_id for t in held_out}
    assert len({t.prompt for t in train}) == len(train)


def test_every_topic_in_both_sets_and_eval_balanced():
    train, held_out = make_tasks(_cfg())
    names = {t.name for t in TOPICS}
    assert {t.topic for t in train} == names == {t.topic for t in held_out}
    counts = Counter(t.topic for t in held_out)
    assert max(counts.values()) - min(counts.values()) <= 1
    target_of = {t.name: t.target for t in TOPICS}
    assert all(t.target == target_of[t.topic] for t in train + held_out)


def test_eval_set_does_not_move_with_train_count():
    assert make_tasks(_cfg(num_train_tasks=10))[1] == make_tasks(_cfg())[1]


def test_prompt_never_contains_the_target():
    train, held_out = make_tasks(_cfg())
    for t in train + held_out:
        assert t.target.lower() not in t.prompt.lower()


def test_task_file_round_trips_through_the_harness_reader(tmp_path: Path):
    task = make_tasks(_cfg())[0][0]
    path = write_task_file(task, tmp_path / "ws")
    assert path.read_text(encoding="utf-8") == task_file_text(task)
    assert path.read_text(encoding="utf-8").startswith(f"file: {task.file_name}\n")
    assert harness.read_task(tmp_path / "ws") == (task.file_name, task.prompt)


@pytest.mark.parametrize("bad", ["../x.txt", "a/b.txt", "", ".hidden", "TASK.md"])
def test_write_task_file_refuses_paths(tmp_path: Path, bad: str):
    task = Task(task_id="t", prompt="p", target="x", file_name=bad, topic="x")
    with pytest.raises(ValueError, match="file_name"):
        write_task_file(task, tmp_path)
