"""Typed mirror of conf/workload/*.yaml."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class ThinkTimeConfig:
    """Tool time the bundled harness spends after each model call, so runs have the long-tailed
    lengths of real agent runs (``kind: none`` leaves the harness as fast as it can go)."""

    kind: Literal["none", "lognormal"]
    median_s: float
    """Median of a run's total think time."""
    sigma: float
    """Log-normal shape: 1.0 puts about 1 run in 20 past 5x the median."""
    max_s: float
    """A run's total think time is capped here (set it past ``timeout_s`` to have runs time out)."""
    seed: int
    """A run's think time is a function of (seed, execution id): the same in every policy's run."""

    def check(self) -> None:
        if self.median_s <= 0 or self.sigma < 0 or self.max_s <= 0:
            raise ValueError("think_time: want median_s > 0, sigma >= 0, max_s > 0")


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    name: Literal["wordmap"]
    harness: Literal["bundled"]
    num_train_tasks: int
    num_eval_tasks: int
    groups_per_step: int
    group_size: int
    """Executions of one task per GSPO group (16 on clusters; fewer in the embedded default)."""
    min_usable_per_group: int
    """A group with fewer gradable executions is dropped whole, and counted."""
    max_turns: int
    max_new_tokens: int
    temperature: float
    timeout_s: float
    """A harness run past this is killed and graded from its workspace (partial grading)."""
    task_seed: int
    think_time: ThinkTimeConfig
    harness_nice: int = 10
    """How far below the controller's CPU priority harness processes run (``nice`` steps), so a burst of harness start-ups (a step's
    group launched at once) cannot starve the controller, proxy and cells sharing the node's
    cores; 0 keeps the controller's priority."""

    def check(self) -> None:
        if not 0 <= self.harness_nice <= 19:
            raise ValueError("harness_nice: want 0..19")
        if self.group_size < 2:
            raise ValueError("group_size: want >= 2 (advantages are normalised within a group)")
        if not 1 <= self.min_usable_per_group <= self.group_size:
            raise ValueError("min_usable_per_group: want 1..group_size")
