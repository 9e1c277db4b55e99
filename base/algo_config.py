"""Typed mirror of conf/algo/*.yaml: GSPO (advantages here, the loss in the trainer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class RolloutSampling:
    """How the engine samples for training executions, whatever the harness asks (its values are
    recorded beside them); eval executions keep the harness's. The trainer takes its log-probs at
    the same temperature, so an unchanged policy's ratio is 1."""

    temperature: float
    top_p: float
    top_k: int
    """-1: the whole vocabulary."""

    def check(self) -> None:
        if not 0.0 < self.temperature <= 2.0:
            raise ValueError(f"rollout.temperature: want (0, 2], got {self.temperature}")
        if self.top_p != 1.0 or self.top_k != -1:
            # The trainer's log-probs are over the whole vocabulary; a truncated sampler's behaviour
            # log-probs are over the kept tokens only, so every ratio would be off by the cut mass.
            raise ValueError(f"rollout.top_p={self.top_p}, top_k={self.top_k}: training under top-p/top-k "
                             "truncation would bias the GSPO ratio (the trainer scores the whole vocabulary); "
                             "want top_p=1.0 and top_k=-1")


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    kind: Literal["gspo"]
    eps_low: float
    """Sequence ratio clipped below at 1 - eps_low."""
    eps_high: float
    """Sequence ratio clipped above at 1 + eps_high."""
    ratio_unit: Literal["trajectory"]
    """Policy tokens the length-normalised ratio is taken over: one ratio per training sequence
    (trajectory), as in the GSPO paper. Pooling per execution is a planned second choice."""
    adv_eps: float
    lr: float
    betas: tuple[float, ...]
    weight_decay: float
    grad_clip: float
    """Global grad-norm clip on the combined gradient; 0 disables."""
    max_tokens_per_microstep: int
    tree_packing: bool
    """Compute dedup in the embedded trainer: run each execution's prefix trie once with a
    tree-shaped attention mask instead of every chain in full (same log-probs, fewer FLOPs)."""
    max_trajectories_per_execution: int
    """Bounded sampling: at most this many trajectories of one execution are trained (by priority)."""
    rollout: RolloutSampling
    release: Literal["group", "run"]
    """When an execution's data may train. ``group``: in shards with advantages, once its whole
    group is graded. ``run``: as soon as it is graded, with advantages applied when the group
    closes (the same update, exactly: cellrunner.run_release). ``run`` keeps a gradient-sized
    buffer per execution on the cell that trained it, so only the embedded trainer takes it."""

    def check(self) -> None:
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError("eps_low/eps_high: want 0 <= eps_low < 1 and eps_high >= 0")
        if len(self.betas) != 2:
            raise ValueError("betas: want two numbers")
