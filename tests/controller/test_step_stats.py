"""A step's figures for the loggers: advantages per trained execution (run-released ones from their
group's statistics), clip fraction and KL from microsteps, tokens and staleness from facts."""

from __future__ import annotations

import pytest

from controller.step_stats import StepFigures, execution_advantages
from controller.steps import StepState
from base.wire import ExecutionFacts, GroupStats, MicrostepDone, Sequence, Shard


def seq(eid: str, adv: float) -> Sequence:
    return Sequence(execution_id=eid, tokens=[1, 2, 3], target_mask=[0, 1, 1], behaviour_logprobs=[0.0, -0.5, -0.5],
                    advantage=adv, token_weight=0.5)


def facts(eid: str, *, prompt: int, output: int, tree: int, calls: int, stale: float, stale_max: int) -> ExecutionFacts:
    return ExecutionFacts(execution_id=eid, num_calls=calls, main_calls=calls, summary_calls=0, sub_agent_calls=0,
                          side_calls=0, hung_up_calls=0, num_sub_agents=0, prompt_tokens=prompt, output_tokens=output,
                          tool_calls=0, tree_tokens=tree, call_s_sum=0.5 * calls, call_s_max=0.9,
                          staleness_mean=stale, staleness_max=stale_max)


def test_advantages_one_per_execution_run_released_from_group_stats():
    st = StepState(step=0, groups_expected=2)
    st.groups["g0"] = GroupStats(group_id="g0", mean_reward=0.5, adv_divisor=0.25)
    st.groups["g1"] = GroupStats(group_id="g1", mean_reward=0.0, adv_divisor=0.0, dropped=True)
    st.done_by_cell[0] = [
        Shard(step=0, shard_id="s0", num_executions=1, sequences=[seq("a", 1.5), seq("a", 1.5)]),  # 2 trajectories, 1 run
        Shard(step=0, shard_id="s1", num_executions=1, sequences=[seq("b", 0.0)], group_id="g0", reward=1.0),
        Shard(step=0, shard_id="s2", num_executions=1, sequences=[seq("c", 0.0)], group_id="g1", reward=1.0),
    ]
    assert sorted(execution_advantages(st)) == [1.5, 2.0]  # (1.0 - 0.5) / 0.25; the dropped group's run left out


def test_figures_of_a_step():
    fig = StepFigures()
    for clip, kl, n in ((0.5, 0.02, 10), (0.0, 0.04, 30)):
        fig.on_microstep(MicrostepDone(cell_id=0, step=1, shard_id="x", num_tokens=n, loss=0.1, fb_s=0.1,
                                       mean_ratio=1.0, clip_fraction=clip, kl=kl))
    fig.on_facts(1, facts("a", prompt=100, output=10, tree=60, calls=2, stale=1.0, stale_max=1))
    fig.on_facts(1, facts("b", prompt=50, output=5, tree=40, calls=1, stale=0.0, stale_max=0))
    st = StepState(step=1, groups_expected=1)
    st.done_by_cell[0] = [Shard(step=1, shard_id="s", num_executions=2, sequences=[seq("a", 1.0), seq("b", -1.0)])]
    out = fig.figures(1, st)
    assert out["clip_fraction"] == pytest.approx(0.25)
    assert out["kl"] == pytest.approx((0.02 * 10 + 0.04 * 30) / 40)  # per token, not per microstep
    assert (out["prompt_tokens"], out["output_tokens"], out["dedup_saved_tokens"]) == (150, 15, 65)
    assert out["staleness_mean"] == pytest.approx(2 / 3) and out["staleness_max"] == 1
    assert out["call_s_mean"] == pytest.approx(0.5)
    assert (out["adv_mean"], out["adv_std"], out["adv_zero_fraction"]) == (0.0, 1.0, 0.0)
    # the sums are gone once read: a second read of the step is empty, not double-counted
    assert fig.figures(1, StepState(step=1, groups_expected=1))["prompt_tokens"] == 0


def test_a_step_without_microsteps_or_facts_has_none_not_zero():
    out = StepFigures().figures(0, StepState(step=0, groups_expected=0))
    assert out["clip_fraction"] is None and out["kl"] is None and out["adv_mean"] is None
