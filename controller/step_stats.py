"""What one training step did, in the figures an RL engineer watches: advantages, clipping, KL,
tokens (prompt, trained, saved by deduplication), staleness and call latency.

The controller feeds it what it already receives (microstep results, the processor's
``ExecutionFacts``) and reads ``figures(step, state)`` into the ``step`` event of metrics.jsonl,
from which every logger (TensorBoard, W&B, Prometheus) takes its scalars. No tensor passes here.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from controller.steps import StepState
from base.wire import ExecutionFacts, MicrostepDone


@dataclass
class _Sums:
    microsteps: int = 0
    ratio: float = 0.0
    clip: float = 0.0
    kl_weighted: float = 0.0
    kl_tokens: int = 0
    executions: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    tree_tokens: int = 0
    calls: int = 0
    call_s: float = 0.0
    call_s_max: float = 0.0
    staleness_weighted: float = 0.0
    staleness_max: int = 0


class StepFigures:
    """Per-step sums, kept until the step is applied."""

    def __init__(self) -> None:
        self._sums: dict[int, _Sums] = defaultdict(_Sums)

    def on_microstep(self, msg: MicrostepDone) -> None:
        s = self._sums[msg.step]
        s.microsteps += 1
        s.ratio += msg.mean_ratio
        s.clip += msg.clip_fraction
        if msg.kl is not None and msg.num_tokens > 0:
            s.kl_weighted += msg.kl * msg.num_tokens
            s.kl_tokens += msg.num_tokens

    def on_facts(self, step: int, facts: ExecutionFacts) -> None:
        """A training execution's facts (they reach the controller before its step is applied: the
        processor sends them with the execution's shard)."""
        s = self._sums[step]
        s.executions += 1
        s.prompt_tokens += facts.prompt_tokens
        s.output_tokens += facts.output_tokens
        s.tree_tokens += facts.tree_tokens
        s.calls += facts.num_calls
        s.call_s += facts.call_s_sum
        s.call_s_max = max(s.call_s_max, facts.call_s_max)
        s.staleness_weighted += facts.staleness_mean * facts.num_calls
        s.staleness_max = max(s.staleness_max, facts.staleness_max)

    def figures(self, step: int, state: StepState) -> dict[str, Any]:
        """The step's figures (and forget its sums)."""
        s = self._sums.pop(step, _Sums())
        adv = execution_advantages(state)
        out: dict[str, Any] = {
            "clip_fraction": s.clip / s.microsteps if s.microsteps else None,
            "mean_ratio": s.ratio / s.microsteps if s.microsteps else None,
            "kl": s.kl_weighted / s.kl_tokens if s.kl_tokens else None,
            "prompt_tokens": s.prompt_tokens,
            "output_tokens": s.output_tokens,
            # Tokens the calls carried (each call re-sends its history) minus the tree's: what
            # merging shared prefixes saved the trainer.
            "dedup_saved_tokens": max(s.prompt_tokens + s.output_tokens - s.tree_tokens, 0) if s.executions else 0,
            "staleness_mean": s.staleness_weighted / s.calls if s.calls else None,
            "staleness_max": s.staleness_max if s.calls else None,
            "call_s_mean": s.call_s / s.calls if s.calls else None,
            "call_s_max": s.call_s_max if s.calls else None,
        }
        out.update(summarise("adv", adv))
        out["adv_zero_fraction"] = sum(1 for a in adv if a == 0.0) / len(adv) if adv else None
        return out


def execution_advantages(state: StepState) -> list[float]:
    """One advantage per trained execution of the step: from its sequences, or for a run-released
    shard (trained before its group closed) from the group's statistics, as the cells fold it."""
    seen: dict[str, float] = {}
    for shards in state.done_by_cell.values():
        for shard in shards:
            if shard.run_released:
                g = state.groups.get(shard.group_id)
                if g is None or g.dropped or not shard.sequences:
                    continue
                adv = (float(shard.reward) - g.mean_reward) / g.adv_divisor if g.adv_divisor > 0 else 0.0
                seen[shard.sequences[0].execution_id] = adv
                continue
            for seq in shard.sequences:
                seen.setdefault(seq.execution_id, seq.advantage)
    return list(seen.values())


def summarise(prefix: str, values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"{prefix}_mean": None, f"{prefix}_std": None, f"{prefix}_min": None, f"{prefix}_max": None}
    mean = sum(values) / len(values)
    return {
        f"{prefix}_mean": mean,
        f"{prefix}_std": math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)),
        f"{prefix}_min": min(values),
        f"{prefix}_max": max(values),
    }
