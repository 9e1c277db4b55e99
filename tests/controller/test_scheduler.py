"""The pure scheduler, by example: each policy's defining behaviour on small hand-made snapshots.
The invariants over all snapshots are in test_scheduler_properties.py."""

import dataclasses

from controller.config import SchedulerConfig
from controller.scheduler import stragglers, CellView, SchedulerView, decide, executions_at_apply, launch_room, steps_to_plan


def cfg(kind="elastic", cap=4, train_cells=1, min_serving=1, stragglers=0):
    return SchedulerConfig(kind=kind, capacity_per_cell=cap, staleness=1, min_serving_cells=min_serving,
                           train_cells=train_cells, straggler_runs=stragglers)


def cell(i, role="serve", phase=None, core=False, busy=False, running=0, trained=0.0):
    phase = phase or ("serving" if role == "serve" else "training")
    return CellView(cell_id=i, role=role, phase=phase, is_core=core, busy=busy, num_running=running, trained_s=trained)


def view(cells, queued=0, running=0, demand=0, done=False, pending=True, ready=0, at_apply=0, grading=0, ahead=0,
         running_ahead=0):
    return SchedulerView(cells=tuple(cells), queued=queued, running=running, rollouts_pending=pending,
                         train_demand=demand, step_rollouts_done=done, ready_microsteps=ready,
                         queued_at_apply=at_apply, grading_groups=grading, queued_ahead=ahead,
                         running_ahead=running_ahead)


def moves(out):
    return {(s.cell_id, s.role) for s in out}


def test_elastic_trains_on_cells_the_live_work_does_not_need_core_first():
    cells = [cell(0, core=True), cell(1), cell(2), cell(3)]
    # 5 live executions need 2 cells of capacity 4; 3 microsteps: the core and one satellite
    # train (the core's share of the live work would wait for it; here the others hold it all).
    assert moves(decide(view(cells, running=5, demand=3), cfg())) == {(0, "train"), (1, "train")}


def test_elastic_sends_no_more_satellites_than_there_are_microsteps():
    cells = [cell(0, core=True), cell(1), cell(2), cell(3)]
    # One microstep and the pending update: the core takes both, no satellite switches for nothing.
    assert moves(decide(view(cells, running=1, demand=2, done=True), cfg())) == {(0, "train")}


def test_elastic_turns_back_when_running_work_overflows_satellites_first():
    cells = [cell(0, "train", core=True), cell(1, "train"), cell(2), cell(3)]
    out = decide(view(cells, running=10, demand=2), cfg())
    assert moves(out) == {(1, "serve")}  # 10 running need 3 cells; the core keeps training


def test_elastic_core_keeps_training_while_queued_work_waits_for_it():
    cells = [cell(0, "train", core=True), cell(1), cell(2), cell(3)]
    # 12 running fill the three satellites; 8 more are queued: they wait, the core trains on.
    assert decide(view(cells, queued=8, running=12, demand=3), cfg()) == []


def test_elastic_idle_core_serves_queued_work_when_nothing_is_left_to_train():
    cells = [cell(0, "train", core=True), cell(1), cell(2), cell(3)]
    assert moves(decide(view(cells, queued=8, running=12, demand=0), cfg())) == {(0, "serve")}


def test_elastic_switches_while_the_steps_last_groups_are_graded():
    # Near the timeout a step's runs end together; its data comes a grading time later. Three
    # groups are being graded, 8 runs (of the next step) need 2 cells: the core and the one spare
    # satellite start their switch now instead of when the first shard lands.
    cells = [cell(0, core=True), cell(1), cell(2), cell(3)]
    assert decide(view(cells, running=8), cfg()) == []
    assert moves(decide(view(cells, running=8, grading=3), cfg())) == {(0, "train"), (1, "train")}
    # One group being graded is a microstep for the core alone.
    assert moves(decide(view(cells, running=8, grading=1), cfg())) == {(0, "train")}
    # Live work still comes first: 16 runs need every serving cell.
    assert decide(view(cells, running=16, grading=3), cfg()) == []


def test_elastic_core_waits_in_training_for_groups_being_graded():
    cells = [cell(0, "train", core=True), cell(1), cell(2), cell(3)]
    # Queued work would take the idle core back (the next test's case), but its data is due.
    assert moves(decide(view(cells, queued=8, running=12), cfg())) == {(0, "serve")}
    assert decide(view(cells, queued=8, running=12, grading=2), cfg()) == []


def test_elastic_idle_satellite_stays_training_until_live_work_needs_it():
    cells = [cell(0, "train", core=True), cell(1, "train"), cell(2), cell(3)]
    assert decide(view(cells, running=6, demand=1), cfg()) == []  # 6 running fit in 2 cells
    assert moves(decide(view(cells, queued=4, running=6, demand=1), cfg())) == {(1, "serve")}


def test_elastic_tail_serves_the_rollouts_the_update_will_release():
    # The step's rollouts are in, its last two microsteps run on the core and cell 1; cell 2 has
    # nothing left to train. Cell 3 holds the next step's 4 runs; the update will queue 4 more,
    # which need a second serving cell the moment it lands: cell 2 turns to serve now.
    cells = [cell(0, "train", core=True, busy=True), cell(1, "train", busy=True), cell(2, "train"), cell(3, running=4)]
    tail = dict(running=4, demand=3, done=True, ready=0)
    assert moves(decide(view(cells, **tail, at_apply=4), cfg())) == {(2, "serve")}
    # Not while a microstep is still waiting for a cell, nor when the update releases nothing.
    assert decide(view(cells, **tail | {"ready": 1, "demand": 4}, at_apply=4), cfg()) == []
    assert decide(view(cells, **tail, at_apply=0), cfg()) == []
    # Not while the step's rollouts are still coming in (more microsteps will).
    assert decide(view(cells, **tail | {"done": False}, at_apply=4), cfg()) == []


def test_executions_at_apply_is_what_the_staleness_bound_releases():
    # Version 3, staleness 1: steps 0..4 may be planned; the update to 4 releases step 5.
    assert executions_at_apply(version=3, staleness=1, total_steps=10, planned=5, per_step=8) == 8
    assert executions_at_apply(version=3, staleness=1, total_steps=5, planned=5, per_step=8) == 0
    assert executions_at_apply(version=3, staleness=1, total_steps=10, planned=4, per_step=8) == 16


def test_elastic_brings_a_satellite_back_so_the_core_can_go():
    cells = [cell(0, core=True), cell(1, "train"), cell(2), cell(3)]
    # 12 running need all three serving cells; the update can only be applied on the core.
    assert moves(decide(view(cells, running=12, demand=1, done=True), cfg())) == {(1, "serve")}
    cells = [cell(0, core=True), cell(1), cell(2), cell(3)]
    assert moves(decide(view(cells, running=12, demand=1, done=True), cfg())) == {(0, "train")}


def test_elastic_reserves_the_core_slots_while_it_is_due_to_train():
    cells = [cell(0, core=True), cell(1), cell(2), cell(3)]
    assert launch_room(view(cells, queued=20, running=14, demand=0), cfg()) == 2
    assert launch_room(view(cells, queued=20, running=14, demand=3), cfg()) == 0  # 16 - 4 reserved - 14 < 0
    assert launch_room(view(cells, queued=20, running=10, demand=3), cfg()) == 2
    assert launch_room(view(cells, queued=20, running=10, demand=3), cfg("colocate")) == 6


def test_elastic_starts_runs_of_steps_further_ahead_only_in_the_slack_of_the_nearer_work():
    # Staleness 2: 6 runs of the next step run, 8 of the step after are queued ("ahead").
    cells = [cell(0, "train", core=True), cell(1), cell(2), cell(3)]
    # No microstep waiting for a cell: every free slot takes them, as before.
    assert launch_room(view(cells, queued=8, running=6, demand=3, ahead=8), cfg()) == 6
    # Microsteps waiting: only the 2 free slots of the two cells the 6 running runs hold; started
    # on the third cell they would keep it serving (rule 1) while the trainable step needs it.
    assert launch_room(view(cells, queued=8, running=6, demand=3, ready=2, ahead=8), cfg()) == 2
    # Nearer runs queued start first (the queue is in step order): 2 fill the two cells; 3 need
    # a third, whose slack then takes 3 of the runs further ahead.
    assert launch_room(view(cells, queued=10, running=6, demand=3, ready=2, ahead=8), cfg()) == 2
    assert launch_room(view(cells, queued=11, running=6, demand=3, ready=2, ahead=8), cfg()) == 3 + 3
    # The fixed pools and colocate do as they did: the lookahead is elastic's.
    assert launch_room(view(cells, queued=8, running=6, demand=3, ready=2, ahead=8), cfg("colocate")) == 6
    # Nor do queued runs of steps further ahead count as live work a satellite serves for.
    cells = [cell(0, "train", core=True), cell(1, "train"), cell(2), cell(3)]
    assert decide(view(cells, queued=8, running=6, demand=4, ahead=8), cfg()) == []
    assert moves(decide(view(cells, queued=8, running=6, demand=4, ahead=0), cfg())) == {(1, "serve")}


def test_elastic_holds_nothing_back_while_the_pipeline_fills():
    # The first `staleness` updates: every planned step is on the critical path, so its runs start
    # as early as they can, and they count as live work (what the lookahead does once it is full).
    cells = [cell(0, "train", core=True), cell(1), cell(2), cell(3)]
    stale2 = dataclasses.replace(cfg(), staleness=2)
    filling = dataclasses.replace(view(cells, queued=8, running=6, demand=3, ready=2, ahead=8), updates_applied=1)
    assert launch_room(filling, stale2) == 6
    assert launch_room(dataclasses.replace(filling, updates_applied=2), stale2) == 2
    assert launch_room(dataclasses.replace(filling, updates_applied=None), stale2) == 2  # caller silent: full
    cells = [cell(0, "train", core=True), cell(1, "train"), cell(2), cell(3)]
    filling = dataclasses.replace(view(cells, queued=8, running=6, demand=4, ahead=8), updates_applied=0)
    assert moves(decide(filling, stale2)) == {(1, "serve")}
    assert decide(dataclasses.replace(filling, updates_applied=2), stale2) == []


def test_elastic_trains_everywhere_when_the_update_gates_every_rollout():
    cells = [cell(0, core=True), cell(1), cell(2), cell(3)]
    # Nothing live, the step's rollouts are in: nothing can start before this update lands.
    out = decide(view(cells, demand=5, done=True, pending=True), cfg())
    assert moves(out) == {(0, "train"), (1, "train"), (2, "train"), (3, "train")}
    # Likewise while its last groups are graded: with nothing live, none of them has a run left.
    out = decide(view(cells, pending=True, grading=8), cfg())
    assert moves(out) == {(0, "train"), (1, "train"), (2, "train"), (3, "train")}
    # A queued run keeps a cell standing by.
    assert len(decide(view(cells, queued=1, pending=True, grading=8), cfg())) == 3


def test_busy_and_switching_cells_are_left_alone():
    cells = [cell(0, "train", core=True, busy=True), cell(1, "train", busy=True), cell(2, "train", phase="draining"),
             cell(3, "serve", phase="to_serve")]
    assert decide(view(cells, queued=40, running=0, demand=0), cfg()) == []


def test_async_and_colocate():
    cells = [cell(0, core=True), cell(1), cell(2), cell(3)]
    assert moves(decide(view(cells, running=40, demand=0), cfg("async", train_cells=2))) == {(0, "train"), (1, "train")}
    assert decide(view(cells, running=3, demand=2, done=False), cfg("colocate")) == []
    assert len(decide(view(cells, demand=2, done=True), cfg("colocate"))) == 4


def test_a_fixed_split_that_lost_its_serving_cell_turns_a_trainer_to_serving():
    """3 of 4 cells train; the serving cell dies: the survivors must not all train (no rollouts
    would ever come), so the last of them by id serves."""
    cells = [cell(0, "train", core=True), cell(1, "train"), cell(2, "train"), cell(3, phase="dead")]
    assert moves(decide(view(cells, running=4, demand=0), cfg("async", train_cells=3))) == {(2, "serve")}
    switched = [*cells[:2], cell(2), cells[3]]  # once it serves, runs start on its slots
    assert launch_room(view(switched, queued=20, running=0), cfg("async", train_cells=3)) == 4
    alone = [cell(0, "train", core=True), cell(1, phase="dead")]  # the core alone: it keeps its step
    assert decide(view(alone, running=0, demand=1), cfg("async", train_cells=1)) == []


def test_async_starts_runs_only_on_its_serving_pool():
    # At the start every cell serves, but the core and cell 1 are async's training pool and leave:
    # runs started on their slots would have none. Only cells 2 and 3 count (2 x 4 slots, 3 used).
    cells = [cell(0, core=True), cell(1), cell(2), cell(3)]
    assert launch_room(view(cells, queued=20, running=3), cfg("async", train_cells=2)) == 5
    assert launch_room(view(cells, queued=20, running=3), cfg("elastic")) == 13  # elastic keeps them while no training is due


def test_every_policy_serves_everywhere_once_the_run_is_over():
    cells = [cell(0, "train", core=True), cell(1, "train"), cell(2), cell(3, "train")]
    over = view(cells, demand=0, pending=False)
    grading = SchedulerView(**{**over.__dict__, "steps_left": 1})  # the last grades are in flight
    for kind in ("elastic", "async", "colocate"):
        assert moves(decide(over, cfg(kind))) == {(0, "serve"), (1, "serve"), (3, "serve")}
        assert moves(decide(SchedulerView(**{**over.__dict__, "steps_left": 0}), cfg(kind))) == moves(decide(over, cfg(kind)))
    assert decide(grading, cfg("elastic")) == []
    assert (0, "serve") not in moves(decide(grading, cfg("async")))  # its pool is the core alone


def test_steps_to_plan_is_the_staleness_bound():
    assert [steps_to_plan(version=v, staleness=1, total_steps=4) for v in range(5)] == [2, 3, 4, 4, 4]
    assert steps_to_plan(version=0, staleness=0, total_steps=4) == 1


def test_elastic_held_runs_are_live_work_while_nothing_is_due_to_train():
    # Staleness 2, pipeline full: 8 runs of the step after next are queued ("ahead"). While the
    # trainable step has microsteps or groups being graded they wait for the slack of the nearer
    # work (above); with nothing to train, the idle training cells serve them instead of idling
    # (on the moving-balance trace a tool-heavy step's runs waited over an hour so).
    cells = [cell(0, "train", core=True), cell(1, "train"), cell(2, running=4), cell(3, running=4)]
    stale2 = dataclasses.replace(cfg(), staleness=2)
    idle = dataclasses.replace(view(cells, queued=8, running=8, ahead=8), updates_applied=3)
    assert moves(decide(idle, stale2)) == {(1, "serve"), (0, "serve")}
    assert decide(dataclasses.replace(idle, train_demand=3, ready_microsteps=2), stale2) == []
    assert decide(dataclasses.replace(idle, grading_groups=2), stale2) == []


def test_elastic_stands_no_cell_by_for_held_runs_alone():
    # The only live work is runs the lookahead holds back while microsteps wait: a cell standing
    # by would serve nothing. Every cell trains; the held runs start in the step's tail, where a
    # cell turns to serve for the runs the update releases.
    cells = [cell(0, core=True), cell(1), cell(2), cell(3)]
    stale2 = dataclasses.replace(cfg(), staleness=2)
    held = dataclasses.replace(view(cells, queued=8, demand=6, ready=6, ahead=8), updates_applied=3)
    assert moves(decide(held, stale2)) == {(0, "train"), (1, "train"), (2, "train"), (3, "train")}
    # While the pipeline fills nothing is held: the 8 queued runs keep the two cells they need.
    assert len(decide(dataclasses.replace(held, updates_applied=1), stale2)) == 2
    # A nearer run queued keeps one standing by too.
    assert len(decide(dataclasses.replace(held, queued=9), stale2)) == 3


def test_elastic_lets_a_few_stragglers_of_the_next_step_wait_only_when_asked():
    # Three cells train the step (each holds a microstep's gradients); cell 3 holds the last 3
    # runs of the next step while 12 microsteps wait for a cell.
    cells = [cell(0, "train", core=True, busy=True), cell(1, "train", busy=True), cell(2, "train", busy=True),
             cell(3, running=3)]
    tail = dict(running=3, running_ahead=3, demand=16, done=True, ready=12)
    assert decide(view(cells, **tail), cfg()) == []  # by default running work keeps its cell
    assert moves(decide(view(cells, **tail), cfg(stragglers=3))) == {(3, "train")}
    # Not more of them than asked, not runs the trainable step waits on, not while runs are queued
    # to start, and not once no microstep waits for a cell (the step's tail).
    assert decide(view(cells, **tail), cfg(stragglers=2)) == []
    assert decide(view(cells, **tail | {"running_ahead": 2}), cfg(stragglers=3)) == []
    assert decide(view(cells, **tail, queued=1), cfg(stragglers=3)) == []
    assert decide(view(cells, **tail | {"ready": 0, "demand": 4}), cfg(stragglers=3)) == []
    # The other policies never leave running work: the option is elastic's.
    assert stragglers(view(cells, **tail), cfg("colocate", stragglers=3)) == 0


def test_elastic_serves_waiting_stragglers_again_in_the_steps_tail():
    # The stragglers waited while microsteps queued; now none is left to hand out and cell 3 is
    # idle in training: it turns back to serve them (rule 1 counts them again).
    cells = [cell(0, "train", core=True, busy=True), cell(1, "train", busy=True), cell(2, "train", busy=True),
             cell(3, "train")]
    tail = dict(running=3, running_ahead=3, demand=4, done=True, ready=0)
    assert moves(decide(view(cells, **tail), cfg(stragglers=3))) == {(3, "serve")}
