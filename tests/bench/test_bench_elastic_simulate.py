"""bench.elastic and bench.simulate in their quick modes: they run, and print one JSON object last
with the keys their docstrings promise. Values are not judged (timings never are), only present
and well-formed. bench.elastic's live runs are tests/e2e/test_elastic_live.py."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import elastic, simulate

ROOT = Path(__file__).resolve().parents[2]


def last_json(capsys: pytest.CaptureFixture[str], main: Callable[[list[str]], object], argv: list[str]) -> dict:
    main(argv)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert isinstance(out, dict)
    return out


def finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_simulate_quick_without_a_measurement(capsys: pytest.CaptureFixture[str]):
    out = last_json(capsys, simulate.main, ["--quick"])
    assert {"p2_4t_vs_async", "p2_4t_vs_colocate", "calibration_error", "table", "host", "versions"} <= set(out)
    assert finite(out["p2_4t_vs_async"]) and finite(out["p2_4t_vs_colocate"])
    # Never invented: no result file, no calibration error, and the reason says so.
    assert out["calibration_error"] is None and "no bench.elastic result file" in out["calibration"]["reason"]
    assert {r["trace"] for r in out["table"]} == {"p2_4t", "p2_4t_drift", "p2_4t_moving", "p2_4t_moving_eval",
                                                  "p2_4t_moving_loss", "p2_4t_curriculum", "nl2repo_122b",
                                                  "nl2repo_122b_moving", "nl2repo_timeout_122b", "deepswe_122b",
                                                  "terminalbench_122b"}
    for row in out["table"]:
        assert set(row["hours"]) == {"elastic", "async", "colocate"} and all(finite(h) for h in row["hours"].values())
        assert all(v <= 1 for v in row["max_staleness"].values())  # every trace has staleness 1
        # every fixed split was run, the trace's own among them, and the best one is reported
        assert set(row["vs_async_splits"]) == {str(k) for k in range(1, row["cells"])}
        assert row["vs_async_splits"][str(row["async_train_cells"])] == row["vs_async"]
        assert row["vs_best_async"] == min(row["vs_async_splits"].values())
        # the better colocate counts: synchronous (staleness 0) or as configured
        assert row["vs_best_colocate"] == min(row["vs_colocate"], row["vs_colocate_sync"])
        assert row["vs_bound"] >= 1 - 1e-9 and row["vs_best_async"] <= row["ceiling_vs_best_async"] + 1e-9
        # the bound: no policy run beats it, so no ratio exceeds its ceiling
        assert all(h >= row["bound_h"] - 1e-9 for h in row["hours"].values())
        assert row["vs_async"] <= row["ceiling_vs_async"] and row["vs_colocate"] <= row["ceiling_vs_colocate"]
        # the stall-free bound holds for the two policies that keep running work served
        assert all(row["hours"][k] >= row["served_bound_h"] - 1e-9 for k in ("elastic", "async"))
        assert row["overcommit_h"]["elastic"] == 0 and row["overcommit_h"]["async"] == 0
        assert row["vs_colocate"] <= row["elastic_ceiling_vs_colocate"] <= row["ceiling_vs_colocate"]
        assert all(0 <= v <= 1 for v in row["cut_call_share"].values())
        # the throughput what-if: a fixed split at its throughput is never faster than any policy's
        assert row["throughput_vs_best_async"] >= 1 - 1e-9
    assert out["p2_4t_ceiling_vs_colocate"] == out["table"][0]["ceiling_vs_colocate"]
    run = out["what_if_run_release"]
    assert run["p2_4t_vs_colocate"] <= run["ceiling_vs_colocate"] and run["bound_h"] <= min(run["hours"].values())


def test_simulate_drift_predicts_a_drifting_run_from_a_stationary_one(capsys: pytest.CaptureFixture[str]):
    # The done-when command, on the committed result files of two real bench.elastic runs.
    out = last_json(capsys, simulate.main, ["--quick", "--drift"])
    assert out["trace"] == "p2_4t_drift"
    drift = next(r for r in out["table"] if r["trace"] == "p2_4t_drift")
    assert out["p2_4t_vs_best_async"] == drift["vs_best_async"] and out["p2_4t_vs_colocate"] == drift["vs_best_colocate"]
    assert out["p2_4t_vs_bound"] == drift["vs_bound"] and finite(out["p2_4t_ceiling_vs_best_async"])
    assert out["p2_4t_throughput_vs_best_async"] == drift["throughput_vs_best_async"]
    # the staleness sweep: the trace's own bound is the table's row; no run beats its bound
    sweep = out["by_staleness"]
    assert set(sweep) == {"1", "2", "3"} and sweep["1"]["vs_best_async"] == drift["vs_best_async"]
    assert all(v["vs_bound"] >= 1 - 1e-9 for v in sweep.values())
    cal = out["calibration"]
    assert out["calibration_in_sample"] is False and cal["fit_file"].endswith("elastic-stationary.json")
    assert cal["result_file"].endswith("elastic-drift.json") and finite(out["calibration_error"])
    assert set(cal["predicted"]) == set(cal["measured"]) == {"elastic_vs_best_async", "elastic_vs_colocate"}
    # every run the drifting bench measured was simulated, with the costs of the other run
    assert {"elastic", "async", "async-2", "async-3", "colocate", "colocate-sync"} <= set(cal["predicted_s"])
    fit = json.loads(Path(cal["fit_file"]).read_text())["calibration"]
    assert cal["trace"]["microstep_s"] == fit["microstep_s"] and cal["trace"]["to_train_s"] == fit["to_train_s"]
    shards = cal["shards_per_group_by_step"]
    assert shards[-1] > shards[0]  # the drifting run's tokens grow with its turns
    in_sample = simulate.calibrate(Path(cal["result_file"]))
    assert in_sample["in_sample"] is True and in_sample["trace"]["microstep_s"] != fit["microstep_s"]


def test_harness_starts_share_the_cores_fitted_to_the_cost_run():
    # The CPU time of one start is fitted so that the cost run's own elastic starts its runs in
    # the median overhead it measured; its other policies then start theirs as the sharing
    # gives (colocate starts two steps' runs at once, so waits about twice as long).
    stationary = simulate.load_result(simulate.RESULTS / "elastic-stationary.json")
    cpu_s = simulate.fit_launch_cpu_s(stationary)
    assert cpu_s is not None and 0 < cpu_s < stationary["calibration"]["launch_s"] / 4
    cal = simulate.calibrate(simulate.DRIFT_RESULT, simulate.FIT_RESULT)
    assert cal["launch_cpu_s"] == cpu_s and cal["trace"]["launch_cpus"] == stationary["host"]["cpu_count"]
    in_sample = simulate.calibrate(simulate.FIT_RESULT)
    assert in_sample["predicted_start_s"]["elastic"] == pytest.approx(stationary["calibration"]["launch_s"], rel=0.02)
    assert in_sample["predicted_start_s"]["colocate"] > 1.5 * in_sample["predicted_start_s"]["elastic"]
    # A result file without the overhead's spread keeps the fixed start it measured.
    old = {**stationary, "calibration": {**stationary["calibration"], "run_overhead_s_quantiles": None}}
    assert simulate.fit_launch_cpu_s(old) is None
    trace, _, _ = simulate.embedded_trace(old)
    assert trace.workload.launch_cpus == 0 and trace.workload.launch_s == stationary["calibration"]["launch_s"]


def test_simulate_refuses_a_file_that_is_not_a_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    bad = tmp_path / "result.json"
    bad.write_text(json.dumps({"elastic_vs_async": 1.2}))
    out = last_json(capsys, simulate.main, ["--quick", "--calibrate", str(bad)])
    assert out["calibration_error"] is None and "not a bench.elastic result file" in out["calibration"]["reason"]


def test_run_overhead_is_wall_time_less_think_and_calls(tmp_path: Path):
    from base.wire import CallRecord

    def call(eid: str, start: float, end: float) -> CallRecord:
        return CallRecord(execution_id=eid, call_id=f"{eid}-{start}", call_index=0, prompt_ids=[1], output_ids=[2],
                          output_logprobs=[-0.1], weight_version=0, cell_id=0, finish_reason="stop",
                          started_at=start, finished_at=end)

    logs = []
    for eid, think in (("s0-g0-e0", 1.5), ("s0-g0-e1", 0.25), ("s0-g0-e2", 3.0)):
        logs.append(tmp_path / eid / "stdout.log")
        logs[-1].parent.mkdir()
        logs[-1].write_text(f"harness: think {think:.3f}s over 3 turns\n")
    executions = [
        {"id": "s0-g0-e0", "train": True, "outcome": "finished", "run_s": 4.0},
        {"id": "s0-g0-e1", "train": True, "outcome": "finished", "run_s": 1.0},
        {"id": "s0-g0-e2", "train": True, "outcome": "timed_out", "run_s": 10.0},  # cut short: no overhead
        {"id": "eval-0", "train": False, "outcome": "finished", "run_s": 9.0},
    ]
    calls = [call("s0-g0-e0", 10.0, 10.5), call("s0-g0-e0", 20.0, 20.5), call("s0-g0-e1", 5.0, 5.25)]
    think = elastic.think_seconds(logs)
    assert think == {"s0-g0-e0": 1.5, "s0-g0-e1": 0.25, "s0-g0-e2": 3.0}
    assert elastic.run_overheads(executions, calls, think) == [0.5, 1.5]
    q = elastic.quantiles([3.0, -1.0, 1.0, 2.0], n=4)
    assert q[0] == 0.0 and q[-1] == 3.0 and q == sorted(q) and len(q) == 5  # negatives clip to 0
    draws = [simulate.draw([1.0, 2.0, 4.0], f"e{i}") for i in range(200)]
    assert all(1.0 <= d <= 4.0 for d in draws) and draws == [simulate.draw([1.0, 2.0, 4.0], f"e{i}") for i in range(200)]
    assert min(draws) < 1.5 and max(draws) > 3.0  # spread over the whole range


def test_scale_stretches_the_pace_and_the_harness_times_together():
    out = dict(o.partition("=")[::2] for o in elastic.scaled(elastic.BENCH_OVERRIDES, 2.0))
    base = dict(o.partition("=")[::2] for o in elastic.BENCH_OVERRIDES)
    for key in elastic.SCALED_KEYS:
        assert float(out[key]) == 2.0 * float(base[key])
    assert {k: v for k, v in out.items() if k not in elastic.SCALED_KEYS} == {
        k: v for k, v in base.items() if k not in elastic.SCALED_KEYS}


def test_a_lost_cell_is_named_as_cell_at_version_and_replayed_by_the_simulator():
    assert elastic.parse_loss("3@10") == simulate.CellLoss(cell=3, at_version=10)
    for bad in ("3", "0@5", "2@0", "x@1", "3@"):  # the core, version 0 and what is not CELL@VERSION are refused
        with pytest.raises(elastic.BenchError, match="--lose-cell"):
            elastic.parse_loss(bad)
    with pytest.raises(SystemExit):
        elastic.main(["--lose-cell", "3@20", "--steps", "20"])  # never applied before the last step
    # A result file of runs that lost cell 3 at version 2: the simulator's trace loses it too, and
    # its elastic finishes on the three cells left, later than with four.
    moving = simulate.load_result(simulate.RESULTS / "elastic-moving.json")
    lost = {**moving, "config": {**moving["config"], "lose_cell": {"cell": 3, "at_version": 2}}}
    trace, runs, _ = simulate.embedded_trace(lost)
    assert trace.cell_losses == (simulate.CellLoss(cell=3, at_version=2),)
    whole, _, _ = simulate.embedded_trace(moving)
    assert whole.cell_losses == ()
    assert simulate.simulate(trace, "elastic", runs=runs).makespan_s > simulate.simulate(whole, "elastic", runs=runs).makespan_s


def test_the_moving_workload_alternates_families_that_want_different_splits():
    """bench.elastic --workload moving: a valid config whose tool-heavy steps hold more runs than a
    cell serves (two serving cells to run at once) and whose token-heavy steps have more turns."""
    from tests.controller.test_config import load
    from workloads.drift import run_shape

    cfg = load(*elastic.MOVING_OVERRIDES, "run.steps=8")
    wl = cfg.workload
    shapes = [run_shape(wl, s) for s in range(8)]
    assert [s.family for s in shapes] == ["tool"] * 4 + ["token"] * 4
    runs_per_step = wl.groups_per_step * wl.group_size
    assert runs_per_step > cfg.scheduler.capacity_per_cell  # a tool-heavy step needs two serving cells
    tool, token = shapes[0], shapes[4]
    assert wl.think_time.median_s * tool.think_scale > 0.5 * wl.timeout_s  # many tool-heavy runs near the timeout
    assert token.max_turns >= 6 * tool.max_turns and token.think_scale < tool.think_scale / 10


def test_simulate_any_trace_file_a_user_brings(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """--trace: one file, every policy and split, both bounds, in hours; --staleness overrides it."""
    trace = json.loads((ROOT / "bench" / "traces" / "p2_4t.json").read_text())
    trace["workload"]["steps"] = 4
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(trace))
    out = last_json(capsys, simulate.main, ["--trace", str(path), "--staleness", "2", "--partial"])
    assert (out["steps"], out["staleness"], out["cells"]) == (4, 2, 4)
    partial = out["partial_rollouts"]  # the same trace with partial rollouts, beside the table's hours
    assert partial["whole_steps"]["hours"] == out["hours"] and set(partial["hours"]) == set(out["hours"])
    assert partial["max_staleness"]["colocate_sync"] == 0 and partial["groups"] == 4 * trace["workload"]["groups_per_step"]
    assert set(out["hours"]) == {"elastic", "colocate", "colocate_sync", "async_1", "async_2", "async_3"}
    best = min(out["hours"][f"async_{k}"] for k in (1, 2, 3))
    assert out["elastic_vs_best_async"] == pytest.approx(best / out["hours"]["elastic"])
    assert out["hours"]["elastic"] >= max(out["bound_h"], out["stall_free_bound_h"]) - 1e-9
    assert out["elastic_vs_bound"] >= 1.0 and out["max_staleness"]["elastic"] <= 2
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit):
        simulate.main(["--trace", str(tmp_path / "bad.json")])
    assert "--trace" in capsys.readouterr().err


def test_simulate_moving_prints_the_moving_balance_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    # The shipped moving traces cut to their first two blocks (a tool-heavy one, then a
    # token-heavy one), the satellite lost after the first: the same code as the full --moving.
    for name in ("p2_4t_moving", "p2_4t_moving_eval", "p2_4t_moving_loss"):
        raw = json.loads((simulate.TRACES / f"{name}.json").read_text())
        raw["workload"]["steps"] = 12
        for loss in raw.get("cell_losses", []):
            loss["at_version"] = 6
        (tmp_path / f"{name}.json").write_text(json.dumps(raw))
    out = last_json(capsys, simulate.main, ["--moving", "--traces", str(tmp_path)])
    for key in ("moving_vs_best_async", "moving_st2_vs_best_async", "moving_vs_colocate", "moving_vs_bound"):
        assert finite(out[key]) and out[key] > 0, key
    st1 = out["by_staleness"]["1"]
    assert out["moving_vs_best_async"] == st1["elastic_vs_best_async"] and st1["staleness"] == 1
    assert st1["steps"] == 12 and [p["ideal_training_cells"] for p in st1["phases"]] == [1, 3]  # the balance moves
    # The same runs with eval rounds and with a satellite lost halfway: every policy finishes.
    assert set(out["variants"]) == {"p2_4t_moving_eval", "p2_4t_moving_loss"}
    for name, v in out["variants"].items():
        assert set(v["hours"]) == {"elastic", "colocate", "colocate_sync", "async_1", "async_2", "async_3"}, name
        assert all(finite(h) and h > 0 for h in v["hours"].values()) and v["elastic_vs_bound"] >= 1.0, name


def test_partial_rollouts_what_if_runs_every_policy_beside_whole_steps():
    # The moving trace's first six steps: every policy and split again with partial rollouts.
    base = simulate.load_trace(simulate.TRACES / "p2_4t_moving.json")
    trace = simulate.dataclasses.replace(base, workload=simulate.dataclasses.replace(base.workload, steps=6))
    whole = simulate.trace_summary(trace, seed=0)["hours"]
    out = simulate.partial_rollouts(trace, seed=0, whole_h=whole)
    assert set(out["hours"]) == set(whole) == set(out["gain"]) == set(out["max_staleness"])
    assert all(finite(h) and h > 0 for h in out["hours"].values())
    assert out["gain"]["elastic"] == pytest.approx(whole["elastic"] / out["hours"]["elastic"])
    assert out["elastic_vs_best_async"] == pytest.approx(
        min(h for k, h in out["hours"].items() if k.startswith("async_")) / out["hours"]["elastic"])
    # Staleness 0 plans one step at a time: nothing to carry, and nothing staler than planned.
    assert out["carried_groups"]["colocate_sync"] == 0 and out["max_staleness"]["colocate_sync"] == 0
    assert out["groups"] == 6 * trace.workload.groups_per_step


def test_partial_goes_with_moving():
    with pytest.raises(SystemExit):
        simulate.main(["--partial"])


def test_stragglers_what_if_trades_runs_cut_for_time_and_says_so():
    # The moving trace's first twelve steps (a tool-heavy block, then a token-heavy one, whose
    # few long runs hold a cell that could train): elastic with straggler_runs beside elastic.
    base = simulate.load_trace(simulate.TRACES / "p2_4t_moving.json")
    trace = simulate.dataclasses.replace(base, workload=simulate.dataclasses.replace(base.workload, steps=12))
    summary = simulate.trace_summary(trace, seed=0)
    out = simulate.stragglers_what_if(trace, seed=0, straggler_runs=8, summary=summary)
    assert out["hours"]["elastic_all_served"] == pytest.approx(summary["hours"]["elastic"])
    # ... which is elastic as shipped (straggler_runs 0 in conf/scheduler/elastic.yaml)
    assert summary["hours"]["elastic"] == pytest.approx(simulate.simulate(trace, "elastic", seed=0).makespan_h)
    assert out["hours"]["elastic"] < out["hours"]["elastic_all_served"]  # the cell trained instead
    # ... paid for by the runs that waited: more of them cut at the timeout, with more work lost
    assert out["stalled_call_h"]["elastic"] > out["stalled_call_h"]["elastic_all_served"]
    assert out["cut_call_share"]["elastic"] > out["cut_call_share"]["elastic_all_served"]
    assert out["elastic_vs_bound"] == pytest.approx(out["hours"]["elastic"] / summary["bound_h"])
    assert out["elastic_vs_bound"] >= 1.0  # makespan_bound holds for every policy, stalls or not
    assert out["max_staleness"] <= 1
    with pytest.raises(SystemExit):
        simulate.main(["--stragglers", "8"])
    with pytest.raises(SystemExit):
        simulate.main(["--moving", "--stragglers", "0"])
