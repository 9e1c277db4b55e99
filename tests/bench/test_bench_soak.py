"""bench.soak: its checks on made-up event streams (each can fail). The short live soak is
tests/e2e/test_soak.py."""

from __future__ import annotations

import time

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


def _log_line(wall: float, text: str) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall))
    return f"{stamp},{int(wall * 1000) % 1000:03d} INFO controller.controller: {text}"


def test_reward_over_time_bins_the_applied_steps_and_shows_a_collapse(tmp_path):
    t0 = 1_800_000_000.0
    lines = [_log_line(t0 + 60 * m, f"step {m} applied -> version {m + 1} (reward {0.6 if m < 10 else 0.0:.3f}, 8 executions)")
             for m in range(20)]
    (tmp_path / "controller.log").write_text("\n".join(lines) + "\n")
    assert soak.reward_over_time(tmp_path, t0, minutes=20) == [0.6, 0.6, 0.0, 0.0]


def test_each_core_kill_is_matched_with_gyres_own_resume(tmp_path):
    t0 = 1_800_000_000.0
    kills = [{"kind": "core", "wall": t0 + 10}, {"kind": "core", "wall": t0 + 100}, {"kind": "controller", "wall": t0 + 105},
             {"kind": "core", "wall": t0 + 300}, {"kind": "proxy", "wall": t0 + 700}]
    # the first is resumed by gyre; the second's attempt loses its controller first (the soak's
    # restart resumes at 150, which is not gyre's own); the third is never resumed
    lines = [_log_line(t0 + 40, "gyre: resuming at step 5 from the core's checkpoint"),
             _log_line(t0 + 150, "gyre: resuming at step 9 from the core's checkpoint")]
    (tmp_path / "controller.log").write_text("\n".join(lines) + "\n")
    got = soak.core_kills_resumed(kills, tmp_path)
    assert got == {"core_kills": 3, "resumed_by_gyre": 1, "controller_killed_first": 1, "too_late": 0,
                   "not_resumed": 1, "every_core_kill_resumed_by_gyre": False}
