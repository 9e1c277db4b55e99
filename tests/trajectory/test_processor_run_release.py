"""The processor's run release (``algo.release="run"``): shards per execution, before the group.

What it must keep: the data and, once the group's ``GroupDone`` gives ``mean_reward`` and
``adv_divisor``, the advantages are those group release would have sent; an execution goes out
once, before its group's ``GroupDone``, across restarts too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from base.wire import GroupDone, Message, Sequence, Shard, decode, encode
from tests.trajectory import ASSISTANT, END, SYS, TOOL, USER, Run, algo, grade
from tests.trajectory.test_processor import feed, frames_of, group_messages, processor, shards_of
from base.advantages import advantage
from trajectory.delivery import ProcessorService
from trajectory.log import AppendLog, decode_marker
from trajectory.processor import Processor


def run_processor(*, min_usable: int = 1, max_tokens: int = 4096) -> Processor:
    config = dataclasses.replace(algo(max_tokens_per_microstep=max_tokens), release="run")
    return Processor(algo=config, min_usable=min_usable, max_trajectories=5)


def run_service(path: Path) -> ProcessorService:
    return ProcessorService(run_processor(), AppendLog(path / "processor.log", fsync=False))


def branching_group(
    group_id: str, rewards: list[float | None]
) -> tuple[list[Message], list[Message], list[Message]]:
    """(records, seals, grades) of executions that differ and branch: several sequences each."""
    records: list[Message] = []
    seals: list[Message] = []
    grades: list[Message] = []
    for i, reward in enumerate(rewards):
        run = Run(f"{group_id}-e{i}")
        turn = run.call([SYS, 101, USER, 200 + i, ASSISTANT], [301, END])
        run.call(turn + [TOOL, 401, ASSISTANT], [302] * (i + 1) + [END])
        run.call(turn + [TOOL, 401, ASSISTANT], [304, END])  # regenerated: a second main leaf
        run.call([SYS, 111, USER, 211, ASSISTANT], [311, END], lineage="sub-agent", agent_id="a1")
        records += run.records
        seals.append(run.sealed())
        grades.append(grade(run.execution_id, group_id, reward, group_size=len(rewards)))
    return records, seals, grades


def group_done(out: list[Message]) -> GroupDone:
    (done,) = [m for m in out if isinstance(m, GroupDone)]
    return done


def executions_of(out: list[Message]) -> list[str]:
    return [s.sequences[0].execution_id for s in shards_of(out)]


@pytest.mark.parametrize("grade_first", [True, False])
def test_an_execution_goes_out_at_grade_and_seal_before_its_group(grade_first: bool) -> None:
    records, seals, grades = group_messages("g", [1.0, 0.0, 0.5], step=3)
    p = run_processor()
    assert feed(p, records) == []
    first, second = (grades[0], seals[0]) if grade_first else (seals[0], grades[0])
    assert p.on_message(first) == []
    out = p.on_message(second)
    (shard,) = shards_of(out)
    assert len(out) == 1 and p.num_open_groups == 1  # the group is still open: no GroupDone
    assert (shard.shard_id, shard.step, shard.num_executions) == ("g/g-e0", 3, 1)
    assert (shard.group_id, shard.reward, shard.run_released) == ("g", 1.0, True)
    assert {s.execution_id for s in shard.sequences} == {"g-e0"}
    assert all(s.advantage == 0.0 for s in shard.sequences)
    assert decode(encode(out[0])) == out[0]
    assert p.num_open_executions == 2  # g-e0's tree is freed

    rest = feed(p, grades[1:2] + seals[1:2])
    assert executions_of(rest) == ["g-e1"] and not any(isinstance(m, GroupDone) for m in rest)
    last = feed(p, [grades[2], seals[2]])
    assert executions_of(last) == ["g-e2"]
    assert isinstance(last[-1], GroupDone) and last[-1].mean_reward == 0.5 and last[-1].adv_divisor > 0
    c = p.counters
    assert (c.num_executions_released, c.num_groups_emitted, c.num_shards) == (3, 1, 3)
    assert p.num_open_groups == 0 and p.num_open_executions == 0


def test_a_big_execution_is_split_under_its_own_name() -> None:
    records, seals, grades = branching_group("g", [1.0, 0.0])
    out = feed(run_processor(max_tokens=20), records + seals + grades[:1])
    shards = shards_of(out)
    assert [s.shard_id for s in shards] == ["g/g-e0/0", "g/g-e0/1"]
    assert [s.num_executions for s in shards] == [1, 0]
    assert all(decode(encode(m)) == m for m in out)  # Shard.check: one execution, advantage 0


def by_execution(sequences: list[Sequence]) -> list[Sequence]:
    return sorted(sequences, key=lambda s: s.execution_id)  # stable: keeps each execution's order


def with_advantages(shards: list[Shard], done: GroupDone) -> list[Sequence]:
    assert done.mean_reward is not None
    return [
        dataclasses.replace(s, advantage=advantage(shard.reward, done.mean_reward, done.adv_divisor))
        for shard in shards if shard.reward is not None
        for s in shard.sequences
    ]


def test_advantages_from_group_done_give_exactly_what_group_release_sends() -> None:
    records, seals, grades = branching_group("g", [1.0, 0.0, 0.25, None, 0.7])
    group_out = feed(processor(), records + seals + grades)
    run_out = feed(run_processor(), records + seals + grades)
    expected = by_execution([s for shard in shards_of(group_out) for s in shard.sequences])
    assert len({s.advantage for s in expected}) == 4  # distinct rewards, distinct advantages
    assert len(expected) == 12  # three sequences per usable execution
    assert by_execution(with_advantages(shards_of(run_out), group_done(run_out))) == expected
    assert group_done(run_out) == group_done(group_out)  # same mean_reward and adv_divisor


def test_equal_rewards_give_a_zero_divisor() -> None:
    records, seals, grades = group_messages("g", [0.5, 0.5, 0.5])
    out = feed(run_processor(), records + grades + seals)
    assert executions_of(out) == ["g-e0", "g-e1", "g-e2"]
    assert out[-1] == GroupDone(group_id="g", step=0, num_usable=3, mean_reward=0.5, adv_divisor=0.0)


def test_crashed_and_failed_executions_send_nothing_and_a_thin_group_is_dropped() -> None:
    records, seals, grades = group_messages(
        "g", [1.0, None, 0.0], outcomes=["finished", "finished", "crashed"], step=2
    )
    # e2 crashed before any call was answered: none of the policy's doing, so excluded.
    records = [r for r in records if r.execution_id != "g-e2"]
    seals = [dataclasses.replace(s, num_calls=0) if s.execution_id == "g-e2" else s for s in seals]
    p = run_processor(min_usable=2)
    out = feed(p, records + seals + grades)
    assert executions_of(out) == ["g-e0"]  # went out before the group was known to be thin
    assert out[-1] == GroupDone(group_id="g", step=2, num_usable=1, mean_reward=1.0, dropped="too_few_usable")
    c = p.counters
    assert (c.num_excluded_crashed, c.num_excluded_grade_failed, c.num_groups_dropped) == (1, 1, 1)
    assert c.num_groups_emitted == 0 and p.num_open_executions == 0


def test_an_execution_without_targets_sends_nothing_but_counts_in_its_group() -> None:
    records, seals, grades = group_messages("g", [1.0, 0.0])
    p = run_processor()
    seals[1] = dataclasses.replace(seals[1], num_calls=0)  # e1 made no call (a cut run would be excluded)
    out = feed(p, [r for r in records if r.execution_id == "g-e0"] + seals + grades)
    assert executions_of(out) == ["g-e0"]
    assert group_done(out).num_usable == 2 and p.counters.num_empty_executions == 1


def test_records_after_the_release_are_late_and_change_nothing() -> None:
    records, seals, grades = group_messages("g", [1.0, 0.0])
    reference = feed(run_processor(), records + seals + grades)
    p = run_processor()
    e0 = [r for r in records if r.execution_id == "g-e0"]
    released = feed(p, records + seals[:1] + grades[:1])
    extra = dataclasses.replace(e0[-1], call_id="g-e0/late", call_index=9)  # a call nobody waited for
    assert feed(p, e0 + [extra] + seals[:1]) == []
    assert p.counters.num_late_records == len(e0) + 2
    assert released + feed(p, seals[1:] + grades[1:]) == reference


# ---------------------------------------------------------------------- restarts


def test_a_restart_resends_only_what_was_not_marked(tmp_path: Path) -> None:
    records, seals, grades = group_messages("g", [1.0, 0.0, 0.5])
    reference = feed(run_processor(), records + seals + grades)

    first = run_service(tmp_path)
    assert first.replay() == []
    sent = first.on_record_frames(frames_of(records + seals[:2]))
    sent += first.on_control_frames(frames_of(grades[:1]))
    assert executions_of(sent) == ["g-e0"]
    first.mark_delivered(sent)
    unsent = first.on_control_frames(frames_of(grades[1:2]))
    assert executions_of(unsent) == ["g-e1"]
    first.log.close()  # killed before g-e1's marker: it never went out

    second = run_service(tmp_path)
    owed = second.replay()
    assert owed == unsent
    assert second.counters.num_executions_replayed == 1  # g-e0: not even rebuilt
    second.mark_delivered(owed)
    # The controller resends its grades, the proxy its records and seals: all ignored.
    assert second.on_control_frames(frames_of(grades[:2])) == []
    assert second.on_record_frames(frames_of(records + seals[:2])) == []
    last = second.on_record_frames(frames_of(seals[2:])) + second.on_control_frames(frames_of(grades[2:]))
    assert last == reference[-len(last):] and executions_of(last) == ["g-e2"]
    assert group_done(last) == group_done(reference)  # once, and as without the restart
    second.mark_delivered(last)
    second.log.close()

    third = run_service(tmp_path)
    assert third.replay() == []
    assert (third.counters.num_executions_replayed, third.counters.num_groups_replayed) == (3, 1)


def test_a_group_completed_in_the_log_sends_its_unmarked_part_only(tmp_path: Path) -> None:
    records, seals, grades = group_messages("g", [1.0, 0.0, 0.5])
    first = run_service(tmp_path)
    first.replay()
    out = first.on_record_frames(frames_of(records + seals)) + first.on_control_frames(frames_of(grades))
    assert executions_of(out) == ["g-e0", "g-e1", "g-e2"] and isinstance(out[-1], GroupDone)
    first.mark_delivered(out[:2])  # killed after marking g-e0 and g-e1, before g-e2 and the GroupDone
    first.log.close()

    second = run_service(tmp_path)
    owed = second.replay()
    assert owed == out[2:]  # g-e2's shard, then the GroupDone: never g-e0 or g-e1 again
    second.mark_delivered(owed)
    second.log.close()
    assert run_service(tmp_path).replay() == []


def test_a_split_execution_logs_one_marker(tmp_path: Path) -> None:
    records, seals, grades = branching_group("g", [1.0, 0.0])
    svc = ProcessorService(run_processor(max_tokens=20), AppendLog(tmp_path / "p.log", fsync=False))
    svc.replay()
    out = svc.on_record_frames(frames_of(records + seals)) + svc.on_control_frames(frames_of(grades))
    assert len(shards_of(out)) == 4  # two per execution
    svc.mark_delivered(out)
    markers = [m for m in map(decode_marker, svc.log.scan()) if m is not None]
    assert [(m.kind, m.fields) for m in markers] == [
        ("execution_sent", {"execution_id": "g-e0"}),
        ("execution_sent", {"execution_id": "g-e1"}),
        ("group_done", {"group_id": "g"}),
    ]
