"""Group-normalised advantages (GRPO/GSPO): one number per usable execution of a group.

    A_i = (r_i - mean(r)) / (std(r) + adv_eps)

over the usable executions of the group only (grader failures and crashes are excluded before
this, never counted as 0). ``std`` is the population standard deviation. When every reward is
equal (including a group of one) every advantage is exactly 0: the group carries no preference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], *, adv_eps: float) -> list[float]:
    if adv_eps < 0:
        raise ValueError(f"adv_eps: want >= 0, got {adv_eps}")
    if not rewards:
        return []
    if min(rewards) == max(rewards):
        return [0.0] * len(rewards)
    mean = math.fsum(rewards) / len(rewards)
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std + adv_eps == 0:  # rewards differing only below float resolution
        return [0.0] * len(rewards)
    return [(r - mean) / (std + adv_eps) for r in rewards]
