"""The lower bounds: on any policy's makespan, and on that of a policy that keeps every running
execution served. Worked out by hand where a policy reaches them, never beaten by a simulated
policy they hold for on our traces, and they move with what they claim to depend on."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from controller.bounds import makespan_bound, serving_bound, throughput_what_if
from controller.simulator import pool_source, simulate
from controller.traces import load_trace
from tests.controller.test_simulator import tiny

TRACES = Path(__file__).resolve().parents[2] / "bench" / "traces"


def test_tiny_bound_by_hand_is_what_async_reaches():
    # launch 0.5 + call 1 + think 2 + grade 0.25 = 3.75, one microstep 3, apply 0.5: 7.25, the
    # makespan test_simulator works out for async (its core is training before the shard is in).
    trace = tiny()
    assert makespan_bound(trace, pool_source(trace, 0)) == pytest.approx(7.25)
    assert simulate(trace, "async").makespan_s == pytest.approx(7.25)


def test_run_release_bound_by_hand_is_what_elastic_reaches():
    # The what-if of test_simulator: runs graded at 3.75 and 21.75, a microstep each; the second
    # runs 21.75..24.75, apply 0.5: 25.25, which elastic reaches. Group release: both after 21.75,
    # on two cells at once: 21.75 + 3 + 0.5 = 25.25 too, but one cell does both when there is one.
    def runs(execution_id: str, _step: int) -> tuple[float, ...]:
        return (1.0, 2.0) if execution_id.endswith("e0") else (1.0, 20.0)

    trace = tiny(workload=dataclasses.replace(tiny().workload, microsteps_per_group=2))
    assert makespan_bound(trace, runs, release="run") == pytest.approx(25.25)
    assert simulate(trace, "elastic", runs=runs, release="run").makespan_s == pytest.approx(25.25)
    one_cell = dataclasses.replace(trace, cells=dataclasses.replace(trace.cells, num_cells=1, compute_slots=1))
    assert makespan_bound(one_cell, runs) == pytest.approx(21.75 + 6 + 0.5)
    assert makespan_bound(one_cell, runs, release="run") == pytest.approx(25.25)
    with pytest.raises(ValueError, match="release"):
        makespan_bound(trace, runs, release="shard")


def test_staleness_and_timeout_move_the_bound():
    # Two steps of one group; staleness 0 makes step 1 wait for step 0's update, staleness 1 not.
    trace = tiny(workload=dataclasses.replace(tiny().workload, steps=2))
    strict = makespan_bound(trace, pool_source(trace, 0))
    assert strict == pytest.approx(2 * 7.25)
    loose = dataclasses.replace(trace, workload=dataclasses.replace(trace.workload, staleness=1))
    assert makespan_bound(loose, pool_source(loose, 0)) == pytest.approx(7.25 + 3.0 + 0.5)
    cut = dataclasses.replace(trace, workload=dataclasses.replace(trace.workload, timeout_s=1.0))
    assert makespan_bound(cut, pool_source(cut, 0)) == pytest.approx(2 * (1.0 + 0.25 + 3.0 + 0.5))


def test_compute_slots_bound_the_cells_training_at_once():
    # 4 microsteps on 4 cells: one round (3 s) if each cell has its own compute, two if 2 slots.
    wl = dataclasses.replace(tiny().workload, microsteps_per_group=4)
    four = tiny(workload=wl, cells=dataclasses.replace(tiny().cells, num_cells=4, compute_slots=4))
    shared = dataclasses.replace(four, cells=dataclasses.replace(four.cells, compute_slots=2))
    assert makespan_bound(four, pool_source(four, 0)) == pytest.approx(3.75 + 3 + 0.5)
    assert makespan_bound(shared, pool_source(shared, 0)) == pytest.approx(3.75 + 6 + 0.5)


NAMES = ["p2_4t", "p2_4t_drift", "p2_4t_moving", "p2_4t_moving_eval", "p2_4t_moving_loss", "nl2repo_122b_moving", "nl2repo_122b", "nl2repo_timeout_122b", "deepswe_122b", "terminalbench_122b"]


@pytest.mark.parametrize("name", NAMES)
def test_no_policy_beats_the_bound_on_our_traces(name: str):
    trace = load_trace(TRACES / f"{name}.json")
    trace = dataclasses.replace(trace, workload=dataclasses.replace(trace.workload, steps=8))
    for release in ("group", "run"):
        bound = makespan_bound(trace, pool_source(trace, 0), release=release)
        for kind in ("elastic", "async", "colocate"):
            made = simulate(trace, kind, seed=0, release=release).makespan_s
            assert made >= bound - 1e-6, (name, release, kind, made, bound)
        assert bound > 0
    # Releasing runs as they are graded can only lower it.
    assert makespan_bound(trace, pool_source(trace, 0), release="run") <= makespan_bound(trace, pool_source(trace, 0))


def test_serving_bound_by_hand():
    # tiny(): 2 runs of launch 0.5 + call 1 + think 2 = 3.5 s each hold 7 slot-seconds; capacity 2
    # makes that 3.5 cell-seconds, plus one microstep of 3: 6.5 over 2 cells = 3.25 s, below the
    # chain (7.25). With a 1 s timeout the runs hold 1 s each: (1 + 3) / 2.
    trace = tiny()
    assert serving_bound(trace, pool_source(trace, 0)) == pytest.approx(3.25)
    cut = tiny(workload=dataclasses.replace(tiny().workload, timeout_s=1.0))
    assert serving_bound(cut, pool_source(cut, 0)) == pytest.approx(2.0)
    # One slot a cell: the runs take a cell each for 3.5 s, and the cells' time must hold it all.
    narrow = tiny(cells=dataclasses.replace(tiny().cells, capacity_per_cell=1))
    assert serving_bound(narrow, pool_source(narrow, 0)) == pytest.approx((7.0 + 3.0) / 2)


@pytest.mark.parametrize("name", NAMES)
def test_policies_that_keep_running_work_served_never_beat_the_serving_bound(name: str):
    trace = load_trace(TRACES / f"{name}.json")
    trace = dataclasses.replace(trace, workload=dataclasses.replace(trace.workload, steps=8))
    bound = serving_bound(trace, pool_source(trace, 0))
    for kind in ("elastic", "async"):
        r = simulate(trace, kind, seed=0)
        assert r.overcommit_s == 0.0, (name, kind)  # the premise: no running execution went without a slot
        assert r.makespan_s >= bound - 1e-6, (name, kind, r.makespan_s, bound)


def test_colocate_passes_the_serving_bound_only_by_cutting_its_runs():
    # Nine runs in ten near the timeout, 48 slots a cell for 128 runs a step: the serving slots
    # bind. Colocate gets under the bound by leaving running executions without a cell while it
    # trains (their timeout runs on), and the timeout then cuts far more of their model time.
    # (16 steps: over fewer, the first and last steps, which the bound does not charge, hide it.)
    trace = load_trace(TRACES / "nl2repo_timeout_122b.json")
    trace = dataclasses.replace(trace, workload=dataclasses.replace(trace.workload, steps=16))
    bound = serving_bound(trace, pool_source(trace, 0))
    assert bound > makespan_bound(trace, pool_source(trace, 0))  # here the slots bind, not the chain
    colocate, elastic = simulate(trace, "colocate", seed=0), simulate(trace, "elastic", seed=0)
    assert colocate.makespan_s < bound and colocate.overcommit_s > 0
    assert colocate.cut_call_s / colocate.call_s > 2 * elastic.cut_call_s / elastic.call_s


def test_throughput_what_if_by_hand():
    # 4 cells of one slot; tiny()'s 2 runs hold 3.5 s each: 7 cell-seconds of serving.
    four = dataclasses.replace(tiny().cells, num_cells=4, capacity_per_cell=1, compute_slots=4)
    # 7 s of training as well: 2 cells each way fit exactly, so no policy beats the 2/2 split.
    even = tiny(cells=dataclasses.replace(four, microstep_s=7.0))
    r = throughput_what_if(even, pool_source(even, 0))
    assert r["any_policy_s"] == pytest.approx(14 / 4) and r["best_split_s"] == pytest.approx(3.5)
    assert (r["best_split_cells"], r["ratio"]) == (2, pytest.approx(1.0))
    # 3 s of training: the ideal split is 1.2 training cells of 4. One cell takes 3 s (the three
    # serving cells 7/3 s), any policy (7 + 3) / 4 = 2.5 s: 1.2x.
    uneven = tiny(cells=dataclasses.replace(four, microstep_s=3.0))
    r = throughput_what_if(uneven, pool_source(uneven, 0))
    assert r["any_policy_s"] == pytest.approx(2.5) and r["best_split_s"] == pytest.approx(3.0)
    assert (r["best_split_cells"], r["ratio"]) == (1, pytest.approx(1.2))
    # Shared compute: one slot for all four cells makes calls (2 s) and training (3 s) queue: 5 s
    # for every policy and split alike.
    shared = tiny(cells=dataclasses.replace(four, microstep_s=3.0, compute_slots=1))
    r = throughput_what_if(shared, pool_source(shared, 0))
    assert r["any_policy_s"] == pytest.approx(5.0) and r["ratio"] == pytest.approx(1.0)


def test_throughput_what_if_is_summed_step_by_step_where_the_balance_moves():
    """Step 0 mostly serves (two 20.5 s runs), step 1 mostly trains: a fixed split cannot lend step
    1's idle serving cells to step 0's runs (staleness orders the steps), so each step pays its own
    bottleneck. Whole-run sums (14.33 s for one training cell) would hide that."""
    four = dataclasses.replace(tiny().cells, num_cells=4, capacity_per_cell=1, compute_slots=4, microstep_s=4.0)
    trace = tiny(cells=four, workload=dataclasses.replace(tiny().workload, steps=2))

    def runs(_execution_id: str, step: int) -> tuple[float, ...]:
        return (1.0, 19.0) if step == 0 else (0.5, 0.0)

    r = throughput_what_if(trace, runs)
    # any policy: step 0 max((41 + 4) / 4, (2 + 4) / 4) = 11.25, step 1 max((2 + 4) / 4, (1 + 4) / 4) = 1.5
    assert r["any_policy_s"] == pytest.approx(12.75)
    # one training cell: step 0 max(4, 41 / 3) = 13.67, step 1 max(4, 2 / 3) = 4
    assert r["best_split_cells"] == 1 and r["best_split_s"] == pytest.approx(41 / 3 + 4)
    assert r["ratio"] == pytest.approx((41 / 3 + 4) / 12.75)


def test_the_moving_traces_want_another_split_in_each_phase():
    """Tool-heavy blocks suit one training cell of four, token-heavy ones three; the stationary
    2.4T-like trace one split throughout."""
    from controller.bounds import phase_balance

    moving = load_trace(TRACES / "p2_4t_moving.json")
    phases = phase_balance(moving, pool_source(moving, 0))
    assert [p["ideal_training_cells"] for p in phases] == [1, 3] * 4
    assert all(p["balanced_training_cells"] < 1.5 for p in phases[0::2])
    assert all(p["balanced_training_cells"] > 3.5 for p in phases[1::2])
    stationary = load_trace(TRACES / "p2_4t.json")
    assert len({p["ideal_training_cells"] for p in phase_balance(stationary, pool_source(stationary, 0))}) == 1
