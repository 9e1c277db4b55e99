"""Group-normalised advantages (GRPO/GSPO): one number per usable execution of a group.

    A_i = (r_i - mean(r)) / (std(r) + adv_eps)

over the usable executions of the group only (grader failures and crashes are excluded before
this, never counted as 0). ``std`` is the population standard deviation. When every reward is
equal (including a group of one) every advantage is exactly 0: the group carries no preference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_stats(rewards: Sequence[float], *, adv_eps: float) -> tuple[float, float]:
    """(mean, divisor) of a group: ``advantage(r, mean, divisor)`` is each member's advantage.

    The divisor is ``std + adv_eps``, or 0 when every advantage is 0 (equal rewards, an empty
    group, or rewards differing only below float resolution). A run-released cell gets these two
    numbers in ``GroupStats`` and computes the very advantages a whole-group shard would carry.
    """
    if adv_eps < 0:
        raise ValueError(f"adv_eps: want >= 0, got {adv_eps}")
    if not rewards:
        return 0.0, 0.0
    mean = math.fsum(rewards) / len(rewards)
    if min(rewards) == max(rewards):
        return mean, 0.0
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
    return mean, std + adv_eps


def advantage(reward: float, mean: float, divisor: float) -> float:
    return (reward - mean) / divisor if divisor != 0 else 0.0


def group_advantages(rewards: Sequence[float], *, adv_eps: float) -> list[float]:
    mean, divisor = group_stats(rewards, adv_eps=adv_eps)
    return [advantage(r, mean, divisor) for r in rewards]
