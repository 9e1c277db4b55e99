"""The prefix tree: continuation, branching, policy vs context, retries, side calls."""

from __future__ import annotations

import dataclasses

import pytest

from tests.trajectory import ASSISTANT, END, SYS, TOOL, USER, record
from trajectory.tree import TokenTree

PROMPT = [SYS, 101, USER, 201, ASSISTANT]


def kinds(tree: TokenTree) -> dict[tuple[int, ...], str]:
    return {tuple(t.token_ids()): t.kind for t in tree.trajectories()}


def test_a_call_extending_the_previous_one_continues_its_path() -> None:
    tree = TokenTree("e")
    tree.insert(record("e", "c0", 0, PROMPT, [301, END]))
    tree.insert(record("e", "c1", 1, PROMPT + [301, END, TOOL, 401, ASSISTANT], [302, END]))
    (only,) = tree.trajectories()
    assert only.token_ids() == PROMPT + [301, END, TOOL, 401, ASSISTANT, 302, END]
    assert only.kind == "main"
    assert only.num_policy_tokens == 4
    assert tree.num_tokens == len(only.token_ids())


def test_a_diverging_prompt_branches_at_the_first_differing_token() -> None:
    tree = TokenTree("e")
    tree.insert(record("e", "c0", 0, PROMPT, [701, 702, 301, END]))  # with thinking
    # The template dropped the thinking when it echoed the turn back.
    tree.insert(record("e", "c1", 1, PROMPT + [301, END, TOOL, 401, ASSISTANT], [302, END]))
    got = kinds(tree)
    assert set(got) == {
        tuple(PROMPT + [701, 702, 301, END]),
        tuple(PROMPT + [301, END, TOOL, 401, ASSISTANT, 302, END]),
    }
    assert tree.num_tokens == len(PROMPT) + 4 + 7


def test_policy_tokens_remember_call_logprob_and_weight_version() -> None:
    tree = TokenTree("e")
    tree.insert(record("e", "c0", 0, PROMPT, [301, END], logprob=[-0.1, -0.2]))
    tree.insert(record("e", "c1", 1, PROMPT + [301, END, TOOL, 401, ASSISTANT], [302], logprob=-0.3))
    (t,) = tree.trajectories()
    calls = [c for e in t.edges for c in e.calls.tolist()]
    lps = [lp for e in t.edges for lp in e.logprobs.tolist()]
    n = len(PROMPT)
    assert calls[:n] == [-1] * n
    assert [tree.calls[c].call_id for c in calls[n : n + 2]] == ["c0", "c0"]
    assert lps[n : n + 2] == [-0.1, -0.2]
    assert calls[n + 2 : n + 5] == [-1, -1, -1]  # tool result and role marker: context
    assert tree.calls[calls[-1]].call_id == "c1" and lps[-1] == -0.3
    assert tree.calls[calls[-1]].weight_version == 0


def test_a_retried_call_keeps_the_first_calls_logprobs() -> None:
    tree = TokenTree("e")
    tree.insert(record("e", "c0", 0, PROMPT, [301], logprob=-0.25))  # aborted mid-way
    tree.insert(record("e", "c1", 1, PROMPT, [301, 302, END], logprob=-0.75))  # the retry
    (t,) = tree.trajectories()
    assert t.token_ids() == PROMPT + [301, 302, END]
    lps = [lp for e in t.edges for lp in e.logprobs.tolist()]
    assert lps[len(PROMPT):] == [-0.25, -0.75, -0.75]
    assert t.first_call_id == "c1"  # the leaf is where the retry ended


def test_a_context_position_becomes_policy_when_a_later_call_generates_it() -> None:
    tree = TokenTree("e")
    tree.insert(record("e", "c0", 0, PROMPT + [301, END], [302]))
    tree.insert(record("e", "c1", 1, PROMPT, [301], logprob=-0.4))
    (t,) = tree.trajectories()
    mask = [m for e in t.edges for m in e.policy_mask().tolist()]
    assert mask == [0] * len(PROMPT) + [1, 0, 1]


def test_side_calls_and_repeated_call_ids_are_not_inserted() -> None:
    tree = TokenTree("e")
    assert tree.insert(record("e", "c0", 0, PROMPT, [301]))
    assert not tree.insert(record("e", "t", 1, [SYS, 601, USER, 201], [602], lineage="side"))
    assert not tree.insert(record("e", "c0", 0, PROMPT, [301]))
    assert (tree.num_calls, tree.num_side_calls, tree.num_duplicate_calls) == (1, 1, 1)
    assert len(tree.trajectories()) == 1


def test_a_leaf_takes_the_lineage_of_the_calls_ending_there() -> None:
    tree = TokenTree("e")
    main = tree.insert(record("e", "c0", 0, PROMPT, [301, END])) and PROMPT + [301, END]
    tree.insert(record("e", "c1", 1, main + [TOOL, 401, 501, ASSISTANT], [351], lineage="main-summary"))
    tree.insert(record("e", "c2", 2, [SYS, 111, USER, 211], [311], lineage="sub-agent", agent_id="a1"))
    tree.insert(record(
        "e", "c3", 3, [SYS, 111, USER, 211, 311, 501], [352], lineage="sub-agent-summary", agent_id="a1"
    ))
    assert sorted(kinds(tree).values()) == ["main-summary", "sub-agent-summary"]


def test_a_call_ending_inside_an_edge_splits_it() -> None:
    tree = TokenTree("e")
    tree.insert(record("e", "c0", 0, PROMPT + [301, 302, 303], [304]))
    tree.insert(record("e", "c1", 1, PROMPT, [301]))  # a prefix of c0's path
    (t,) = tree.trajectories()
    assert t.first_call_id == "c0"
    assert any(tree.calls[r].call_id == "c1" for e in t.edges for r in e.end_calls)
    assert "<- c1" in tree.dump() and "301*" in tree.dump()


@pytest.mark.parametrize("bad", [-1, 2**31])
def test_token_ids_outside_int32_are_refused(bad: int) -> None:
    tree = TokenTree("e")
    with pytest.raises(ValueError, match="token ids"):
        tree.insert(record("e", "c0", 0, [SYS, bad], [301]))
    assert tree.num_calls == 0


def test_a_call_the_harness_hung_up_on_adds_no_path() -> None:
    tree = TokenTree("e")
    tree.insert(record("e", "c0", 0, PROMPT, [301, END]))
    gone = dataclasses.replace(
        record("e", "c1", 1, PROMPT + [301, END, TOOL, 401, ASSISTANT], []), finish_reason="abort"
    )
    assert tree.insert(gone) is False
    assert (tree.num_calls, tree.num_hung_up_calls) == (1, 1)
    assert [t.token_ids() for t in tree.trajectories()] == [PROMPT + [301, END]]
