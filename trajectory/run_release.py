"""Run release (``algo.release=run``): one execution's shards, sent before its group closes.

The processor sends an execution's data as soon as it is graded and sealed, with advantage 0
and its reward attached; the group's ``GroupDone`` later carries ``mean_reward`` and
``adv_divisor``, from which the cell that trained the shard makes the very advantage a
whole-group shard would have carried (``base.advantages.advantage``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

from base.wire import Grade, Sequence, Shard
from trajectory.samples import pack_shards

EXECUTION_SENT_MARKER = "execution_sent"
"""Log marker kind (field ``execution_id``): this execution's run-released shards went out."""


def run_released_shards(grade: Grade, sequences: Seq[Sequence], *, max_tokens: int) -> list[Shard]:
    """The shards of one graded execution, named ``<group>/<execution>`` (``/k`` when split).

    The name depends only on the grade, so a resend after a restart carries the same shard id.
    """
    assert grade.reward is not None, "only usable executions are released"
    shards = pack_shards(
        group_id=f"{grade.group_id}/{grade.execution_id}", step=grade.step,
        per_execution=[sequences], max_tokens=max_tokens,
    )
    return [dataclasses.replace(s, group_id=grade.group_id, reward=grade.reward) for s in shards]


def released_execution(shard: Shard) -> str | None:
    """The execution a run-released shard holds (None for a group-mode shard)."""
    if not shard.run_released or not shard.sequences:
        return None
    return shard.sequences[0].execution_id
