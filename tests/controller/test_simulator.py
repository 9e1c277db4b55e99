"""The simulator: makespans computed by hand on tiny traces, the policies ordered as theory says on
a trace built to show it, timeouts and stalls, and the trace files (format, validation, ours)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from controller.simulator import Simulation, pool_source, scheduler_config, simulate
from controller.traces import (
    CellCosts, CellLoss, EvalRounds, Phase, Trace, TraceError, WorkloadShape, load_trace, parse_trace, trace_to_json,
)

TRACES = Path(__file__).resolve().parents[2] / "bench" / "traces"


def tiny(**changes) -> Trace:
    """2 cells (capacity 2), one step of one group of 2 runs: call 1 s, then think 2 s."""
    cells = CellCosts(num_cells=2, nodes_per_cell=1, capacity_per_cell=2, to_train_s=0.5, to_serve_s=0.5,
                      weight_transfer_s=0.25, grad_transfer_s=0.25, microstep_s=3.0, apply_s=0.5, compute_slots=2,
                      reroute_s=0.0)
    shape = WorkloadShape(steps=1, groups_per_step=1, group_size=2, timeout_s=100.0, microsteps_per_group=1,
                          launch_s=0.5, grade_s=0.25, staleness=0, async_train_cells=1)
    trace = Trace(name="tiny", description="", generator="test", cells=cells, workload=shape, reference_h=None,
                  phases=(Phase(name="all", first_step=0, runs=(0, 1)),), executions=((1.0, 2.0),))
    return dataclasses.replace(trace, **changes)


def test_tiny_makespans_by_hand():
    # launch 0.5 + call 1 + think 2 = 3.5 the run ends, + grade 0.25 = 3.75 the shard is in.
    # colocate turns its cells to training then (0.5), one microstep (3), apply (0.5): 7.75.
    # elastic turns the core while the group is graded (3.5 + 0.5 = 4.0), so 4.0 + 3 + 0.5 = 7.5;
    # it sends no satellite for a single microstep; colocate sends both cells, one idles.
    assert simulate(tiny(), "colocate").makespan_s == pytest.approx(7.75)
    assert simulate(tiny(), "elastic").makespan_s == pytest.approx(7.5)
    assert simulate(tiny(), "elastic").switches == (1, 0)
    assert simulate(tiny(), "colocate").switches == (1, 1)  # the run ends at the last update
    # async: its core turns to training at t=0 (done at 0.5, while the harness starts), so the
    # microstep starts as soon as the shard is in: 3.75 + 3 + 0.5 = 7.25; both runs served by cell 1.
    r = simulate(tiny(), "async")
    assert r.makespan_s == pytest.approx(7.25)
    assert r.served_s[1] == pytest.approx(7.25) and r.trained_s[0] == pytest.approx(6.75)


def test_timeout_cuts_a_run_and_the_group_waits_for_it():
    trace = tiny(executions=((1.0, 50.0),), workload=dataclasses.replace(tiny().workload, timeout_s=5.0))
    r = simulate(trace, "elastic")
    assert r.num_timed_out == 2
    # Cut at 5 s after launch; the core's switch (0.5) covers the grading (0.25).
    assert r.makespan_s == pytest.approx(5.0 + 0.5 + 3.0 + 0.5)
    # Each run had its one call (1 s) before the cut, in the think time: no model time was cut.
    assert r.call_s == pytest.approx(2.0) and r.cut_call_s == pytest.approx(0.0)


def test_the_model_time_a_timeout_cuts_is_counted():
    # Calls of 1, 3 and 2 s with 1 s of think between; launch 0.5, timeout 4: each run is cut
    # 1.5 s into its second call (0.5 + 1 + 1 = 2.5 when it starts), with 1.5 + 2 = 3.5 s left.
    trace = tiny(executions=((1.0, 1.0, 3.0, 1.0, 2.0, 0.0),),
                 workload=dataclasses.replace(tiny().workload, timeout_s=4.0))
    r = simulate(trace, "elastic")
    assert r.call_s == pytest.approx(2 * 6.0)
    assert r.cut_call_s == pytest.approx(2 * 3.5)
    # Cut in its think time, a run has only its later calls left; cut before its first call, all.
    think = dataclasses.replace(trace, workload=dataclasses.replace(trace.workload, timeout_s=2.0))
    assert simulate(think, "elastic").cut_call_s == pytest.approx(2 * 5.0)
    early = dataclasses.replace(trace, workload=dataclasses.replace(trace.workload, timeout_s=0.25))
    assert simulate(early, "elastic").cut_call_s == pytest.approx(2 * 6.0)


def test_what_if_runs_release_their_microsteps_as_they_are_graded():
    # release="run" (a what-if, not Gyre's processor): a short run (call 1, think 2) and a long one
    # (think 20), a microstep each. The short one is graded at 0.5 + 3 + 0.25 = 3.75; the core
    # trains its microstep (switch 0.5, 3 s) while the long run is served by cell 1. The long one
    # is graded at 21.75 and its microstep on the training core ends 24.75; apply 0.5: 25.25.
    def runs(execution_id: str, _step: int) -> tuple[float, ...]:
        return (1.0, 2.0) if execution_id.endswith("e0") else (1.0, 20.0)

    trace = tiny(workload=dataclasses.replace(tiny().workload, microsteps_per_group=2))
    by_run = simulate(trace, "elastic", runs=runs, release="run")
    assert by_run.makespan_s == pytest.approx(25.25)
    by_group = simulate(trace, "elastic", runs=runs)  # both microsteps wait for the long run
    assert by_group.makespan_s > by_run.makespan_s + 0.5
    with pytest.raises(ValueError, match="release"):
        simulate(trace, "elastic", release="shard")


def test_what_if_partial_rollouts_train_the_first_groups_graded_and_carry_the_straggler():
    # Two steps of two groups, staleness 1, so both steps' runs start at once. Group s0-g0 has a
    # straggler (think 40). Without partial rollouts step 0 waits for it; with them step 0 trains
    # s0-g1 and whichever group of step 1 is graded next, and s0-g0 trains in step 1, one version
    # later than planned: the staleness they cost.
    def runs(execution_id: str, _step: int) -> tuple[float, ...]:
        return (1.0, 40.0) if execution_id == "s0-g0-e0" else (1.0, 2.0)

    trace = tiny(workload=dataclasses.replace(tiny().workload, steps=2, groups_per_step=2, staleness=1))
    for kind in ("elastic", "async", "colocate"):
        whole = simulate(trace, kind, runs=runs)
        partial = simulate(trace, kind, runs=runs, partial=True)
        assert whole.carried_groups == 0 and partial.carried_groups == 1, kind
        assert partial.num_executions == whole.num_executions == 8, kind  # every run trained once
        assert partial.step_done_s[0] < 41.0 < whole.step_done_s[0], kind  # step 0 did not wait
    with pytest.raises(ValueError, match="partial"):
        simulate(trace, "elastic", runs=runs, release="run", partial=True)


def test_harness_starts_share_the_launch_cpus():
    # Two runs start at once, each needing launch_s = 0.5 s of CPU. On one CPU they share it and
    # both start at 1.0: the runs end at 1.0 + 1 + 2 = 4.0, and elastic's 7.5 (by hand, above)
    # becomes 8.0. On two CPUs neither waits.
    one = tiny(workload=dataclasses.replace(tiny().workload, launch_cpus=1))
    r = simulate(one, "elastic")
    assert r.makespan_s == pytest.approx(8.0) and r.start_s_median == pytest.approx(1.0)
    two = simulate(tiny(workload=dataclasses.replace(tiny().workload, launch_cpus=2)), "elastic")
    assert two.makespan_s == pytest.approx(7.5) and two.start_s_median == pytest.approx(0.5)
    # Cut by the timeout while still starting: the run counts the time it waited, and is graded.
    cut = simulate(dataclasses.replace(one, workload=dataclasses.replace(one.workload, timeout_s=0.75)), "elastic")
    assert cut.num_timed_out == 2 and cut.start_s_median == pytest.approx(0.75)
    # The key is optional in a trace file: written only when set, and absent it is 0.
    assert "launch_cpus" not in trace_to_json(tiny())["workload"]
    assert parse_trace(json.loads(json.dumps(trace_to_json(one)))) == one


def test_calls_share_the_compute_slots_with_microsteps():
    # One compute slot: two cells calling at once run at half speed each: 0.5 + 2 + 2 = 4.5 the runs
    # end; then the core's switch (covering the grading), its microstep and the apply.
    trace = tiny(cells=dataclasses.replace(tiny().cells, compute_slots=1))
    assert simulate(trace, "elastic").makespan_s == pytest.approx(4.5 + 0.5 + 3.0 + 0.5)


def test_every_call_is_stamped_with_the_version_that_made_it():
    trace = tiny(workload=dataclasses.replace(tiny().workload, steps=3, staleness=0))
    for kind in ("elastic", "async", "colocate"):
        assert simulate(trace, kind).max_staleness == 0  # staleness 0: a step's calls all at its version
    stale = dataclasses.replace(trace, workload=dataclasses.replace(trace.workload, staleness=1))
    assert simulate(stale, "elastic").max_staleness <= 1


def test_eval_rounds_serve_beside_training_and_train_nothing():
    base = dataclasses.replace(theory_trace(), cells=dataclasses.replace(theory_trace().cells, capacity_per_cell=8))
    with_eval = dataclasses.replace(base, eval=EvalRounds(every=2, runs=12))
    sims = {}
    for trace in (base, with_eval):
        sim = Simulation(trace, scheduler_config(trace, "elastic"), theory_runs)
        sims[trace.eval is not None] = (sim, sim.run())
    (plain_sim, plain), (eval_sim, evald) = sims[False], sims[True]
    evals = [ex for ex in eval_sim.executions if not ex.train]
    # rounds at versions 2, 4 and 6 (none at the last, 8); each run's calls at its round's version or later
    assert sorted({ex.group_id for ex in evals}) == ["eval-v2", "eval-v4", "eval-v6"] and len(evals) == 36
    assert all(min(ex.call_versions, default=ex.step) >= ex.step for ex in evals if ex.state == "ended")
    assert evald.num_executions == plain.num_executions  # the trained runs alone
    assert len(evald.step_done_s) == len(plain.step_done_s) == 8
    # Eval runs draw from a generator of their own: the training runs are the same with the rounds.
    moving = load_trace(TRACES / "p2_4t_moving.json")
    ids = [f"s{s}-g{g}-e{i}" for s in range(0, 12, 5) for g in range(2) for i in range(4)]
    alone, beside = pool_source(moving, 0), pool_source(moving, 0)
    want = [alone(i, int(i[1:].split("-")[0])) for i in ids]
    got = []
    for i in ids:
        got.append(beside(i, int(i[1:].split("-")[0])))
        beside(f"eval-v1-{i}", 1)
    assert got == want


def test_a_lost_satellite_is_dropped_and_the_run_finishes_on_the_rest():
    lost = dataclasses.replace(theory_trace(), cell_losses=(CellLoss(cell=3, at_version=3),))
    for kind in ("elastic", "async", "colocate"):
        sim = Simulation(lost, scheduler_config(lost, kind), theory_runs)
        r = sim.run()
        full = simulate(theory_trace(), kind, runs=theory_runs)
        assert len(r.step_done_s) == 8 and sim.cells[3].phase == "dead"  # every step applied without it
        assert r.makespan_s >= full.makespan_s - 1e-9, kind
        done_at_loss = r.step_done_s[2]  # version 3 applied: the cell is gone from then on
        assert sim.cells[3].served_s + sim.cells[3].trained_s <= done_at_loss + 1e-6
    # a satellite lost mid-microstep: its shard is trained again by another cell, nothing lost
    mid = dataclasses.replace(theory_trace(), cell_losses=(CellLoss(cell=1, at_version=1),))
    assert len(Simulation(mid, scheduler_config(mid, "colocate"), theory_runs).run().step_done_s) == 8


def theory_trace() -> Trace:
    """Training-heavy, long-tailed: a step is 24 cell-seconds of microsteps, and its first group
    has one run of 12 s among runs of 3 s (the second group is all short). Theory: async (one
    training cell) is training-bound, ~24 s a step; colocate waits out the tail with every cell
    serving, then trains everything; elastic trains the early group on the cells the tail leaves
    free, so only the straggler's group is left when the tail ends."""
    cells = CellCosts(num_cells=4, nodes_per_cell=1, capacity_per_cell=16, to_train_s=0.2, to_serve_s=0.2,
                      weight_transfer_s=0.1, grad_transfer_s=0.1, microstep_s=3.0, apply_s=0.1, compute_slots=4,
                      reroute_s=0.0)
    shape = WorkloadShape(steps=8, groups_per_step=2, group_size=8, timeout_s=30.0, microsteps_per_group=4,
                          launch_s=0.1, grade_s=0.1, staleness=1, async_train_cells=1)
    return Trace(name="theory", description="", generator="test", cells=cells, workload=shape, reference_h=None,
                 phases=(Phase(name="all", first_step=0, runs=(0, 1)),), executions=((1.0, 2.0),))


def theory_runs(execution_id: str, _step: int) -> tuple[float, ...]:
    long = execution_id.endswith("-g0-e7")  # one straggler per step
    return (4.0, 4.0, 4.0, 0.0) if long else (1.0, 1.0, 1.0, 0.0)


def test_policies_ordered_as_theory_says():
    r = {k: simulate(theory_trace(), k, runs=theory_runs) for k in ("elastic", "async", "colocate")}
    assert r["elastic"].makespan_s < 0.85 * r["colocate"].makespan_s
    assert r["elastic"].makespan_s < 0.5 * r["async"].makespan_s
    assert r["async"].makespan_s >= 8 * 24.0  # one cell trains 24 cell-seconds a step
    assert r["elastic"].stalled_call_s == 0 and r["elastic"].overcommit_s == 0


def test_same_seed_same_run_and_seeds_draw_differently():
    trace = load_trace(TRACES / "deepswe_122b.json")
    short = dataclasses.replace(trace, workload=dataclasses.replace(trace.workload, steps=4))
    assert simulate(short, "elastic", seed=3) == simulate(short, "elastic", seed=3)
    assert simulate(short, "elastic", seed=3).makespan_s != simulate(short, "elastic", seed=4).makespan_s


# ---------------------------------------------------------------- trace files


def test_our_trace_files_load_and_round_trip():
    names = sorted(p.stem for p in TRACES.glob("*.json"))
    assert names == ["deepswe_122b", "nl2repo_122b", "nl2repo_122b_moving", "nl2repo_timeout_122b", "p2_4t",
                     "p2_4t_curriculum", "p2_4t_drift", "p2_4t_moving", "p2_4t_moving_eval", "p2_4t_moving_loss",
                     "terminalbench_122b"]
    for path in TRACES.glob("*.json"):
        trace = load_trace(path)
        assert parse_trace(json.loads(json.dumps(trace_to_json(trace)))) == trace
        assert path.stat().st_size < 100_000  # small: a pool of runs, not every run
    p24 = load_trace(TRACES / "p2_4t.json")
    assert (p24.cells.num_cells, p24.cells.nodes_per_cell, p24.workload.steps) == (4, 48, 48)
    assert p24.reference_h == {"elastic": 75.42, "async": 134.55, "colocate": 91.47}


def test_a_phase_that_makes_more_shards_costs_its_steps_more_training():
    # Two steps of one group, one cell training; the second step's phase makes 3 shards a group.
    # Each microstep is 3 s, on one compute slot: async (one training cell) ends exactly 6 s later,
    # and no policy gets the two extra microsteps for less.
    two = dataclasses.replace(tiny().workload, steps=2, staleness=1)
    flat = tiny(workload=two)
    growing = dataclasses.replace(flat, phases=(Phase(name="a", first_step=0, runs=(0, 1)),
                                                Phase(name="b", first_step=1, runs=(0, 1), microsteps_per_group=3)))
    assert [growing.microsteps_of_step(s) for s in (0, 1)] == [1, 3]
    assert parse_trace(json.loads(json.dumps(trace_to_json(growing)))) == growing
    assert "microsteps_per_group" not in trace_to_json(flat)["phases"][0]  # older files stay as they were
    one_cell = dataclasses.replace(growing.cells, num_cells=2, compute_slots=1)
    for kind in ("async", "colocate", "elastic"):
        more = simulate(dataclasses.replace(growing, cells=one_cell), kind).makespan_s
        less = simulate(dataclasses.replace(flat, cells=one_cell), kind).makespan_s
        assert more == pytest.approx(less + 6.0) if kind == "async" else more >= less + 6.0 - 1e-9, kind


def test_the_drifting_trace_grows_its_runs_and_shards_and_turns_tool_heavy_halfway():
    trace = load_trace(TRACES / "p2_4t_drift.json")
    steps = trace.workload.steps
    shards = [trace.microsteps_of_step(s) for s in range(steps)]
    assert shards == sorted(shards) and shards[-1] >= 3 * shards[0]
    mean_length = [sum(map(sum, trace.runs_of_step(s))) / len(trace.runs_of_step(s)) for s in (0, steps - 1)]
    assert 3.0 <= mean_length[1] / mean_length[0] <= 5.0
    # model share of a run: three quarters before the mix changes, about a third after
    def model_share(step: int) -> float:
        runs = trace.runs_of_step(step)
        return sum(sum(r[0::2]) for r in runs) / sum(sum(r) for r in runs)
    assert model_share(0) > 0.6 and model_share(steps - 1) < 0.45


def test_the_generator_reproduces_the_committed_traces(tmp_path: Path):
    from bench.traces import generate

    generate.main(["--out", str(tmp_path)])
    for path in TRACES.glob("*.json"):
        assert (tmp_path / path.name).read_text() == path.read_text(), path.name


def raw() -> dict:
    return trace_to_json(tiny())


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="gyre-trace/9"), "format"),
    (lambda d: d.pop("phases"), "missing ['phases']"),
    (lambda d: d.update(extra=1), "unknown ['extra']"),
    (lambda d: d["cells"].update(num_cells=2.5), "cells.num_cells: want an integer"),
    (lambda d: d["cells"].update(microstep_s="3"), "cells.microstep_s: want a finite number"),
    (lambda d: d["cells"].update(to_train_s=-1), "cells.to_train_s: want >= 0"),
    (lambda d: d["workload"].update(timeout_s=0), "workload.timeout_s: want > 0"),
    (lambda d: d["workload"].update(async_train_cells=2), "async_train_cells"),
    (lambda d: d.update(executions=[[1.0, 2.0, 3.0]]), "executions[0]"),
    (lambda d: d.update(executions=[[1.0, float("nan")]]), "executions[0][1]"),
    (lambda d: d.update(executions=[]), "executions"),
    (lambda d: d.update(phases=[{"name": "a", "first_step": 1, "runs": [0, 1]}]), "first_step 0"),
    (lambda d: d.update(phases=[{"name": "a", "first_step": 0, "runs": [0, 5]}]), "phases[0].runs"),
    (lambda d: d.update(reference_h={"elastic": 1.0}), "reference_h"),
    (lambda d: d["phases"][0].update(microsteps_per_group=-1), "phases[0].microsteps_per_group"),
    (lambda d: d["phases"][0].update(microsteps_per_group=1.5), "phases[0].microsteps_per_group"),
    (lambda d: d["phases"][0].update(shards=2), "unknown ['shards']"),
    (lambda d: d.update(eval={"every": 0, "runs": 2}), "eval.every: want > 0"),
    (lambda d: d.update(eval={"every": 2}), "eval: missing ['runs']"),
    (lambda d: d.update(cell_losses=[{"cell": 0, "at_version": 1}]), "cell_losses.cell: want > 0"),
    (lambda d: d.update(cell_losses=[{"cell": 9, "at_version": 1}]), "want a satellite"),
    (lambda d: d.update(cell_losses=[{"cell": 1, "at_version": 1.5}]), "cell_losses[0].at_version: want an integer"),
    (lambda d: d.update(cell_losses={"cell": 1}), "cell_losses: want a list"),
    (lambda d: d["workload"].update(launch_cpus=-1), "workload.launch_cpus: want >= 0"),
    (lambda d: d["workload"].update(launch_cpus=1.5), "workload.launch_cpus: want an integer"),
    (lambda d: d["workload"].update(launch_cores=2), "unknown ['launch_cores']"),
])
def test_bad_trace_files_are_refused_naming_the_field(mutate, message):
    d = raw()
    mutate(d)
    with pytest.raises(TraceError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_trace(d)


def test_unreadable_trace_file(tmp_path: Path):
    (tmp_path / "t.json").write_text("{not json")
    with pytest.raises(TraceError, match="not a readable JSON file"):
        load_trace(tmp_path / "t.json")
