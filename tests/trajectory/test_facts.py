"""Per-execution facts (calls by lineage, tokens, tool calls, sub-agents, compactions) counted from
an execution's CallRecords, sent once it is graded and sealed, for train and eval runs alike."""

from __future__ import annotations

import dataclasses

from base.wire import ExecutionFacts
from tests.trajectory import Run, grade, tree_of
from tests.trajectory.test_processor import processor


def branching_run(execution_id: str) -> Run:
    run = Run(execution_id)
    ctx = run.call([1, 2, 3], [10, 11])
    ctx = run.call(ctx + [4], [12])
    run.call([1, 2, 9], [20, 21, 22], lineage="sub-agent", agent_id="a1")
    run.call([1, 2, 8], [30], lineage="sub-agent", agent_id="a2")
    run.call(ctx + [5], [40, 41], lineage="main-summary")
    run.call([7], [50], lineage="side")
    run.records[0] = dataclasses.replace(run.records[0], num_tool_calls=2)
    return run


def test_facts_count_what_the_records_say_once_graded_and_sealed():
    p = processor()
    run = branching_run("g-e0")
    for r in run.records:
        p.on_message(r)
    assert p.take_facts() == []
    p.on_message(grade("g-e0", "g", 1.0, group_size=2))
    assert p.take_facts() == []  # graded, not sealed: more calls may still come
    p.on_message(run.sealed())
    (facts,) = p.take_facts()
    assert facts == ExecutionFacts(
        execution_id="g-e0", num_calls=6, main_calls=2, summary_calls=1, sub_agent_calls=2, side_calls=1,
        hung_up_calls=0, num_sub_agents=2, prompt_tokens=3 + 6 + 3 + 3 + 8 + 1, output_tokens=2 + 1 + 3 + 1 + 2 + 1,
        tool_calls=2, tree_tokens=tree_of(run).num_tokens, call_s_sum=6.0, call_s_max=1.0,
        main_output_tokens=2 + 1 + 2, untrained_output_tokens=1, lineage_reasons={"unknown": 6},
    )
    # merging shared prefixes saved tokens: the tree holds fewer than the calls carried
    assert 0 < facts.tree_tokens < facts.prompt_tokens + facts.output_tokens
    p.on_message(run.sealed())  # a duplicate seal sends nothing again
    assert p.take_facts() == []


def test_eval_runs_get_facts_too():
    p = processor()
    run = Run("eval-0-e0")
    run.call([1, 2], [3])
    p.on_message(grade("eval-0-e0", "eval-0", 0.5, group_size=1, train=False))
    for r in run.records:
        p.on_message(r)
    p.on_message(run.sealed())
    (facts,) = p.take_facts()
    assert (facts.num_calls, facts.main_calls, facts.output_tokens) == (1, 1, 1)


def test_staleness_per_call_is_the_step_trained_minus_the_version_that_sampled():
    p = processor()
    run = Run("g-e0")
    ctx = run.call([1, 2], [3])
    run.call(ctx + [4], [5])
    run.records[0] = dataclasses.replace(run.records[0], weight_version=1)
    run.records[1] = dataclasses.replace(run.records[1], weight_version=3)
    for r in run.records:
        p.on_message(r)
    p.on_message(grade("g-e0", "g", 1.0, group_size=2, step=3))
    p.on_message(run.sealed())
    (facts,) = p.take_facts()
    assert (facts.staleness_mean, facts.staleness_max) == (1.0, 2)


def test_output_left_untrained_by_its_label_is_counted_and_a_mostly_dropped_main_line_warned(caplog):
    """A harness whose main line the proxy labelled ``side`` trains nothing of the main agent's work:
    the facts count those tokens, give the reasons, and the log says so."""
    p = processor()
    run = Run("g-e0")
    run.call([1, 2, 3], [10, 11])
    run.call([5, 6], [12, 13, 14, 15], lineage="side")
    run.call([5, 6, 12, 13, 14, 15, 7], [16, 17, 18], lineage="side")
    run.records[0] = dataclasses.replace(run.records[0], lineage_reason="first")
    run.records[1] = dataclasses.replace(run.records[1], lineage_reason="else")
    run.records[2] = dataclasses.replace(run.records[2], lineage_reason="extends")
    for r in run.records:
        p.on_message(r)
    p.on_message(grade("g-e0", "g", 1.0, group_size=2))
    with caplog.at_level("WARNING", logger="trajectory.processor"):
        p.on_message(run.sealed())
    (facts,) = p.take_facts()
    assert (facts.main_output_tokens, facts.untrained_output_tokens) == (2, 7)
    assert facts.lineage_reasons == {"first": 1, "else": 1, "extends": 1}
    assert p.counters.num_main_mostly_dropped == 1
    assert any("not trained for their label" in m for m in caplog.messages)
    q = processor()  # the other way round: nothing to warn about
    for r in branching_run("g-e1").records:
        q.on_message(r)
    q.on_message(grade("g-e1", "g", 1.0, group_size=2))
    q.on_message(branching_run("g-e1").sealed())
    assert q.counters.num_main_mostly_dropped == 0
