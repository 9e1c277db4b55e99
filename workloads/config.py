"""Typed mirror of conf/workload/*.yaml."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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

    def check(self) -> None:
        if self.group_size < 2:
            raise ValueError("group_size: want >= 2 (advantages are normalised within a group)")
        if not 1 <= self.min_usable_per_group <= self.group_size:
            raise ValueError("min_usable_per_group: want 1..group_size")
