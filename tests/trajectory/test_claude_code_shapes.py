"""Executions shaped like Claude Code runs (notes/harness-claude-code.md §5, §8).

One execution: a main chain with tool turns that spawns two foreground sub-agents, a main call
that was aborted and retried, an auto-compaction (a summary call branching off the main chain,
then a new root with the summary), and a title side call.
"""

from __future__ import annotations

import math

import pytest

from tests.trajectory import ASSISTANT, END, SYS, TOOL, USER, Run, tree_of
from trajectory.samples import build_sequences
from trajectory.sampling import select

MAIN_SYSTEM = [SYS, 101, 102, 103]       # system blocks + tools, billing suffix 103
MAIN_SYSTEM_AFTER = [SYS, 101, 102, 104]  # the billing suffix changes after compaction
SUB_SYSTEM = [SYS, 111, 112]             # the sub-agents' own system and tools
COMPACT_ASK = [501, 502]                  # "CRITICAL: Respond with TEXT ONLY..." appended block


def claude_code_run() -> Run:
    run = Run("cc")
    main = run.call(MAIN_SYSTEM + [USER, 201, 202, ASSISTANT], [301, 302, END])  # two Agent tool_uses
    sub_a = run.call(SUB_SYSTEM + [USER, 211, ASSISTANT], [311, END], lineage="sub-agent", agent_id="a1")
    run.call(sub_a + [TOOL, 411, ASSISTANT], [312, 313, END], lineage="sub-agent", agent_id="a1")
    sub_b = run.call(SUB_SYSTEM + [USER, 221, ASSISTANT], [321, END], lineage="sub-agent", agent_id="a2")
    run.call(sub_b + [TOOL, 421, ASSISTANT], [322, END], lineage="sub-agent", agent_id="a2")
    after_agents = main + [TOOL, 401, 402, ASSISTANT]  # both hand-back tool_results
    run.call(after_agents, [303], logprob=-0.25)          # aborted mid-stream (cell switched)
    main = run.call(after_agents, [303, 304, END], logprob=-0.75)  # the retry
    main = run.call(main + [TOOL, 403, ASSISTANT], [305, END])
    # Auto-compaction: the summary instruction is appended to the last user (tool_result) message.
    run.call(main + [TOOL, 404] + COMPACT_ASK + [ASSISTANT], [351, 352, END], lineage="main-summary")
    run.call([SYS, 121, USER, 201, ASSISTANT], [601, END], lineage="side")  # session title
    # New root: continued-session summary, then the last assistant turn and its tool results verbatim.
    post = MAIN_SYSTEM_AFTER + [USER, 203, 305, END, TOOL, 404, ASSISTANT]
    main = run.call(post, [306, END])
    run.call(main + [TOOL, 405, ASSISTANT], [307, END])
    return run


def test_kinds_and_counts() -> None:
    tree = tree_of(claude_code_run())
    trajectories = tree.trajectories()
    assert sorted(t.kind for t in trajectories) == ["main", "main-summary", "sub-agent", "sub-agent"]
    assert (tree.num_calls, tree.num_side_calls) == (11, 1)
    by_kind = {t.kind: t for t in trajectories}
    # The summary branch carries the pre-compaction main chain (3 + 3 + 2 policy) and the summary (3).
    assert by_kind["main-summary"].num_policy_tokens == 3 + 3 + 2 + 3
    assert by_kind["main"].num_policy_tokens == 4
    assert sorted(t.num_policy_tokens for t in trajectories if t.kind == "sub-agent") == [4, 5]


def test_all_kept_with_k5_each_policy_token_once() -> None:
    kept = select(tree_of(claude_code_run()).trajectories(), max_trajectories=5)
    assert [t.kind for t in kept] == ["main", "main-summary", "sub-agent", "sub-agent"]
    seqs = build_sequences("cc", kept, advantage=1.0)
    assert len(seqs) == 4
    num_targets = sum(sum(s.target_mask) for s in seqs)
    assert num_targets == 4 + 11 + 5 + 4
    assert math.isclose(sum(s.token_weight * sum(s.target_mask) for s in seqs), 1.0)
    summary = seqs[1]
    # The verbatim re-sent turn (305, END) after the new root is context; here it is policy.
    assert seqs[0].target_mask[seqs[0].tokens.index(305)] == 0
    assert summary.target_mask[summary.tokens.index(305)] == 1
    # The retried call: its first token keeps the aborted call's logprob.
    i = summary.tokens.index(303)
    assert summary.behaviour_logprobs[i : i + 3] == [-0.25, -0.75, -0.75]
    # The appended compaction instruction and tool results are never targets.
    for s in seqs:
        for tok, m in zip(s.tokens, s.target_mask):
            if m:
                assert 300 <= tok < 400 or tok == END


@pytest.mark.parametrize(
    "k, kinds, num_targets",
    [(1, ["main"], 4), (2, ["main", "main-summary"], 15), (3, ["main", "main-summary", "sub-agent"], 20)],
)
def test_bounded_to_k(k: int, kinds: list[str], num_targets: int) -> None:
    kept = select(tree_of(claude_code_run()).trajectories(), max_trajectories=k)
    assert [t.kind for t in kept] == kinds
    seqs = build_sequences("cc", kept, advantage=1.0)
    assert sum(sum(s.target_mask) for s in seqs) == num_targets
    assert all(s.token_weight == 1 / num_targets for s in seqs)


def test_thinking_dropped_by_the_template_branches_each_turn() -> None:
    run = Run("think")
    prompt = MAIN_SYSTEM + [USER, 201, ASSISTANT]
    run.call(prompt, [701, 702, 301, END])  # <think>..</think> then a tool_use
    echoed = prompt + [301, END, TOOL, 401, ASSISTANT]  # history without the thinking
    run.call(echoed, [703, 302, END])
    trajectories = tree_of(run).trajectories()
    assert [t.kind for t in trajectories] == ["main", "main"]
    seqs = build_sequences("think", select(trajectories, max_trajectories=5), advantage=1.0)
    # The echoed 301 END is context on the second branch: the policy made them on the first.
    assert sum(sum(s.target_mask) for s in seqs) == 4 + 3


def test_fork_sub_agent_is_its_own_trajectory() -> None:
    """A fork shares the parent's system[2], tools and first messages, but system[0] (the billing
    block, first in the prompt) says cc_is_subagent, and the parent's turn is copied without text."""
    run = Run("fork")
    main = run.call(MAIN_SYSTEM + [USER, 201, ASSISTANT], [330, 331, END])  # text 330 + Agent(fork) 331
    fork_prompt = [SYS, 105, 102, 103, USER, 201, ASSISTANT, 331, END, TOOL, 430, 431, ASSISTANT]
    run.call(fork_prompt, [340, 341, END], lineage="sub-agent", agent_id="f1")
    run.call(main + [TOOL, 432, ASSISTANT], [332, END])
    kept = select(tree_of(run).trajectories(), max_trajectories=5)
    assert [t.kind for t in kept] == ["main", "sub-agent"]
    seqs = build_sequences("fork", kept, advantage=1.0)
    fork = seqs[1]
    # The copied parent turn (331, END) is context in the fork; only the fork's own output is trained.
    assert [t for t, m in zip(fork.tokens, fork.target_mask) if m] == [340, 341, END]
    assert sum(sum(s.target_mask) for s in seqs) == 3 + 2 + 3


@pytest.mark.parametrize("spliced", [True, False])
def test_reserialised_tool_input(spliced: bool) -> None:
    """Claude Code echoes a Write tool_use with its input keys reordered (notes §8). When the proxy
    splices the engine's own ids the history is append-only and the tree stays one chain; a
    re-tokenised echo diverges and branches, yet every policy token is still trained once."""
    run = Run("reser")
    first = run.call(MAIN_SYSTEM + [USER, 201, ASSISTANT], [360, 361, 362, END])  # {content, file_path}
    echoed = first if spliced else MAIN_SYSTEM + [USER, 201, ASSISTANT, 360, 362, 361, END]  # {file_path, content}
    run.call(echoed + [TOOL, 440, ASSISTANT], [363, END])
    trajectories = tree_of(run).trajectories()
    assert len(trajectories) == (1 if spliced else 2)
    seqs = build_sequences("reser", select(trajectories, max_trajectories=5), advantage=1.0)
    targets = sorted(t for s in seqs for t, m in zip(s.tokens, s.target_mask) if m)
    assert targets == sorted([360, 361, 362, END, 363, END])
