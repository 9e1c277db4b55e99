"""The processor state machine and its service: grading rules, groups, bad frames, restarts."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from base.wire import (
    Delivered,
    ErrorReply,
    ExecutionSealed,
    Grade,
    GroupDone,
    Message,
    Shard,
    ShardReady,
    Shutdown,
    encode,
)
from tests.trajectory import ASSISTANT, END, SYS, TOOL, USER, Run, algo, grade
from trajectory.delivery import ProcessorService
from trajectory.log import AppendLog
from trajectory.processor import Processor


def make_run(execution_id: str, *, turns: int = 2) -> Run:
    run = Run(execution_id)
    path = run.call([SYS, 101, USER, 201, ASSISTANT], [301, END])
    for t in range(1, turns):
        path = run.call(path + [TOOL, 400 + t, ASSISTANT], [301 + t, END])
    return run


def processor(*, min_usable: int = 1, max_tokens: int = 4096) -> Processor:
    return Processor(algo=algo(max_tokens_per_microstep=max_tokens), min_usable=min_usable, max_trajectories=5)


def feed(p: Processor, messages: list[Message]) -> list[Message]:
    out: list[Message] = []
    for m in messages:
        out.extend(p.on_message(m))
    return out


def shards_of(out: list[Message]) -> list[Shard]:
    return [m.shard for m in out if isinstance(m, ShardReady)]


def group_messages(
    group_id: str, rewards: list[float | None], *, outcomes: list[str] | None = None, step: int = 0
) -> tuple[list[Message], list[Message], list[Grade]]:
    """(records, seals, grades) of one group, one 2-turn execution per reward."""
    records: list[Message] = []
    seals: list[Message] = []
    grades = []
    for i, reward in enumerate(rewards):
        run = make_run(f"{group_id}-e{i}")
        records += run.records
        seals.append(run.sealed())
        outcome = outcomes[i] if outcomes else "finished"
        grades.append(grade(run.execution_id, group_id, reward, group_size=len(rewards), step=step, outcome=outcome))
    return records, seals, grades


@pytest.mark.parametrize("order", ["grades_first", "seals_first", "interleaved"])
def test_a_group_completes_only_with_every_grade_and_seal(order: str) -> None:
    records, seals, grades = group_messages("g", [1.0, 0.0, 0.5])
    if order == "grades_first":
        stream = records[:2] + grades + records[2:] + seals
    elif order == "seals_first":
        stream = records + seals + grades
    else:
        stream = records + [x for pair in zip(grades, seals) for x in pair]
    p = processor()
    for m in stream[:-1]:
        assert p.on_message(m) == []
    out = p.on_message(stream[-1])
    (shard,) = shards_of(out)
    assert (shard.shard_id, shard.step, shard.num_executions) == ("g", 0, 3)
    assert out[-1] == GroupDone(group_id="g", step=0, num_usable=3, mean_reward=0.5, adv_divisor=pytest.approx(math.sqrt(1 / 6) + 1e-6))
    adv = {s.execution_id: s.advantage for s in shard.sequences}
    assert adv["g-e0"] > 0 > adv["g-e1"] and adv["g-e2"] == 0.0
    assert p.num_open_groups == 0 and p.num_open_executions == 0


def test_grader_failure_and_a_crash_before_any_call_are_excluded_not_zero() -> None:
    records, seals, grades = group_messages(
        "g", [1.0, 0.5, None, 0.0], outcomes=["finished", "timed_out", "finished", "crashed"]
    )
    # e3 crashed before the policy was ever answered: no record, a seal of 0 calls.
    records = [r for r in records if r.execution_id != "g-e3"]
    seals = [dataclasses.replace(s, num_calls=0) if s.execution_id == "g-e3" else s for s in seals]
    p = processor(min_usable=2)
    out = feed(p, records + seals + grades)
    (shard,) = shards_of(out)
    assert shard.num_executions == 2
    assert {s.execution_id for s in shard.sequences} == {"g-e0", "g-e1"}
    adv = {s.execution_id: s.advantage for s in shard.sequences}
    # Over the usable rewards [1.0, 0.5] only: +-1. Had the failure counted as 0, e1 would be > 0.
    assert adv["g-e0"] == pytest.approx(1.0, abs=1e-4) and adv["g-e1"] == pytest.approx(-1.0, abs=1e-4)
    assert out[-1] == GroupDone(group_id="g", step=0, num_usable=2, mean_reward=0.75, adv_divisor=pytest.approx(0.25 + 1e-6))
    assert (p.counters.num_excluded_grade_failed, p.counters.num_excluded_crashed) == (1, 1)


def test_a_crash_after_the_policy_acted_is_graded_like_any_end() -> None:
    """A harness killed from inside (``pkill``, a fork bomb) is the agent's doing: its 0 stands, so a
    crash is never a way out of a penalty."""
    records, seals, grades = group_messages("g", [1.0, 0.0], outcomes=["finished", "crashed"])
    p = processor(min_usable=2)
    out = feed(p, records + seals + grades)
    (shard,) = shards_of(out)
    adv = {s.execution_id: s.advantage for s in shard.sequences}
    assert adv["g-e0"] > 0 > adv["g-e1"]
    assert p.counters.num_excluded_crashed == 0


def test_a_group_with_too_few_usable_executions_is_dropped() -> None:
    records, seals, grades = group_messages("g", [1.0, None, None], step=4)
    p = processor(min_usable=2)
    out = feed(p, records + grades + seals)
    assert out == [GroupDone(group_id="g", step=4, num_usable=1, mean_reward=1.0, dropped="too_few_usable")]
    assert p.counters.num_groups_dropped == 1 and p.counters.num_groups_emitted == 0


def test_an_eval_execution_is_discarded_and_joins_no_group() -> None:
    run = make_run("eval-1")
    p = processor()
    assert feed(p, run.records[:1] + [grade("eval-1", "eval", 1.0, group_size=1, train=False)]) == []
    assert feed(p, run.records[1:] + [run.sealed()] + run.records) == []
    assert p.num_open_executions == 0 and p.num_open_groups == 0
    assert p.counters.num_eval_executions == 1


def test_an_execution_without_calls_is_counted_in_num_executions() -> None:
    run = make_run("g-e0")
    p = processor()
    out = feed(p, run.records + [run.sealed(), ExecutionSealed(execution_id="g-e1", num_calls=0)] + [
        grade("g-e0", "g", 1.0, group_size=2), grade("g-e1", "g", 0.0, group_size=2),
    ])
    (shard,) = shards_of(out)
    assert shard.num_executions == 2
    assert {s.execution_id for s in shard.sequences} == {"g-e0"}
    assert p.counters.num_empty_executions == 1


def test_a_big_group_is_split_into_named_shards() -> None:
    records, seals, grades = group_messages("g", [1.0, 0.0, 0.5])
    out = feed(processor(max_tokens=20), records + seals + grades)
    shards = shards_of(out)
    assert [s.shard_id for s in shards] == ["g/0", "g/1", "g/2"]
    assert sum(s.num_executions for s in shards) == 3
    assert isinstance(out[-1], GroupDone) and out[-1].num_usable == 3


def test_resent_records_and_grades_are_ignored_and_a_conflicting_grade_refused() -> None:
    records, seals, grades = group_messages("g", [1.0, 0.0])
    p = processor()
    assert feed(p, records + records + grades[:1] + grades[:1] + seals[:1] + seals[:1]) == []
    (err,) = p.on_grade(grade("g-e0", "g", 0.25, group_size=2))
    assert isinstance(err, ErrorReply) and "different grade" in err.message
    (err,) = p.on_grade(grade("g-e1", "g", 0.0, group_size=3))
    assert isinstance(err, ErrorReply) and "group_size=2" in err.message
    out = feed(p, grades[1:] + seals[1:])
    assert len(shards_of(out)) == 1
    assert feed(p, records + grades + seals) == []  # after the group is done: late, ignored
    c = p.counters
    assert (c.num_duplicate_records, c.num_duplicate_grades, c.num_rejected) == (len(records) + 1, 3, 2)


@settings(max_examples=30, deadline=None)
@given(st.randoms(use_true_random=False))
def test_the_result_does_not_depend_on_cross_socket_order(rng) -> None:  # noqa: ANN001
    records, seals, grades = group_messages("g", [1.0, 0.0, 0.25, None])
    reference = feed(processor(), records + seals + grades)
    # Records then the seal keep their order per execution (one PUSH socket); grades go anywhere.
    per_exec = [[r for r in records if r.execution_id == s.execution_id] + [s] for s in seals]
    streams = [list(x) for x in per_exec] + [[g] for g in grades]
    merged: list[Message] = []
    while any(streams):
        pick = rng.choice([s for s in streams if s])
        merged.append(pick.pop(0))
    assert feed(processor(), merged) == reference


# ---------------------------------------------------------------------- the service: frames and log


def service(path: Path, *, min_usable: int = 1) -> ProcessorService:
    return ProcessorService(processor(min_usable=min_usable), AppendLog(path / "processor.log", fsync=False))


def test_malformed_frames_are_rejected_counted_and_answered_on_the_control_socket(tmp_path: Path) -> None:
    svc = service(tmp_path)
    svc.replay()
    run = make_run("g-e0", turns=1)
    bad_records = [b"\x00garbage", encode(grade("x", "g", 1.0, group_size=1)), b""]
    assert svc.on_record_frames(bad_records + [encode(r) for r in run.records]) == []
    out = svc.on_control_frames([b"\x93\x01", encode(run.records[0])])
    assert [type(m) for m in out] == [ErrorReply, ErrorReply]
    assert "not expected here" in out[1].message
    assert svc.counters.num_rejected == 5
    out = svc.on_record_frames([encode(run.sealed())]) + svc.on_control_frames(
        [encode(grade("g-e0", "g", 1.0, group_size=1))]
    )
    assert len(shards_of(out)) == 1  # still working


def test_a_shutdown_frame_is_noticed_not_logged(tmp_path: Path) -> None:
    svc = service(tmp_path)
    svc.replay()
    assert svc.on_control_frames([encode(Shutdown(reason="done"))]) == []
    assert svc.shutdown_requested and svc.log.num_entries == 0


def frames_of(messages: list[Message]) -> list[bytes]:
    return [encode(m) for m in messages]


def test_after_a_restart_emitted_groups_are_not_sent_again(tmp_path: Path) -> None:
    r1, s1, g1 = group_messages("g1", [1.0, 0.0])
    r2, s2, g2 = group_messages("g2", [0.0, 1.0])
    reference = feed(processor(), r1 + s1 + g1) + feed(processor(), r2 + s2 + g2)

    first = service(tmp_path)
    assert first.replay() == []
    sent = first.on_record_frames(frames_of(r1 + s1 + r2[:3])) + first.on_control_frames(frames_of(g1 + g2))
    first.mark_delivered(sent)
    assert shards_of(sent) == shards_of(reference)[:1]
    first.log.close()  # the process dies here

    second = service(tmp_path)
    assert second.replay() == []  # g1 went out before the crash: not owed, not even rebuilt
    assert (second.counters.num_groups_replayed, second.counters.num_groups_emitted) == (1, 0)
    # The controller resends g2's grades and the proxy resends g2's records: duplicates, ignored.
    out = second.on_control_frames(frames_of(g1 + g2)) + second.on_record_frames(frames_of(r2 + s2))
    assert out == reference[len(sent):]
    assert second.counters.num_duplicate_grades == 4


def test_a_group_completed_but_not_marked_is_sent_after_a_restart(tmp_path: Path) -> None:
    r, s, g = group_messages("g", [1.0, 0.0])
    first = service(tmp_path)
    first.replay()
    sent = first.on_record_frames(frames_of(r + s)) + first.on_control_frames(frames_of(g))
    assert len(shards_of(sent)) == 1
    first.log.close()  # killed after processing, before the marker: nothing went out
    second = service(tmp_path)
    owed = second.replay()
    assert owed == sent
    second.mark_delivered(owed)
    second.log.close()
    assert service(tmp_path).replay() == []


def test_a_group_stays_owed_until_the_controller_has_every_message(tmp_path: Path) -> None:
    r, s, g = group_messages("g", [1.0, 0.0])
    first = service(tmp_path)
    first.replay()
    sent = first.on_record_frames(frames_of(r + s)) + first.on_control_frames(frames_of(g))
    first.sending(sent, now=100.0)
    shards = shards_of(sent)
    assert len(shards) >= 1 and isinstance(sent[-1], GroupDone)
    assert first.due_resends(105.0, after_s=10.0) == []
    assert first.due_resends(111.0, after_s=10.0) == sent  # no Delivered in time: all of it again
    # The controller took the shards but not (yet) the GroupDone: still owed, even after a restart.
    first.on_control_frames(frames_of([Delivered(shard_ids=[x.shard_id for x in shards])]))
    assert first.due_resends(200.0, after_s=10.0) == [sent[-1]]
    first.log.close()
    second = service(tmp_path)
    assert second.replay() == sent  # the controller drops the shards it has, by id
    second.sending(sent)
    second.on_control_frames(frames_of([Delivered(shard_ids=[x.shard_id for x in shards], group_ids=["g"]),
                                        Delivered(group_ids=["g", "unknown"])]))  # acks twice: harmless
    assert second.owed == {}
    second.log.close()
    assert service(tmp_path).replay() == []  # delivered: never sent again


def test_a_torn_log_tail_loses_only_the_unacknowledged_frame(tmp_path: Path) -> None:
    r, s, g = group_messages("g", [1.0, 0.0])
    first = service(tmp_path)
    first.replay()
    first.on_record_frames(frames_of(r + s))
    first.log.close()
    path = tmp_path / "processor.log"
    path.write_bytes(path.read_bytes()[:-3])  # the last seal was being written
    second = service(tmp_path)
    assert second.replay() == []
    assert second.log.num_truncated_bytes > 0
    out = second.on_control_frames(frames_of(g)) + second.on_record_frames(frames_of(s))
    assert out == feed(processor(), r + s + g)


def test_every_interleaving_of_two_executions_gives_the_same_messages() -> None:
    records, seals, grades = group_messages("g", [1.0, 0.0])
    reference = feed(processor(), records + seals + grades)
    for perm in itertools.permutations(grades + seals[1:]):
        assert feed(processor(), records + seals[:1] + list(perm)) == reference


@pytest.mark.parametrize("release", ["group", "run"])
def test_a_cut_execution_is_excluded_not_trained_with_the_whole_runs_reward(release: str) -> None:
    records, seals, grades = group_messages("g", [1.0, 0.5, 0.0])
    # e0 lost its last record on the way (the proxy recorded 2 calls; 1 arrived)
    records = [r for r in records if r.call_id != "g-e0/c1"]
    p = Processor(algo=dataclasses.replace(algo(), release=release), min_usable=2, max_trajectories=5)
    out = feed(p, records + seals + grades)
    trained = {s.execution_id for sh in shards_of(out) for s in sh.sequences}
    assert "g-e0" not in trained and trained == {"g-e1", "g-e2"}
    done = out[-1]
    assert isinstance(done, GroupDone) and done.num_usable == 2 and done.mean_reward == pytest.approx(0.25)
    assert (p.counters.num_incomplete_executions, p.counters.num_excluded_cut) == (1, 1)


def test_a_record_the_tree_refuses_cuts_its_execution() -> None:
    records, seals, grades = group_messages("g", [1.0, 0.5, 0.0])
    # a token id past 2**31 - 1 (a corrupt record the wire types let through): the tree refuses it
    records = [dataclasses.replace(r, output_ids=[2**40] * len(r.output_ids)) if r.call_id == "g-e1/c1" else r
               for r in records]
    p = processor(min_usable=2)
    out = feed(p, records + seals + grades)
    trained = {s.execution_id for sh in shards_of(out) for s in sh.sequences}
    assert p.counters.num_rejected == 1
    assert trained == {"g-e0", "g-e2"} and p.counters.num_excluded_cut == 1
