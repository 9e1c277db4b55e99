"""The pure scheduler: same snapshot, same decision; the policies' defining behaviour."""

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.config import SchedulerConfig
from controller.scheduler import CellView, SchedulerView, decide, serving_need


def cfg(kind="elastic", cap=4, train_cells=1):
    return SchedulerConfig(kind=kind, capacity_per_cell=cap, staleness=1, min_serving_cells=1, train_cells=train_cells)


def cell(i, role="serve", phase=None, core=False, busy=False, running=0, trained=0.0):
    phase = phase or ("serving" if role == "serve" else "training")
    return CellView(cell_id=i, role=role, phase=phase, is_core=core, busy=busy, num_running=running, trained_s=trained)


def view(cells, queued=0, running=0, demand=0, done=False, pending=True):
    return SchedulerView(cells=tuple(cells), queued=queued, running=running, rollouts_pending=pending,
                         train_demand=demand, step_rollouts_done=done)


def test_elastic_frees_cells_the_live_work_does_not_need_core_first():
    cells = [cell(0, core=True), cell(1), cell(2), cell(3)]
    out = decide(view(cells, running=5, demand=3), cfg())
    # 5 live executions need 2 cells of capacity 4: two turn to training, the core among them.
    assert {s.cell_id for s in out} == {0, 1} and all(s.role == "train" for s in out)


def test_elastic_turns_back_when_work_overflows():
    cells = [cell(0, "train", core=True), cell(1, "train"), cell(2), cell(3)]
    out = decide(view(cells, queued=2, running=8, demand=2), cfg())
    assert [(s.cell_id, s.role) for s in out] == [(1, "serve")]  # satellite first, the core keeps training


def test_elastic_everyone_serves_without_training_work_but_busy_cells_stay():
    cells = [cell(0, "train", core=True, busy=True), cell(1, "train"), cell(2, "train", phase="draining")]
    out = decide(view(cells, demand=0), cfg())
    assert [(s.cell_id, s.role) for s in out] == [(1, "serve")]


def test_elastic_swaps_the_core_in_when_no_cell_is_spare():
    cells = [cell(0, core=True), cell(1, "train"), cell(2), cell(3)]
    out = decide(view(cells, running=12, demand=1), cfg())
    assert {(s.cell_id, s.role) for s in out} == {(0, "train"), (1, "serve")}


def test_async_and_colocate():
    cells = [cell(0, core=True), cell(1), cell(2), cell(3)]
    assert [(s.cell_id, s.role) for s in decide(view(cells, running=40, demand=0), cfg("async", train_cells=2))] == [(0, "train"), (1, "train")]
    assert decide(view(cells, running=3, demand=2, done=False), cfg("colocate")) == []
    assert len(decide(view(cells, demand=2, done=True), cfg("colocate"))) == 4


@settings(max_examples=300, deadline=None)
@given(
    roles=st.lists(st.sampled_from(["serve", "train"]), min_size=1, max_size=6),
    queued=st.integers(0, 40), running=st.integers(0, 40), demand=st.integers(0, 5),
)
def test_elastic_never_leaves_live_work_without_enough_serving_cells(roles, queued, running, demand):
    cells = [cell(i, r, core=(i == 0)) for i, r in enumerate(roles)]
    v = view(cells, queued=queued, running=running, demand=demand)
    out = decide(v, cfg())
    after = {c.cell_id: c.role for c in cells}
    for s in out:
        after[s.cell_id] = s.role
    serving = sum(1 for r in after.values() if r == "serve")
    assert serving >= min(serving_need(v, cfg(), len(cells)), len(cells))
    assert decide(v, cfg()) == out  # pure: the same snapshot gives the same decision
