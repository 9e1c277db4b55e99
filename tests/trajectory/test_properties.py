"""Property tests on random executions, checked against a brute-force oracle over token tuples.

A tree position is identified by the token tuple from the root to it, so the oracle needs no
tree: a policy position is ``tuple(prompt + output[:j+1])`` of some non-side call, a trajectory
is a non-side call path that is no strict prefix of another one.
"""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from base.wire import CallRecord
from tests.trajectory import record
from trajectory.samples import build_sequences, pack_shards
from trajectory.sampling import rank_key, select
from trajectory.tree import KIND_PRIORITY, TokenTree, Trajectory

LINEAGES = ["main", "main-summary", "sub-agent", "sub-agent-summary", "side"]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def executions(draw: st.DrawFn) -> list[CallRecord]:
    """Calls that continue, branch off or restart earlier paths, over a 4-token alphabet."""
    records: list[CallRecord] = []
    paths: list[list[int]] = []
    for index in range(draw(st.integers(1, 9))):
        prompt: list[int] = []
        if paths and draw(st.booleans()):
            base = draw(st.sampled_from(paths))
            prompt = base[: draw(st.integers(1, len(base)))]
        prompt = prompt + draw(st.lists(st.integers(1, 4), min_size=0 if prompt else 1, max_size=4))
        output = draw(st.lists(st.integers(1, 4), max_size=4))
        logprobs = draw(st.lists(st.floats(-8.0, 0.0), min_size=len(output), max_size=len(output)))
        lineage = draw(st.sampled_from(LINEAGES))
        records.append(record("e", f"c{index}", index, prompt, output, lineage=lineage, logprob=logprobs))
        paths.append(prompt + output)
    return records


def build(records: list[CallRecord]) -> TokenTree:
    tree = TokenTree("e")
    for r in records:
        tree.insert(r)
    return tree


def oracle_policy(records: list[CallRecord]) -> dict[tuple[int, ...], float]:
    """Policy position -> behaviour logprob of the first call that generated it."""
    first: dict[tuple[int, ...], float] = {}
    for r in records:
        if r.lineage == "side":
            continue
        for j, lp in enumerate(r.output_logprobs):
            first.setdefault(tuple(r.prompt_ids + r.output_ids[: j + 1]), lp)
    return first


def oracle_leaves(records: list[CallRecord]) -> dict[tuple[int, ...], str]:
    paths: dict[tuple[int, ...], list[str]] = {}
    for r in records:
        if r.lineage != "side":
            paths.setdefault(tuple(r.prompt_ids + r.output_ids), []).append(r.lineage)
    leaves = {
        p: min(lins, key=KIND_PRIORITY.__getitem__)
        for p, lins in paths.items()
        if not any(len(q) > len(p) and q[: len(p)] == p for q in paths)
    }
    return leaves


def prefixes(t: Trajectory) -> set[tuple[int, ...]]:
    ids = t.token_ids()
    return {tuple(ids[: i + 1]) for i in range(len(ids))}


@SETTINGS
@given(executions())
def test_tree_matches_the_oracle(records: list[CallRecord]) -> None:
    tree = build(records)
    got = {tuple(t.token_ids()): t.kind for t in tree.trajectories()}
    assert got == oracle_leaves(records)
    policy = oracle_policy(records)
    for t in tree.trajectories():
        assert t.num_policy_tokens == len(prefixes(t) & set(policy))


@SETTINGS
@given(executions(), st.integers(1, 5))
def test_every_policy_token_is_a_target_exactly_once(records: list[CallRecord], k: int) -> None:
    policy = oracle_policy(records)
    kept = select(build(records).trajectories(), max_trajectories=k)
    seqs = build_sequences("e", kept, advantage=1.0)
    targets: Counter[tuple[int, ...]] = Counter()
    for s in seqs:
        for i, (m, lp) in enumerate(zip(s.target_mask, s.behaviour_logprobs)):
            node = tuple(s.tokens[: i + 1])
            if m:
                targets[node] += 1
                assert lp == policy[node]  # the first generating call's logprob
            else:
                assert lp == 0.0
    assert all(n == 1 for n in targets.values())
    covered = set().union(*(prefixes(t) for t in kept)) if kept else set()
    assert set(targets) == covered & set(policy)
    # Each sequence is a kept trajectory cut after its last target, in kept order.
    full = iter(t.token_ids() for t in kept)
    for s in seqs:
        assert s.target_mask[-1] == 1
        assert any(ids[: len(s.tokens)] == s.tokens for ids in full)


@SETTINGS
@given(executions(), st.integers(1, 5))
def test_at_most_k_kept_by_priority(records: list[CallRecord], k: int) -> None:
    trajectories = build(records).trajectories()
    kept = select(trajectories, max_trajectories=k)
    assert len(kept) <= k
    assert kept == sorted(kept, key=rank_key)
    kept_ids = {id(t) for t in kept}
    policy = set(oracle_policy(records))
    for t in sorted(trajectories, key=rank_key):
        before = [u for u in kept if rank_key(u) < rank_key(t)]
        new = (prefixes(t) & policy) - set().union(*(prefixes(u) for u in before)) if before else prefixes(t) & policy
        if id(t) in kept_ids:
            assert new, "a kept trajectory adds at least one target"
        else:  # passed over only when K is full or it would add no target
            assert len(before) == k or not new


@SETTINGS
@given(executions(), st.integers(1, 5))
def test_each_executions_target_weights_sum_to_one(records: list[CallRecord], k: int) -> None:
    seqs = build_sequences("e", select(build(records).trajectories(), max_trajectories=k), advantage=-0.3)
    if seqs:
        assert math.isclose(sum(s.token_weight * sum(s.target_mask) for s in seqs), 1.0)
        assert len({s.token_weight for s in seqs}) == 1
    else:
        assert not oracle_policy(records)


@SETTINGS
@given(executions(), st.integers(1, 5), st.data())
def test_duplicating_a_branch_does_not_change_the_execution(
    records: list[CallRecord], k: int, data: st.DataObject
) -> None:
    copies = data.draw(st.lists(st.sampled_from(records), max_size=4))
    more = records + [
        record("e", f"dup{i}", len(records) + i, r.prompt_ids, r.output_ids,
               lineage=r.lineage, logprob=list(r.output_logprobs))
        for i, r in enumerate(copies)
    ]
    before = build_sequences("e", select(build(records).trajectories(), max_trajectories=k), advantage=1.0)
    after = build_sequences("e", select(build(more).trajectories(), max_trajectories=k), advantage=1.0)
    assert after == before


@SETTINGS
@given(st.lists(executions(), min_size=1, max_size=4), st.integers(8, 40))
def test_packing_keeps_every_sequence_and_counts_each_execution_once(
    runs: list[list[CallRecord]], max_tokens: int
) -> None:
    per_execution = [
        build_sequences("e", select(build(r).trajectories(), max_trajectories=5), advantage=0.0) for r in runs
    ]
    shards = pack_shards(group_id="g", step=1, per_execution=per_execution, max_tokens=max_tokens)
    flat = [s for sh in shards for s in sh.sequences]
    assert flat == [s for seqs in per_execution for s in seqs]
    if flat:
        assert sum(sh.num_executions for sh in shards) == len(runs)
    for sh in shards:
        assert sum(len(s.tokens) for s in sh.sequences) <= max_tokens or len(sh.sequences) == 1
