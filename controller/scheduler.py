"""Who serves and who trains: a pure function of a snapshot of the controller's state.

``decide(view, cfg) -> list[Switch]`` does no I/O and reads no clock, so the live controller, the
simulator (``controller/simulator.py``) and replays run the same code. Cells in the middle of a
switch are left alone; cells that are ``busy`` (holding microsteps, unsent gradients, or applying
a step) keep their role. ``launch_room`` says how many queued executions may start now and
``steps_to_plan`` how many steps may have rollouts at a weight version (the staleness bound).

Policies (same interface, same staleness bound, so they compare on equal terms):
- ``elastic`` (water level), in order of precedence:
  1. running work is never left without serving capacity: while the serving cells cannot hold
     the running executions, idle training cells turn back, satellites first, the core last.
     The one exception is opt-in (``straggler_runs``, 0 by default): while microsteps wait for a
     cell, nothing is queued and every running execution belongs to a step after the trainable
     one, up to that many of them may wait without a cell (their calls wait at the proxy, past
     ``proxy.route_wait_s`` as a retriable 529 the harness retries, as under colocate), so a
     cell that holds only a step's last few runs trains instead. In the
     step's tail (no microstep left to hand out) they count again and a cell comes back for
     them. Their timeout keeps running meanwhile, so some end with less of their work done: on
     the moving-balance trace (``bench.simulate --moving``) the trade is measured, time saved
     against runs cut, and it is off unless a run asks for it;
  2. the core trains whenever the trainable step has training work, or will have within the
     grading time (``grading_groups``: groups whose runs have all ended): queued (not yet started)
     executions wait for it rather than the other way round, and ``launch_room`` stops filling
     the core while it is due to train, so its running work drains and it can go;
  3. satellites beyond what all live work (queued + running) needs train, as many as there are
     microsteps for them, counting one for each group being graded (the switch then overlaps
     the grading: near the timeout a step's runs end together and its data comes at once); an
     idle training satellite stays (a switch costs minutes on a cluster) until live work needs
     it back. In the step's tail (its rollouts all in, no microstep left to
     hand out) live work counts the rollouts its update will release (``queued_at_apply``), so a
     satellite with nothing left to train is serving when they launch instead of starting its
     switch then: the next step's rollouts are on the critical path;
  4. ``min_serving_cells`` stand by for rollouts to come, except when nothing is live and the
     trainable step's rollouts are all in or being graded: then no rollout can start before its
     update lands; nor for runs the lookahead holds back (below) when they are all that is live.
  Lookahead (``launch_room``): with a staleness bound above 1, while microsteps wait for a
  cell, runs of steps past the next one start only in the slack of the cells the nearer work
  holds, and rule 3 does not count them as live work, so no cell keeps serving for work no
  update waits on (bench.simulate's staleness table: on the drifting 2.4T-like trace elastic
  went from 0.98x / 0.96x of the best fixed split to 1.01x / 1.03x at staleness 2 / 3). Not
  while the pipeline fills (the first ``staleness`` updates): then every planned step is on the
  critical path, and holding its runs back cost short runs up to 9% (8 steps of p2_4t at
  staleness 2: 1.14x over the best split with it there, 1.24x without). Only while the trainable
  step is due to train (``_training_due``): with nothing to train, held runs are live work like
  any other, and idle training cells serve them rather than idle beside a queue. And no cell
  stands by serving for held runs alone: it would serve nothing while the microsteps it could
  run wait; every cell trains, and the held runs start in the step's tail, where a cell turns to
  serve for the runs the update releases (rule 3), so two steps' runs share its serving time.
  On the moving-balance trace at staleness 2 (``bench.simulate --moving``) a cell had stood by
  empty through every other token-heavy step, and a tool-heavy step's runs had waited an hour
  in the queue while two cells idled in training: 76.51 h before, 72.47 h after.
- ``async``: fixed pools; the core and the next ``train_cells - 1`` cells train, the rest serve.
- ``colocate``: everyone serves until the trainable step's rollouts are all in, then everyone
  trains (running executions wait for a serving cell meanwhile).
Once nothing is left to train or roll out, every policy turns every cell to serving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controller.config import SchedulerConfig
from base.wire import CellPhase, Role

STABLE: tuple[CellPhase, ...] = ("serving", "training")


@dataclass(frozen=True, kw_only=True)
class CellView:
    cell_id: int
    role: Role
    """The role the cell holds or is switching into."""
    phase: CellPhase
    is_core: bool
    busy: bool
    num_running: int
    trained_s: float


@dataclass(frozen=True, kw_only=True)
class SchedulerView:
    cells: tuple[CellView, ...]
    queued: int
    running: int
    rollouts_pending: bool
    """More rollouts are allowed to start soon (steps left within the staleness bound)."""
    train_demand: int
    """Microsteps of the trainable step ready or in flight, plus 1 while its update is pending."""
    step_rollouts_done: bool
    """Every group of the trainable step has been graded (colocate waits for this)."""
    ready_microsteps: int = 0
    """Microsteps of the trainable step ready and not yet handed to a cell."""
    queued_at_apply: int = 0
    """Executions the trainable step's update will queue: the next step's rollouts, which the
    staleness bound holds until it lands (``executions_at_apply``)."""
    grading_groups: int = 0
    """Groups of the trainable step whose runs have all ended and whose grades are not in yet: at
    least a microstep each, due within the grading time."""
    queued_ahead: int = 0
    """Queued executions of steps past the one after the trainable step (only a staleness bound
    above 1 plans those): no update waits on them before the trainable step's lands."""
    running_ahead: int = 0
    """Running executions of steps after the trainable one: no microstep of the trainable step
    waits on them (``straggler_runs`` lets a few of them wait without a serving cell)."""
    updates_applied: int | None = None
    """Updates applied since this attempt's rollouts began (``None``: the caller does not say, and
    the pipeline counts as full). The first ``staleness`` of them are the pipeline filling."""
    steps_left: int | None = None
    """Weight versions still to train (0 once the last update is applied). ``None``: the caller
    does not say, and the run counts as over once nothing is live, pending or in demand, which
    also holds for a moment while the last step's grades are in flight."""


@dataclass(frozen=True)
class Switch:
    cell_id: int
    role: Role


def decide(view: SchedulerView, cfg: SchedulerConfig) -> list[Switch]:
    cells = [c for c in view.cells if c.phase != "dead"]
    if _run_over(view):
        # Every policy: nothing left to train or roll out, so every cell serves the last version
        # (the controller's final stage waits for that before its closing eval).
        return [Switch(c.cell_id, "serve") for c in cells if c.role == "train" and _movable(c)]
    if cfg.kind == "async":
        return _fixed_pools(cells, cfg)
    if cfg.kind == "colocate":
        want: Role = "train" if view.train_demand > 0 and view.step_rollouts_done else "serve"
        return [Switch(c.cell_id, want) for c in cells if _movable(c) and c.role != want]
    return _water_level(view, cells, cfg)


def steps_to_plan(*, version: int, staleness: int, total_steps: int) -> int:
    """How many steps may have rollouts planned while ``version`` is the newest weight version.

    Step ``s`` may start its rollouts once ``version >= s - staleness``, so every call it makes is
    produced by a version its training accepts; all three policies share this bound."""
    return max(0, min(total_steps, version + staleness + 1))


def executions_at_apply(*, version: int, staleness: int, total_steps: int, planned: int, per_step: int) -> int:
    """Executions the next update (``version + 1``) lets the controller plan, ``per_step`` a step."""
    more = steps_to_plan(version=version + 1, staleness=staleness, total_steps=total_steps) - planned
    return max(0, more) * per_step


def launch_room(view: SchedulerView, cfg: SchedulerConfig) -> int:
    """Queued executions the controller may start now: the free slots of the cells serving now,
    less the core's while ``elastic`` wants the core to train (rule 2) and, while microsteps
    wait for a cell, only the slack of the cells the nearer steps' work needs for runs of steps
    further ahead (``queued_ahead``; the queue starts runs in step order), and for ``async`` only
    those of its serving pool (a cell of the training pool that still serves, as every cell does
    at the start, is about to leave, and the runs started on it would be left without a slot)."""
    serving = [c for c in view.cells if c.phase == "serving"]
    if cfg.kind == "async":
        trainers = _async_trainers([c for c in view.cells if c.phase != "dead"], cfg)
        serving = [c for c in serving if c.cell_id not in trainers]
    slots = len(serving) * cfg.capacity_per_cell
    if cfg.kind == "elastic" and len(serving) > 1 and any(c.is_core for c in serving) and _training_due(view):
        slots -= cfg.capacity_per_cell
    room = max(0, slots - view.running)
    ahead = _held_ahead(view, cfg)
    if cfg.kind == "elastic" and ahead > 0 and view.ready_microsteps > 0:
        # Lookahead: while microsteps wait for a cell, runs of steps further ahead start only in
        # the slack of the cells the nearer work holds. Started now, they would hold serving
        # cells (rule 1) that the trainable step needs, and no update would come sooner for it.
        near = view.queued - ahead + view.running
        room = min(room, max(0, math.ceil(near / cfg.capacity_per_cell) * cfg.capacity_per_cell - view.running))
    return room


def serving_need(view: SchedulerView, cfg: SchedulerConfig, num_cells: int) -> int:
    """Cells that hold all live work (queued + running; queued runs of steps further ahead wait
    for room, see ``launch_room``; stragglers that may wait, see ``stragglers``), at least
    ``min_serving_cells`` while there is or will be rollout work."""
    return _cells_for(_live(view, cfg), view, cfg, num_cells)


def tail_need(view: SchedulerView, cfg: SchedulerConfig, num_cells: int) -> int:
    """``serving_need`` counting the rollouts the update will release, once the trainable step
    has nothing left to hand out (its rollouts in, no microstep ready): they launch the moment
    it lands."""
    if not (view.step_rollouts_done and view.ready_microsteps == 0 and view.queued_at_apply > 0):
        return serving_need(view, cfg, num_cells)
    return _cells_for(_live(view, cfg) + view.queued_at_apply, view, cfg, num_cells)


def _held_ahead(view: SchedulerView, cfg: SchedulerConfig) -> int:
    """The queued runs the lookahead holds back: ``queued_ahead``, once the pipeline is full. While
    the first ``staleness`` updates are coming, every step planned so far is on the critical path
    (nothing trains ahead of it yet), so its runs start as early as they can."""
    filling = view.updates_applied is not None and view.updates_applied < cfg.staleness
    return 0 if filling or not _training_due(view) else view.queued_ahead


def running_need(view: SchedulerView, cfg: SchedulerConfig, num_cells: int) -> int:
    """Cells that hold the running executions (but the stragglers that may wait): fewer serving
    cells would starve started work."""
    return _cells_for(view.running - stragglers(view, cfg), view, cfg, num_cells)


def stragglers(view: SchedulerView, cfg: SchedulerConfig) -> int:
    """Running executions that may wait without a serving cell now (rule 1's opt-in exception):
    all of them, if they are few (``straggler_runs``), all belong to steps after the trainable
    one, nothing is queued for launch and microsteps wait for a cell; else none."""
    if cfg.kind != "elastic" or not 0 < view.running <= cfg.straggler_runs:
        return 0
    if view.running_ahead != view.running or view.ready_microsteps == 0:
        return 0
    return view.running if view.queued - _held_ahead(view, cfg) == 0 else 0


def _live(view: SchedulerView, cfg: SchedulerConfig) -> int:
    """Live work that needs serving cells: queued runs the lookahead does not hold back, and
    running ones but the stragglers that may wait."""
    return view.queued - _held_ahead(view, cfg) + view.running - stragglers(view, cfg)


def _cells_for(num_executions: int, view: SchedulerView, cfg: SchedulerConfig, num_cells: int) -> int:
    need = math.ceil(num_executions / cfg.capacity_per_cell)
    held = _held_ahead(view, cfg)
    if _live(view, cfg) > 0 or (view.rollouts_pending and not _update_gates_rollouts(view, cfg, held)):
        need = max(need, cfg.min_serving_cells)
    return min(need, num_cells)


def _update_gates_rollouts(view: SchedulerView, cfg: SchedulerConfig, held: int = 0) -> bool:
    """Nothing is live but runs the lookahead holds back (``held``), and the trainable step's
    rollouts are all in or being graded (with nothing live, a group not yet in has no run left),
    or runs are held back (they are only while the step is due to train): no rollout the update
    waits on can start before it lands (the staleness bound), so no cell needs to stand by
    serving. A cell standing by for held runs would serve nothing while microsteps wait; the held
    runs start once the step has none left to hand out (its tail), with the runs the update
    releases."""
    all_in = (view.step_rollouts_done and view.train_demand > 0) or view.grading_groups > 0
    return view.queued - held + view.running - stragglers(view, cfg) == 0 and (all_in or held > 0)


def _run_over(view: SchedulerView) -> bool:
    idle = view.train_demand <= 0 and not view.rollouts_pending and view.queued + view.running == 0
    return idle and (view.steps_left is None or view.steps_left <= 0)


def _movable(c: CellView) -> bool:
    return c.phase in STABLE and not c.busy


def _training_due(view: SchedulerView) -> bool:
    """The trainable step has work for the core now, or within the grading time."""
    return view.train_demand > 0 or view.grading_groups > 0


def _water_level(view: SchedulerView, cells: list[CellView], cfg: SchedulerConfig) -> list[Switch]:
    n = len(cells)
    serving = [c for c in cells if c.role == "serve"]
    training = [c for c in cells if c.role == "train"]
    core = next((c for c in cells if c.is_core), None)
    back = _hold_live_work(view, cfg, n, serving, training)
    if back:
        return back
    # Only cells serving now hold work now: one still turning to serve does not free another.
    holding = [c for c in serving if c.phase == "serving"]
    out = _core_switch(view, cfg, n, core, holding, serving, training)
    if out and out[0].role == "serve":
        return out
    core_trains = core is not None and (core.role == "train" or bool(out))
    return out + _satellite_switches(view, cfg, n, core, core_trains, holding, serving, training)


def _hold_live_work(view: SchedulerView, cfg: SchedulerConfig, n: int, serving: list[CellView],
                    training: list[CellView]) -> list[Switch]:
    """Rule 1: running work first (and all live work when nothing is left to train); idle
    satellites come back before the core."""
    short = running_need(view, cfg, n) - len(serving)
    if not _training_due(view):
        short = max(short, serving_need(view, cfg, n) - len(serving))
    back = sorted((c for c in training if _movable(c)), key=lambda c: (c.is_core, -c.trained_s, c.cell_id))
    return [Switch(c.cell_id, "serve") for c in back[: max(0, short)]]


def _core_switch(view: SchedulerView, cfg: SchedulerConfig, n: int, core: CellView | None, holding: list[CellView],
                 serving: list[CellView], training: list[CellView]) -> list[Switch]:
    """Rule 2: the core trains while its step has work, if the other cells hold the running work;
    if they cannot, an idle satellite comes back to take its place (the update is applied on the
    core alone), and the core goes once that one serves."""
    if core is None or core.role != "serve" or not _movable(core) or not _training_due(view):
        return []
    if len(holding) - 1 >= running_need(view, cfg, n):
        return [Switch(core.cell_id, "train")]
    idle = sorted((c for c in training if _movable(c) and not c.is_core), key=lambda c: c.cell_id)
    if idle and not any(c.phase == "to_serve" for c in serving):
        return [Switch(idle[0].cell_id, "serve")]
    return []


def _satellite_switches(view: SchedulerView, cfg: SchedulerConfig, n: int, core: CellView | None, core_trains: bool,
                        holding: list[CellView], serving: list[CellView], training: list[CellView]) -> list[Switch]:
    """Rule 3: satellites against all live work (the core's share of it waits for the core): the
    spare ones train, as many as there are microsteps for; idle ones stay until live work needs
    them, and an idle core serves queued work when there is nothing to train."""
    sat_serving = [c for c in holding if not c.is_core]
    sat_training = [c for c in training if not c.is_core]
    live_need = tail_need(view, cfg, n) - (0 if core_trains or core is None else 1)
    spare = len(sat_serving) - max(live_need, running_need(view, cfg, n))
    # The pending update (counted in train_demand once the rollouts are in) is the core's, and
    # the core takes one microstep itself.
    microsteps = view.train_demand - (1 if view.step_rollouts_done else 0) + view.grading_groups
    wanted = microsteps - (1 if core_trains else 0) - len(sat_training)
    if spare > 0 and wanted > 0:
        order = sorted((c for c in sat_serving if _movable(c)), key=lambda c: (c.num_running, c.trained_s, c.cell_id))
        return [Switch(c.cell_id, "train") for c in order[: min(spare, wanted)]]
    if spare >= 0 or (core_trains and core is not None and core.role == "serve"):
        return []
    short = -spare - sum(1 for c in serving if c.phase == "to_serve")
    idle = sorted((c for c in sat_training if _movable(c)), key=lambda c: (-c.trained_s, c.cell_id))
    out = [Switch(c.cell_id, "serve") for c in idle[: max(0, short)]]
    if short > len(idle) and core is not None and core.role == "train" and _movable(core) and not _training_due(view):
        out.append(Switch(core.cell_id, "serve"))
    return out


def _async_trainers(cells: list[CellView], cfg: SchedulerConfig) -> set[int]:
    """The fixed training pool among the live ``cells``: the core and the next ``train_cells - 1``
    by id, but never every cell while two or more live: once a cell dies, a split that left none
    serving would stall the run for good (no rollouts, so nothing more to train)."""
    core = [c for c in cells if c.is_core]
    others = sorted((c for c in cells if not c.is_core), key=lambda c: c.cell_id)
    trainers = min(cfg.train_cells, max(1, len(cells) - 1))
    return {c.cell_id for c in (core + others)[:trainers]}


def _fixed_pools(cells: list[CellView], cfg: SchedulerConfig) -> list[Switch]:
    trainers = _async_trainers(cells, cfg)
    out = []
    for c in cells:
        want: Role = "train" if c.cell_id in trainers else "serve"
        if c.role != want and _movable(c):
            out.append(Switch(c.cell_id, want))
    return out
