"""The scheduler's invariants over random snapshots (hypothesis), and over whole simulated runs.

1. running work is never left without serving capacity, but the few stragglers of later steps a
   run lets wait (``straggler_runs``); with no training work, all live work gets the cells it needs;
2. no step's rollouts start before the staleness bound allows, and no trained call is staler;
3. training demand never waits forever: ``decide`` or ``launch_room`` acts on it, and in a whole
   run the wait is bounded by one timeout plus the switches;
4. the core trains every step: whenever it can go, it goes, and every update is applied on it.
Plus what every policy owes the controller: pure, leaves busy and switching cells alone, one
switch per cell at most, everyone serves once the run is over.
"""

from __future__ import annotations

import dataclasses
import math

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from controller.config import SchedulerConfig
from controller.scheduler import (
    CellView, SchedulerView, Switch, decide, launch_room, running_need, serving_need, steps_to_plan, stragglers,
)
from controller.simulator import Simulation, pool_source, scheduler_config, simulate
from controller.traces import CellCosts, Phase, Trace, WorkloadShape

ROLE_PHASES = [("serve", "serving"), ("serve", "to_serve"), ("train", "draining"), ("train", "training"),
               ("serve", "dead")]


@st.composite
def snapshots(draw, kind: str = "elastic") -> tuple[SchedulerView, SchedulerConfig]:
    n = draw(st.integers(1, 6))
    core = draw(st.integers(0, n - 1))
    cells = []
    for i in range(n):
        role, phase = draw(st.sampled_from(ROLE_PHASES))
        if i == core and phase == "dead":
            phase = "serving"  # a dead core ends the run; the scheduler never sees one
        busy = phase == "training" and draw(st.booleans())
        cells.append(CellView(cell_id=i, role=role, phase=phase, is_core=i == core, busy=busy,
                              num_running=draw(st.integers(0, 20)), trained_s=draw(st.floats(0, 100))))
    cfg = SchedulerConfig(kind=kind, capacity_per_cell=draw(st.integers(1, 16)), staleness=draw(st.integers(0, 2)),
                          min_serving_cells=draw(st.integers(0, 1)), train_cells=draw(st.integers(1, max(1, n - 1))),
                          straggler_runs=draw(st.sampled_from([0, 0, 2, 8])))
    running = draw(st.integers(0, 80))
    queued = draw(st.integers(0, 80))
    view = SchedulerView(cells=tuple(cells), queued=queued, running=running,
                         queued_ahead=draw(st.integers(0, queued)) if cfg.staleness > 1 else 0,
                         rollouts_pending=draw(st.booleans()), train_demand=draw(st.integers(0, 6)),
                         step_rollouts_done=draw(st.booleans()), steps_left=draw(st.none() | st.integers(0, 3)),
                         ready_microsteps=draw(st.integers(0, 4)), queued_at_apply=draw(st.integers(0, 40)),
                         grading_groups=draw(st.integers(0, 3)), updates_applied=draw(st.none() | st.integers(0, 3)),
                         running_ahead=draw(st.integers(0, running)))
    return view, cfg


def after_roles(view: SchedulerView, out: list[Switch]) -> dict[int, str]:
    roles = {c.cell_id: c.role for c in view.cells if c.phase != "dead"}
    for s in out:
        roles[s.cell_id] = s.role
    return roles


def counts(view: SchedulerView) -> tuple[int, int, int]:
    alive = [c for c in view.cells if c.phase != "dead"]
    serving = sum(1 for c in alive if c.role == "serve")
    movable_training = sum(1 for c in alive if c.role == "train" and c.phase == "training" and not c.busy)
    return len(alive), serving, movable_training


# ---------------------------------------------------------------- 1. serving capacity


@settings(max_examples=300, deadline=None)
@given(snapshots())
def test_running_work_always_keeps_enough_serving_cells(snap):
    view, cfg = snap
    out = decide(view, cfg)
    n, serving, movable = counts(view)
    after = sum(1 for r in after_roles(view, out).values() if r == "serve")
    need = running_need(view, cfg, n)
    # Never turns a cell away that running work needs; brings back what it can when short.
    assert after >= min(need, serving + movable)
    if any(s.role == "train" for s in out):
        assert after >= need
    # Only stragglers asked for may go without (``straggler_runs``): a few runs of later steps.
    left = stragglers(view, cfg)
    assert left == 0 or (left <= cfg.straggler_runs and left == view.running == view.running_ahead)
    if cfg.straggler_runs == 0 or view.running_ahead < view.running:
        assert need == min(math.ceil(view.running / cfg.capacity_per_cell), n) or need == min(cfg.min_serving_cells, n)


@settings(max_examples=300, deadline=None)
@given(snapshots())
def test_without_training_work_all_live_work_gets_its_cells(snap):
    view, cfg = snap
    assume(view.train_demand == 0 and view.grading_groups == 0)  # data due soon is training work
    out = decide(view, cfg)
    n, serving, movable = counts(view)
    after = sum(1 for r in after_roles(view, out).values() if r == "serve")
    switching_in = sum(1 for c in view.cells if c.phase == "to_serve")
    assert after >= min(serving_need(view, cfg, n), serving + movable) or switching_in > 0


# ---------------------------------------------------------------- 2. staleness


@settings(max_examples=300, deadline=None)
@given(version=st.integers(0, 1000), staleness=st.integers(0, 8), total=st.integers(0, 1000))
def test_steps_to_plan_never_exceeds_the_bound_and_only_grows(version, staleness, total):
    planned = steps_to_plan(version=version, staleness=staleness, total_steps=total)
    assert 0 <= planned <= total
    # Step planned - 1 (the newest) may start: version >= (planned - 1) - staleness.
    assert planned == 0 or version >= planned - 1 - staleness
    assert planned == min(total, version + staleness + 1)
    assert steps_to_plan(version=version + 1, staleness=staleness, total_steps=total) >= planned


# ---------------------------------------------------------------- 3 and 4. training demand, the core


def core_of(view: SchedulerView) -> CellView:
    return next(c for c in view.cells if c.is_core)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(snapshots())
def test_training_demand_is_never_ignored(snap):
    view, cfg = snap
    core = core_of(view)
    holding = [c for c in view.cells if c.phase == "serving"]
    assume(view.train_demand > 0 and core.phase == "serving" and len(holding) >= 2)
    assume(not any(c.role == "train" for c in view.cells if c.phase != "dead"))
    out = decide(view, cfg)
    went = Switch(core.cell_id, "train") in out
    reserved = launch_room(view, cfg) <= max(0, (len(holding) - 1) * cfg.capacity_per_cell - view.running)
    assert went or reserved  # the core goes now, or its slots drain so that it can


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(snapshots())
def test_the_core_goes_to_train_whenever_the_others_hold_the_running_work(snap):
    view, cfg = snap
    core = core_of(view)
    holding = sum(1 for c in view.cells if c.phase == "serving")
    n = sum(1 for c in view.cells if c.phase != "dead")
    assume(view.train_demand > 0 and core.phase == "serving")
    assume(holding - 1 >= running_need(view, cfg, n))
    assert Switch(core.cell_id, "train") in decide(view, cfg)


# ---------------------------------------------------------------- what every policy owes the controller


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["elastic", "async", "colocate"]).flatmap(snapshots))
def test_every_policy_is_pure_and_moves_only_movable_cells_once(snap):
    view, cfg = snap
    out = decide(view, cfg)
    assert decide(view, cfg) == out
    reordered = SchedulerView(**{**view.__dict__, "cells": tuple(reversed(view.cells))})
    assert set(decide(reordered, cfg)) == set(out)  # the order cells are listed in does not matter
    by_id = {c.cell_id: c for c in view.cells}
    assert len({s.cell_id for s in out}) == len(out)
    for s in out:
        c = by_id[s.cell_id]
        assert c.phase in ("serving", "training") and not c.busy and c.role != s.role


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["elastic", "async", "colocate"]).flatmap(snapshots))
def test_every_policy_serves_everywhere_when_the_run_is_over(snap):
    view, cfg = snap
    over = SchedulerView(**{**view.__dict__, "queued": 0, "running": 0, "train_demand": 0, "rollouts_pending": False,
                            "steps_left": 0})
    roles = after_roles(over, decide(over, cfg))
    assert all(roles[c.cell_id] == "serve" for c in over.cells if c.phase == "training" and not c.busy)


@settings(max_examples=300, deadline=None)
@given(snapshots("async"))
def test_async_pools_are_fixed(snap):
    view, cfg = snap
    assume(view.train_demand > 0 or view.rollouts_pending or view.queued + view.running > 0 or view.steps_left)
    core = core_of(view)
    others = sorted(c.cell_id for c in view.cells if c.phase != "dead" and not c.is_core)
    # train_cells of the live cells, but one of them serves whenever two or more live
    trainers = {core.cell_id, *others[: min(cfg.train_cells, max(1, len(others))) - 1]}
    for s in decide(view, cfg):
        assert (s.role == "train") == (s.cell_id in trainers)


@settings(max_examples=300, deadline=None)
@given(snapshots("colocate"))
def test_colocate_moves_everyone_the_same_way(snap):
    view, cfg = snap
    assert len({s.role for s in decide(view, cfg)}) <= 1


# ---------------------------------------------------------------- whole runs, simulated


@st.composite
def small_traces(draw) -> Trace:
    n = draw(st.integers(2, 4))
    turns = draw(st.integers(1, 3))
    seg = st.floats(0.0, 5.0, allow_nan=False).map(lambda x: round(x, 2))
    pool = tuple(tuple(draw(seg) for _ in range(2 * turns)) for _ in range(draw(st.integers(1, 6))))
    cells = CellCosts(
        num_cells=n, nodes_per_cell=1, capacity_per_cell=draw(st.integers(1, 6)),
        to_train_s=draw(st.floats(0, 2)), to_serve_s=draw(st.floats(0, 2)), weight_transfer_s=draw(st.floats(0, 1)),
        grad_transfer_s=draw(st.floats(0, 1)), microstep_s=draw(st.floats(0.1, 4)), apply_s=draw(st.floats(0, 1)),
        compute_slots=draw(st.integers(1, n)), reroute_s=draw(st.floats(0, 1)),
    )
    shape = WorkloadShape(
        steps=draw(st.integers(1, 4)), groups_per_step=draw(st.integers(1, 3)), group_size=draw(st.integers(2, 4)),
        timeout_s=draw(st.floats(1, 12)), microsteps_per_group=draw(st.integers(1, 3)), launch_s=draw(st.floats(0, 1)),
        grade_s=draw(st.floats(0, 1)), staleness=draw(st.integers(0, 2)), async_train_cells=draw(st.integers(1, n - 1)),
    )
    return Trace(name="random", description="", generator="hypothesis", cells=cells, workload=shape, reference_h=None,
                 phases=(Phase(name="all", first_step=0, runs=(0, len(pool))),), executions=pool)


@settings(max_examples=60, deadline=None)
@given(small_traces(), st.integers(0, 3))
def test_simulated_runs_keep_the_invariants(trace, seed):
    cc, wl = trace.cells, trace.workload
    for kind in ("elastic", "async", "colocate"):
        r = simulate(trace, kind, seed=seed)  # finishing at all: no policy deadlocks
        assert len(r.step_done_s) == wl.steps and r.core_trained_steps == wl.steps
        assert r.max_staleness <= wl.staleness
    r = simulate(trace, "elastic", seed=seed)
    assert r.overcommit_s == 0.0  # running work always had serving capacity
    # Letting stragglers of later steps wait keeps every step, the bound and the core's updates.
    late = Simulation(trace, dataclasses.replace(scheduler_config(trace, "elastic"), straggler_runs=2),
                      pool_source(trace, seed)).run()
    assert len(late.step_done_s) == wl.steps and late.core_trained_steps == wl.steps
    assert late.max_staleness <= wl.staleness
    bound = wl.timeout_s + wl.launch_s + cc.to_serve_s + cc.to_train_s + cc.weight_transfer_s + cc.grad_transfer_s
    assert r.max_demand_wait_s <= bound + 1e-6
    assert math.isfinite(r.makespan_s)
