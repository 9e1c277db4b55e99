"""The run's stage table (controller.stages.STAGES): every move the controller makes is one of its
transitions, an illegal one raises, and the walks a run takes are legal, driven through the
controller's own ``advance_stage``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import get_args

import pytest

from controller.controller import Controller
from controller.stages import STAGES, EvalRound, RunStages, Stage, StageError, check_transition

FRESH_WITH_EVALS = ["starting", "eval_start", "train", "final", "eval_end", "closing", "done"]
RESUMED_NO_EVALS = ["starting", "train", "final", "closing", "done"]


def test_the_table_names_every_stage_and_only_stages():
    stages = set(get_args(Stage))
    assert set(STAGES) == stages
    assert all(set(nexts) <= stages for nexts in STAGES.values())
    assert STAGES["done"] == ()


def test_every_stage_is_reachable_from_starting_and_leads_to_done():
    seen, todo = set(), ["starting"]
    while todo:
        stage = todo.pop()
        if stage not in seen:
            seen.add(stage)
            todo += STAGES[stage]
    assert seen == set(STAGES)
    for stage in STAGES:  # no stage is a dead end but done
        assert stage == "done" or STAGES[stage]


@pytest.mark.parametrize("walk", [FRESH_WITH_EVALS, RESUMED_NO_EVALS])
def test_the_walks_a_run_takes_are_legal(walk):
    for current, to in zip(walk, walk[1:]):
        assert check_transition(current, to) == to


@pytest.mark.parametrize("current, to", [
    ("starting", "final"), ("starting", "done"), ("train", "eval_start"), ("train", "closing"),
    ("final", "train"), ("eval_end", "train"), ("closing", "train"), ("done", "starting"), ("train", "train"),
    ("done", "done"),
])
def test_an_illegal_transition_raises(current, to):
    with pytest.raises(StageError, match=f"{current} -> {to} is not a transition"):
        check_transition(current, to)


def test_the_controller_walks_its_stages_through_the_table():
    assert issubclass(Controller, RunStages)


class Walk(RunStages):
    """Just what ``RunStages`` reads: a run of ``steps`` steps with no cells and no executions."""

    def __init__(self, *, steps: int, eval_at_end: bool, eval_every: int = 0):
        self.cfg = SimpleNamespace(run=SimpleNamespace(steps=steps, eval_at_end=eval_at_end, eval_every=eval_every))
        self.cells = SimpleNamespace(alive=lambda: [])
        self.steps = SimpleNamespace(version=0)
        self.executions = SimpleNamespace(executions={}, plan_group=lambda **kw: [])
        self.logged: list[str] = []
        self.metrics = SimpleNamespace(log=lambda kind, **kw: self.logged.append(kind))
        self.eval_tasks = ["task"]
        self.t0 = 0.0
        self.stage = "starting"
        self.evals: list[EvalRound] = []
        self.eval_from = 0
        self.facts_seen: set[str] = set()
        self.closing_until = 0.0

    def walk(self) -> list[str]:
        stages = [self.stage]
        for _ in range(20):
            self.advance_stage()
            if self.stage != stages[-1]:
                stages.append(self.stage)
            if self.stage == "train":
                self.steps.version = self.cfg.run.steps  # every step applied
            if self.stage == "done":
                break
        return stages


def test_a_run_with_both_evals_walks_every_stage():
    run = Walk(steps=2, eval_at_end=True)
    run.set_stage("eval_start")
    run.start_eval("start")
    assert run.walk() == FRESH_WITH_EVALS[1:]
    assert [r.label for r in run.evals] == ["start", "end"] and run.logged == ["eval", "eval"]


def test_a_resumed_run_without_evals_goes_from_train_to_closing():
    run = Walk(steps=2, eval_at_end=False)
    run.set_stage("train")
    assert run.walk() == RESUMED_NO_EVALS[1:]
    assert run.evals == []


def test_an_illegal_move_of_the_controller_raises_and_leaves_its_stage():
    run = Walk(steps=2, eval_at_end=False)
    with pytest.raises(StageError):
        run.set_stage("final")
    assert run.stage == "starting"
    run.set_stage("train")
    with pytest.raises(StageError):
        run.close()  # closing only after final or eval_end
    assert run.stage == "train"


def test_periodic_evals_run_beside_training_at_every_nth_version_but_the_last():
    run = Walk(steps=7, eval_at_end=True, eval_every=3)
    pending = SimpleNamespace(settled=False, reward=None)
    run.executions = SimpleNamespace(executions={}, plan_group=lambda **kw: [pending])
    run.set_stage("train")
    for v in range(1, 7):  # one update applied per tick; the stage stays train throughout
        run.steps.version = v
        run.advance_stage()
        assert run.stage == "train"
    assert [(r.label, r.at_step) for r in run.evals] == [("v3", 3), ("v6", 6)]  # none at 7: the end eval covers it
    assert run.logged == []  # their runs have not settled: nothing logged, training went on
    pending.settled, pending.reward = True, 0.5
    run.advance_stage()
    assert run.logged == ["eval", "eval"] and all(r.logged for r in run.evals)
    run.advance_stage()
    assert run.logged == ["eval", "eval"]  # each round logged once


def test_a_resumed_attempt_does_not_evaluate_the_version_it_resumed_from_again():
    run = Walk(steps=9, eval_at_end=False, eval_every=3)
    run.eval_from = run.steps.version = 3
    run.set_stage("train")
    run.advance_stage()
    assert run.evals == []
    run.steps.version = 6
    run.advance_stage()
    assert [r.label for r in run.evals] == ["v6"]
