"""bench.soak: its checks on made-up event streams (each can fail), and one short live soak of the
real embedded default with kills every few seconds, whose invariants must hold."""

from __future__ import annotations

import pytest

from bench import soak


def step(v: int, trainers=(0,)) -> dict:
    return {"kind": "step", "step": v - 1, "weight_version": v, "trainers": list(trainers)}


def test_versions_resumed_from_a_checkpoint_are_applied_once():
    first = [step(1), step(2), step(3)]
    second = [{"kind": "resumed", "weight_version": 2}, step(3), step(4)]  # v3 again: its checkpoint was lost
    ok, line, problems = soak.check_versions([first, second])
    assert ok and line == [1, 2, 3, 4] and problems == []
    # the core saved v4 but the controller died before logging it: applied once all the same
    ok, line, _ = soak.check_versions([first, [{"kind": "resumed", "weight_version": 4}, step(5)]])
    assert ok and line == [1, 2, 3, 4, 5]
    # an attempt killed while it started logs nothing: the line stays as it was
    ok, line, _ = soak.check_versions([first, [{"kind": "progress"}], [{"kind": "resumed", "weight_version": 3}, step(4)]])
    assert ok and line == [1, 2, 3, 4]


def test_a_resume_inside_one_attempt_starts_a_segment():
    one_process = [step(1), step(2), step(3), {"kind": "resumed", "weight_version": 2}, step(3), step(4)]
    parts = soak.segments([one_process])
    assert [len(p) for p in parts] == [3, 3]
    ok, line, _ = soak.check_versions(parts)
    assert ok and line == [1, 2, 3, 4]
    assert not soak.check_versions([one_process])[0]  # read as one attempt, v3 looks applied twice


def test_a_version_applied_twice_or_skipped_is_caught():
    ok, _, problems = soak.check_versions([[step(1), step(2), step(2)]])
    assert not ok and problems
    ok, _, problems = soak.check_versions([[step(1)], [{"kind": "resumed", "weight_version": 3}, step(4)]])
    assert not ok and "resumed at 3" in problems[0]


def test_shards_counted_twice_by_a_step_are_caught_and_a_lost_cells_are_not():
    micro = [{"kind": "microstep", "step": 0, "cell": c, "shard": s} for c, s in ((0, "a"), (1, "b"), (0, "b"))]
    assert soak.shards_trained_twice([micro + [step(1, trainers=(0,))]]) == 0  # cell 1 was lost: b again on 0
    assert soak.shards_trained_twice([micro + [step(1, trainers=(0, 1))]]) == 1


def test_recovery_is_the_time_to_the_next_applied_step():
    kills = [{"kind": "proxy", "wall": 10.0}, {"kind": "proxy", "wall": 20.0}, {"kind": "core", "wall": 30.0},
             {"kind": "core", "wall": 99.0}]
    assert soak.recovery(kills, [5.0, 12.5, 21.0, 45.0]) == {
        "core": {"median": 15.0, "max": 15.0, "n": 1}, "proxy": {"median": 1.8, "max": 2.5, "n": 2}}  # (2.5 + 1.0) / 2, rounded


@pytest.mark.e2e
def test_a_short_soak_holds_its_invariants(tmp_path):
    out = soak.main(["--minutes", "1.0", "--kill-every", "6,10", "--seed", "3", "--runs-dir", str(tmp_path)])
    assert out["kills"] >= 4, out
    assert out["last_attempt_rc"] == 0 and out["final_version"] >= 2, out
    assert out["versions_applied_once"] is True, out
    assert out["records_lost"] == 0 and out["answered_calls"] > 0, out
    assert out["shards_trained_twice"] == 0, out
    assert isinstance(out["eval_reward_end"], float), out
    assert out["recovery_s"] and all(0 < r["median"] <= r["max"] for r in out["recovery_s"].values()), out
