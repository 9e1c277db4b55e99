"""The run's stages and the walk through them, as ``controller.cells.PHASES`` is for a cell.

A run starts its processes (``starting``), evaluates the untrained policy when asked
(``eval_start``), trains (``train``), waits for every cell to serve the final weights and every
execution to settle (``final``), evaluates the trained policy when asked (``eval_end``), gives
the processor a moment for the last executions' facts (``closing``), and ends (``done``). With
``run.eval_every`` an eval round also starts at every N-th version while training goes on; it is
not a stage: its runs queue beside the rollouts and only serve.
``STAGES`` is every move allowed; the controller moves its stage only through ``set_stage``,
which checks it there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from controller.cells import CellRegistry
    from controller.config import GyreConfig
    from controller.executions import Execution, ExecutionManager
    from controller.report import MetricsSink
    from controller.steps import StepCoordinator
    from workloads.api import Task

log = logging.getLogger(__name__)

Stage = Literal["starting", "eval_start", "train", "final", "eval_end", "closing", "done"]

STAGES: dict[Stage, tuple[Stage, ...]] = {
    "starting": ("eval_start", "train"),  # eval_start with run.eval_at_start on a fresh run
    "eval_start": ("train",),
    "train": ("final",),                   # every step applied (at once on a resume past run.steps)
    "final": ("eval_end", "closing"),      # eval_end with run.eval_at_end
    "eval_end": ("closing",),
    "closing": ("done",),
    "done": (),
}

CLOSING_GRACE_S = 5.0
"""How long a finished run waits for the processor's last ExecutionFacts."""


class StageError(RuntimeError):
    """A stage change the table does not allow: a controller bug, never a run's condition."""


def check_transition(current: Stage, to: Stage) -> Stage:
    """``to``, when the table allows ``current -> to``; else ``StageError``."""
    if to not in STAGES.get(current, ()):
        raise StageError(f"run stage: {current} -> {to} is not a transition")
    return to


@dataclass
class EvalRound:
    label: str
    at_step: int
    executions: list[Execution] = field(default_factory=list)
    logged: bool = False

    @property
    def done(self) -> bool:
        return all(ex.settled for ex in self.executions)

    def mean(self) -> float | None:
        """Mean reward of the graded runs: a grader failure or a crashed harness is left out
        (and logged), never scored 0, as in training."""
        rewards = [ex.reward for ex in self.executions if ex.reward is not None]
        return sum(rewards) / len(rewards) if rewards else None


class RunStages:
    """The controller's walk through ``STAGES``: when each stage is over, and the eval rounds
    that open and close the run.

    A mixin of ``controller.controller.Controller``, not a part it owns: whether a stage is over
    is read from the controller's cells, steps, executions and eval rounds, and an eval round is
    planned through its executions, so a separate object would hold nothing of its own but a
    reference to all of them. What it reads is declared here."""

    cfg: GyreConfig
    cells: CellRegistry
    steps: StepCoordinator
    executions: ExecutionManager
    metrics: MetricsSink
    eval_tasks: list[Task]
    t0: float
    stage: Stage
    evals: list[EvalRound]
    eval_from: int
    """The version this attempt started at: periodic rounds are for versions it applies itself
    (the attempt before evaluated the one it resumed from)."""
    facts_seen: set[str]
    closing_until: float

    def set_stage(self, stage: Stage) -> None:
        """Every stage change, checked against ``STAGES``."""
        self.stage = check_transition(self.stage, stage)

    def advance_stage(self) -> None:
        if self.stage in ("train", "final"):
            self.tend_periodic_evals()
        if self.stage == "eval_start" and self.evals[-1].done:
            self.finish_eval()
            self.set_stage("train")
        elif self.stage == "train" and self.steps.version >= self.cfg.run.steps:
            self.set_stage("final")
        elif self.stage == "final":
            alive = self.cells.alive()
            synced = all(c.phase == "serving" and c.weight_version == self.steps.version for c in alive)
            if synced and all(ex.settled for ex in self.executions.executions.values()):
                if self.cfg.run.eval_at_end:
                    self.set_stage("eval_end")
                    self.start_eval("end")
                else:
                    self.close()
        elif self.stage == "eval_end" and self.evals[-1].done:
            self.finish_eval()
            self.close()
        elif self.stage == "closing":
            ended = {eid for eid, ex in self.executions.executions.items() if ex.settled}
            if ended <= self.facts_seen or time.monotonic() > self.closing_until:
                self.set_stage("done")

    def close(self) -> None:
        """Every run is graded: give the processor a moment to send the last runs' facts (they
        follow the last Grade and SealExecution), then stop."""
        self.set_stage("closing")
        self.closing_until = time.monotonic() + CLOSING_GRACE_S

    def tend_periodic_evals(self) -> None:
        """``run.eval_every``: a round at each N-th version this attempt applies (not the last: the
        end eval covers it), and each round logged once its runs have settled. Its runs start at
        that version; a call made after the next update lands is served by the newer weights, as
        a training run's would be (each CallRecord keeps the version that made it)."""
        every, v = self.cfg.run.eval_every, self.steps.version
        if (every > 0 and self.stage == "train" and self.eval_from < v < self.cfg.run.steps and v % every == 0
                and not any(r.label == f"v{v}" for r in self.evals)):
            self.start_eval(f"v{v}")
            log.info("eval (v%d): %d held-out runs queued beside the rollouts", v, len(self.evals[-1].executions))
        for rnd in self.evals:
            if rnd.label.startswith("v") and not rnd.logged and rnd.done:
                self.finish_eval(rnd)

    def start_eval(self, label: str) -> None:
        rnd = EvalRound(label=label, at_step=self.steps.version)
        for i, task in enumerate(self.eval_tasks):
            rnd.executions += self.executions.plan_group(step=self.steps.version, group_id=f"eval-{label}-{i}",
                                                         task=task, train=False, temperature=0.0, size=1,
                                                         min_version=self.steps.version)
        self.evals.append(rnd)

    def finish_eval(self, rnd: EvalRound | None = None) -> None:
        """Log a settled round: the start or end round by default (the newest), or ``rnd``."""
        rnd = rnd if rnd is not None else self.evals[-1]
        rnd.logged = True
        self.metrics.log("eval", t=time.monotonic() - self.t0, label=rnd.label, step=rnd.at_step, reward=rnd.mean(),
                         rewards=[ex.reward for ex in rnd.executions])
        graded = sum(1 for ex in rnd.executions if ex.reward is not None)
        log.info("eval (%s, version %d): mean reward %s over %d of %d held-out tasks graded", rnd.label,
                 rnd.at_step, rnd.mean(), graded, len(rnd.executions))
