"""Bounded sampling, dedup, fair weights, packing, advantages — on small hand-made trees."""

from __future__ import annotations

import math

import pytest

from base.wire import Sequence
from tests.trajectory import ASSISTANT, END, SYS, TOOL, USER, Run, tree_of
from base.advantages import group_advantages
from trajectory.samples import build_sequences, pack_shards
from trajectory.sampling import select

PROMPT = [SYS, 101, USER, 201, ASSISTANT]


def branching_run() -> Run:
    """Main with a retried-and-regenerated turn, a summary branch, and two sub-agents."""
    run = Run("e")
    turn = run.call(PROMPT, [301, END])
    run.call(turn + [TOOL, 401, ASSISTANT], [302, 303, END])       # main leaf A (3 new)
    run.call(turn + [TOOL, 401, ASSISTANT], [304, END])            # regenerated: main leaf B (2 new)
    run.call(turn + [TOOL, 401, 501, ASSISTANT], [351, END], lineage="main-summary")
    run.call([SYS, 111, USER, 211, ASSISTANT], [311, END], lineage="sub-agent", agent_id="a1")
    run.call([SYS, 111, USER, 221, ASSISTANT], [321, 322, END], lineage="sub-agent", agent_id="a2")
    return run


def test_kept_in_priority_order_then_more_policy_tokens() -> None:
    kept = select(tree_of(branching_run()).trajectories(), max_trajectories=5)
    assert [t.kind for t in kept] == ["main", "main", "main-summary", "sub-agent", "sub-agent"]
    assert [t.num_policy_tokens for t in kept] == [5, 4, 4, 3, 2]


@pytest.mark.parametrize("k, want", [(1, ["main"]), (3, ["main", "main", "main-summary"])])
def test_at_most_k_kept(k: int, want: list[str]) -> None:
    kept = select(tree_of(branching_run()).trajectories(), max_trajectories=k)
    assert [t.kind for t in kept] == want


def test_ties_within_a_kind_go_to_the_earliest_call() -> None:
    run = Run("e")
    run.call(PROMPT, [302, END])
    run.call(PROMPT, [301, END])
    kept = select(tree_of(run).trajectories(), max_trajectories=1)
    assert kept[0].first_call_id == "e/c0"


def test_dedup_each_policy_token_is_a_target_once() -> None:
    kept = select(tree_of(branching_run()).trajectories(), max_trajectories=5)
    seqs = build_sequences("e", kept, advantage=0.5)
    first, second = seqs[0], seqs[1]
    n = len(PROMPT)
    # main leaf A owns the shared first turn; leaf B sees it as context.
    assert first.tokens == PROMPT + [301, END, TOOL, 401, ASSISTANT, 302, 303, END]
    assert first.target_mask == [0] * n + [1, 1, 0, 0, 0, 1, 1, 1]
    assert second.tokens == PROMPT + [301, END, TOOL, 401, ASSISTANT, 304, END]
    assert second.target_mask == [0] * n + [0, 0, 0, 0, 0, 1, 1]
    assert second.behaviour_logprobs[n : n + 2] == [0.0, 0.0]
    assert second.behaviour_logprobs[-1] == -0.5
    num_targets = sum(sum(s.target_mask) for s in seqs)
    assert num_targets == 2 + 3 + 2 + 2 + 2 + 3
    assert all(s.advantage == 0.5 and s.token_weight == 1 / num_targets for s in seqs)
    assert math.isclose(sum(s.token_weight * sum(s.target_mask) for s in seqs), 1.0)


def test_a_trajectory_adding_no_target_is_passed_over_and_sequences_end_at_their_last_target() -> None:
    run = Run("e")
    turn = run.call(PROMPT, [301, END])
    run.call(turn + [TOOL, 401, ASSISTANT], [])  # aborted before its first token: all context
    run.call(turn + [TOOL, 402, ASSISTANT], [302])
    kept = select(tree_of(run).trajectories(), max_trajectories=5)
    assert [t.first_call_id for t in kept] == ["e/c2"]
    (seq,) = build_sequences("e", kept, advantage=1.0)
    assert seq.tokens[-1] == 302 and seq.target_mask[-1] == 1


def test_an_execution_without_policy_tokens_gives_no_sequences() -> None:
    run = Run("e")
    run.call(PROMPT, [])
    assert build_sequences("e", select(tree_of(run).trajectories(), max_trajectories=5), advantage=1.0) == []


def seq(execution_id: str, n: int) -> Sequence:
    return Sequence(
        execution_id=execution_id, tokens=[SYS] * (n - 1) + [301], target_mask=[0] * (n - 1) + [1],
        behaviour_logprobs=[0.0] * (n - 1) + [-0.5], advantage=0.0, token_weight=1.0,
    )


def test_one_shard_per_group_when_it_fits() -> None:
    (shard,) = pack_shards(
        group_id="g", step=3, per_execution=[[seq("a", 4)], [], [seq("b", 4), seq("b", 2)]], max_tokens=100
    )
    assert (shard.shard_id, shard.step, shard.num_executions, len(shard.sequences)) == ("g", 3, 3, 3)


def test_split_shards_keep_executions_whole_when_they_fit() -> None:
    shards = pack_shards(
        group_id="g", step=0,
        per_execution=[[seq("a", 6), seq("a", 4)], [seq("b", 12)], [], [seq("c", 30), seq("c", 5)], [seq("d", 2)]],
        max_tokens=20,
    )
    got = [(s.shard_id, s.num_executions, [(q.execution_id, len(q.tokens)) for q in s.sequences]) for s in shards]
    assert got == [
        ("g/0", 2, [("a", 6), ("a", 4)]),  # + the execution without sequences
        ("g/1", 1, [("b", 12)]),
        ("g/2", 1, [("c", 30)]),  # over the limit on its own: shipped alone
        ("g/3", 1, [("c", 5), ("d", 2)]),
    ]
    assert sum(s.num_executions for s in shards) == 5


def test_no_shard_without_sequences() -> None:
    assert pack_shards(group_id="g", step=0, per_execution=[[], []], max_tokens=10) == []


def test_advantages_are_group_normalised_with_population_std() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], adv_eps=0.0)
    assert adv == [1.0, -1.0, -1.0, 1.0]
    adv = group_advantages([3.0, 1.0], adv_eps=1e-6)
    assert adv[0] == pytest.approx(1 / (1 + 1e-6)) and adv[1] == pytest.approx(-adv[0])


@pytest.mark.parametrize("rewards", [[0.7, 0.7, 0.7], [0.1] * 10, [2.0]])
def test_equal_rewards_give_zero_advantages(rewards: list[float]) -> None:
    assert group_advantages(rewards, adv_eps=0.0) == [0.0] * len(rewards)
