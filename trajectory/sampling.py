"""Bounded sampling: which of an execution's trajectories are trained.

At most ``max_trajectories`` (K) are kept, taken in rank order:

1. kind: main > main-summary > sub-agent > sub-agent-summary;
2. within a kind, more policy tokens first (the longer run carries more of the policy's work);
3. then the earliest ``first_call_index``, then ``first_call_id`` (a total, stable order: no two
   leaves share an ending call).

A trajectory whose policy tokens all lie on trajectories already kept would add no training
target (after dedup it is pure context), so it is passed over and does not use up one of the K
places. Everything else is a pure function of the tree, so a replay keeps the same set.
"""

from __future__ import annotations

from collections.abc import Iterable

from trajectory.tree import KIND_PRIORITY, Edge, Trajectory


def rank_key(trajectory: Trajectory) -> tuple[int, int, int, str]:
    return (
        KIND_PRIORITY[trajectory.kind],
        -trajectory.num_policy_tokens,
        trajectory.first_call_index,
        trajectory.first_call_id,
    )


def select(trajectories: Iterable[Trajectory], *, max_trajectories: int) -> list[Trajectory]:
    """The kept trajectories, in rank order (the order dedup assigns targets in)."""
    if max_trajectories < 1:
        raise ValueError(f"max_trajectories: want >= 1, got {max_trajectories}")
    kept: list[Trajectory] = []
    covered: set[Edge] = set()
    for trajectory in sorted(trajectories, key=rank_key):
        if len(kept) == max_trajectories:
            break
        if not any(e.num_policy for e in trajectory.edges if e not in covered):
            continue
        kept.append(trajectory)
        covered.update(trajectory.edges)
    return kept
