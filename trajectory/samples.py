"""Kept trajectories -> training sequences (dedup, fair weights) -> shards (packing).

Dedup: each policy token (tree position) is a training target in exactly one kept trajectory,
the first in kept order whose chain holds it; in the others it is context (mask 0, logprob 0).
Prompts, tool results and system text are never targets. A sequence ends at its last target
(later tokens cannot change the loss), and a kept trajectory left with no target is not sent.

Fair weighting: every sequence of an execution carries ``token_weight = 1 / T`` where T is the
execution's number of targets, so ``sum(token_weight * loss_t)`` over its targets is the
execution's mean and each execution weighs the same however many branches it has.

Packing: a group's sequences go into shards of at most ``max_tokens`` tokens (sum of sequence
lengths), keeping an execution's sequences in one shard whenever it fits in one on its own (the
``execution`` ratio unit pools them). An execution too big for one shard is split between
sequences; a single sequence over the limit gets a shard of its own, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import numpy as np

from base.wire import Sequence, Shard
from trajectory.tree import Edge, Trajectory

log = logging.getLogger(__name__)


def build_sequences(execution_id: str, kept: Seq[Trajectory], *, advantage: float) -> list[Sequence]:
    """The training sequences of one execution's kept trajectories (in kept order)."""
    claimed: set[Edge] = set()
    drafts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for trajectory in kept:
        masks: list[np.ndarray] = []
        logprobs: list[np.ndarray] = []
        for edge in trajectory.edges:
            if edge in claimed:
                masks.append(np.zeros(len(edge), np.int8))
                logprobs.append(np.zeros(len(edge), np.float64))
            else:
                claimed.add(edge)
                masks.append(edge.policy_mask())
                logprobs.append(edge.logprobs)
        mask = np.concatenate(masks)
        targets = np.flatnonzero(mask)
        if not len(targets):
            continue
        end = int(targets[-1]) + 1
        tokens = np.concatenate([e.tokens for e in trajectory.edges])[:end]
        drafts.append((tokens, mask[:end], np.concatenate(logprobs)[:end]))
    num_targets = sum(int(np.count_nonzero(m)) for _, m, _ in drafts)
    if not num_targets:
        return []
    weight = 1.0 / num_targets
    return [
        Sequence(
            execution_id=execution_id,
            tokens=tokens.tolist(),
            target_mask=mask.tolist(),
            behaviour_logprobs=lps.tolist(),
            advantage=advantage,
            token_weight=weight,
        )
        for tokens, mask, lps in drafts
    ]


def pack_shards(
    *,
    group_id: str,
    step: int,
    per_execution: Seq[Seq[Sequence]],
    max_tokens: int,
) -> list[Shard]:
    """Shards of one group. ``per_execution`` holds each usable execution's sequences (maybe none).

    ``num_executions`` adds up over the returned shards to ``len(per_execution)``: an execution
    counts in the shard holding its first sequence, executions without sequences in the first
    shard. No shard when there is no sequence at all. Names: ``group_id`` for a single shard,
    ``group_id/0``, ``group_id/1`` ... when split.
    """
    batches: list[tuple[list[Sequence], int]] = []
    current: list[Sequence] = []
    current_tokens = 0
    current_execs = 0

    def flush() -> None:
        nonlocal current, current_tokens, current_execs
        if current:
            batches.append((current, current_execs))
        current, current_tokens, current_execs = [], 0, 0

    num_empty = 0
    for sequences in per_execution:
        if not sequences:
            num_empty += 1
            continue
        size = sum(len(s.tokens) for s in sequences)
        if current and current_tokens + size > max_tokens:
            flush()
        current_execs += 1
        for s in sequences:  # whole execution when it fits; otherwise split between sequences
            if current and current_tokens + len(s.tokens) > max_tokens:
                flush()
            if len(s.tokens) > max_tokens:
                log.warning(
                    "sequence of %d tokens is over max_tokens_per_microstep=%d; shipped alone "
                    "(execution %s, group %s)", len(s.tokens), max_tokens, s.execution_id, group_id,
                )
            current.append(s)
            current_tokens += len(s.tokens)
    flush()
    if not batches:
        return []
    names = [group_id] if len(batches) == 1 else [f"{group_id}/{i}" for i in range(len(batches))]
    return [
        Shard(
            step=step,
            shard_id=name,
            num_executions=num_execs + (num_empty if i == 0 else 0),
            sequences=seqs,
        )
        for i, (name, (seqs, num_execs)) in enumerate(zip(names, batches))
    ]
