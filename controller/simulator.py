"""Discrete-event simulation of the elastic cells, driving the live scheduler and step coordinator.

Real here, unchanged: ``scheduler.decide`` (every policy), ``scheduler.steps_to_plan`` (the
staleness bound) and ``steps.StepCoordinator`` (microstep assignment, gradient gathering, the apply
on the core, busy cells, training demand). Simulated: cells (switch costs, weight pulls; cells
that compute, a microstep or calls in flight, share ``compute_slots``), harness runs (a start of ``launch_s``, or
with ``workload.launch_cpus`` that much CPU time shared with the other starts under way; then call and think
segments from a trace; killed at the timeout), the proxy (sticky least-loaded routing among the cells whose weight version
the execution's step may use (the floor in its token); a call whose cell leaves serving moves to another one and pays
``reroute_s``; with no such cell a call waits) and the processor (a group's shards come ``grade_s`` after its last run ends).

``release="run"`` is ``algo.release=run`` (``cellrunner/run_release.py``): each run's share of its
group's microsteps comes ``grade_s`` after *that run* ends, and the cell applies the advantage
when the group closes (exact: GSPO's loss is linear in the advantage once its sign is known, so
the cell keeps a gradient per execution). Only the embedded trainer keeps those buffers; at the
2.4T-like scale (Megatron) the figure is a what-if.

The loop around them mirrors ``controller/controller.py``: plan steps within the staleness bound,
launch queued executions while the serving cells have room, apply ``decide``'s switches, hand
microsteps to training cells holding the current version, apply on the core, publish the version
to every satellite. A serving cell keeps serving with its old weights while it loads new ones, and
each call is stamped with the version that produced it; the result says how stale the trained
data were and how long live work went without serving capacity.

``partial=True`` is a what-if for partial rollouts as slime runs them (``bench.simulate --moving
--partial``), for every policy alike: a step trains on the first groups graded, whichever step
planned them, and the groups still running when it fills train in a later step, whole (GSPO needs
every run of a group). Their calls are then as many versions staler (``max_staleness``) and the
step does not wait for its slowest run. Gyre's controller keeps each group in its own step.

A trace's ``eval`` rounds are queued as the controller's ``run.eval_every`` rounds are, once their
version is applied, at that version's floor; its ``cell_losses`` kill a satellite once their
version is applied, as a cell the controller drops: its calls move, its microsteps (and
gradients not yet sent) go back to the step's queue, and it never serves or trains again.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from controller.config import SchedulerConfig
from controller.scheduler import CellView, SchedulerView, decide, executions_at_apply, launch_room, steps_to_plan
from controller.steps import StepCoordinator
from controller.traces import Trace
from base.typed_config import build
from base.wire import GroupDone, Shard

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
EPS = 1e-9
MAX_EVENTS = 20_000_000


class SimulationStuck(RuntimeError):
    """Nothing left to happen and the run is not over: a policy that deadlocks."""


@dataclass
class SimExecution:
    execution_id: str
    step: int
    group_id: str
    segments: tuple[float, ...]
    """Alternating call and think seconds, a call first."""
    state: str = "queued"
    seg: int = 0
    launched_at: float = 0.0
    ended_at: float = 0.0
    cell: SimCell | None = None
    call_seq: int = 0
    """Bumped whenever a call entry in a cell's heap stops being valid (moved, ended)."""
    in_call: bool = False
    call_left: float = 0.0
    timed_out: bool = False
    started_at: float | None = None
    """When its harness had started (``launch_s`` after launch, or later while starts share CPUs)."""
    call_versions: list[int] = field(default_factory=list)
    train: bool = True
    """False for a held-out eval run (the trace's ``eval``): it needs serving and trains nothing."""


@dataclass
class SimCell:
    cell_id: int
    is_core: bool
    phase: str = "serving"
    version: int = 0
    switch_version: int = 0
    loading: bool = False
    sending: bool = False
    bound: int = 0
    """Live executions routed here (sticky, as the proxy binds them)."""
    vclock: float = 0.0
    """Model work done by each call here so far (processor sharing when over capacity)."""
    calls: list = field(default_factory=list)
    microstep_end: float | None = None
    """Finish time of its microstep on the shared training clock."""
    served_s: float = 0.0
    trained_s: float = 0.0
    computed_s: float = 0.0
    switches: int = 0


@dataclass(frozen=True, kw_only=True)
class SimResult:
    policy: str
    trace: str
    makespan_s: float
    step_done_s: tuple[float, ...]
    """When each weight version was published."""
    num_executions: int
    num_timed_out: int
    switches: tuple[int, ...]
    served_s: tuple[float, ...]
    trained_s: tuple[float, ...]
    computed_s: tuple[float, ...]
    max_staleness: int
    """Largest (step - oldest weight version among the calls it trained on)."""
    core_trained_steps: int
    """Steps whose update the core applied while training (the core trains every step)."""
    max_demand_wait_s: float
    """Longest time the trainable step had demand and no cell training it."""
    overcommit_s: float
    """Execution-seconds of running work beyond the serving cells' capacity."""
    stalled_call_s: float
    """Execution-seconds of calls waiting for any serving cell."""
    slot_s: float
    """Slot-seconds offered by serving cells (cells serving x capacity_per_cell, integrated)."""
    held_s: float
    """Slot-seconds holding a running execution."""
    switching_s: float
    """Cell-seconds spent switching roles."""
    call_s: float
    """Model seconds the runs asked for (their call segments), whether or not they got them."""
    cut_call_s: float
    """Model seconds the timeout cut off: what the timed-out runs had left to ask for. Stalling a
    run (colocate, while every cell trains) spends its timeout without a cell and raises this."""
    carried_groups: int = 0
    """Groups trained at a later step than the one planned for them (partial rollouts only)."""
    start_s_median: float = 0.0
    """Median seconds from a training run's launch to its harness started, or was cut by the
    timeout still starting (``launch_s`` unless ``workload.launch_cpus`` makes starts share CPUs)."""

    @property
    def makespan_h(self) -> float:
        return self.makespan_s / 3600.0


RunSource = Callable[[str, int], tuple[float, ...]]
"""(execution id, step) -> its call/think segments."""


def pool_source(trace: Trace, seed: int) -> RunSource:
    """Each planned execution draws a run from its step's slice of the pool, seeded, in planning
    order. Eval runs draw from a generator of their own, so a trace with eval rounds trains on the
    same runs as the one without."""
    rng, eval_rng = random.Random(seed), random.Random(f"eval/{seed}")

    def draw(eid: str, step: int) -> tuple[float, ...]:
        pool = trace.runs_of_step(step)
        return pool[(eval_rng if eid.startswith("eval-") else rng).randrange(len(pool))]

    return draw


def scheduler_config(trace: Trace, kind: str) -> SchedulerConfig:
    """``conf/scheduler/<kind>.yaml`` on the trace's cells: capacity, the staleness bound (matched
    across policies) and the async pool come from the trace, the rest from the policy's defaults."""
    raw = yaml.safe_load((CONF_DIR / "scheduler" / f"{kind}.yaml").read_text())
    raw.update(capacity_per_cell=trace.cells.capacity_per_cell, staleness=trace.workload.staleness)
    if kind == "async":
        raw["train_cells"] = trace.workload.async_train_cells
    return build(SchedulerConfig, raw)


Release = Literal["group", "run"]
"""When a group's shards reach the coordinator: all once its last run is graded (Gyre's processor),
or each run's share once that run is (a what-if; see the module docstring)."""


def simulate(trace: Trace, kind: str, *, seed: int = 0, runs: RunSource | None = None,
             release: Release = "group", partial: bool = False, straggler_runs: int | None = None) -> SimResult:
    """Run ``trace`` to its last step under policy ``kind``; ``runs`` replaces the trace's pool and
    ``straggler_runs`` the policy's ``scheduler.straggler_runs``."""
    cfg = scheduler_config(trace, kind)
    if straggler_runs is not None:
        cfg = build(SchedulerConfig, {**dataclasses.asdict(cfg), "straggler_runs": straggler_runs})
    sim = Simulation(trace, cfg, runs or pool_source(trace, seed), release=release, partial=partial)
    return sim.run()


class Simulation:
    def __init__(self, trace: Trace, cfg: SchedulerConfig, runs: RunSource, *, release: Release = "group",
                 partial: bool = False):
        if release not in ("group", "run"):
            raise ValueError(f"release={release!r}: 'group' or 'run'")
        if partial and release != "group":
            raise ValueError("partial rollouts fill steps with whole groups: release='group' only")
        self.release = release
        self.partial = partial
        self.filled: dict[int, int] = {}
        """Step -> groups it trains so far (``partial``: the first groups graded fill the steps in order)."""
        self.carried = 0
        """Groups trained at a later step than the one they were planned for (``partial``)."""
        self.released: dict[str, float] = {}
        """Group id -> microsteps already released by its graded runs (``release="run"``)."""
        self.trace = trace
        self.cc = trace.cells
        self.wl = trace.workload
        self.cfg = cfg
        self.runs = runs
        self.t = 0.0
        self.cells = [SimCell(cell_id=i, is_core=i == 0) for i in range(self.cc.num_cells)]
        self.core = self.cells[0]
        self.steps = StepCoordinator(core_cell=0, total_steps=self.wl.steps)
        self.planned = 0
        self.queue: deque[SimExecution] = deque()
        self.num_running = 0
        self.running_by_step: dict[int, int] = {}
        """Running training executions of each step (the scheduler's ``running_ahead``)."""
        self.waiting: list[SimExecution] = []
        self.groups: dict[str, list[SimExecution]] = {}
        self.executions: list[SimExecution] = []
        self.events: list = []
        self.seq = itertools.count()
        self.tclock = 0.0
        self.step_done: list[float] = []
        self.max_staleness = 0
        self.core_trained_steps = 0
        self.demand_since: float | None = None
        self.max_demand_wait = 0.0
        self.overcommit = 0.0
        self.stalled = 0.0
        self.slot_s = 0.0
        self.held_s = 0.0
        self.switching_s = 0.0
        self.cut_call_s = 0.0
        self.starting: list = []
        """Harness starts under way when ``workload.launch_cpus`` > 0: (start-clock at which it
        is done, seq, execution), all progressing at ``start_rate``."""
        self.sclock = 0.0
        self.dirty = True

    # ================================================================ the loop

    def run(self) -> SimResult:
        self.tick()
        for _ in range(MAX_EVENTS):
            if self.steps.version >= self.wl.steps:
                return self.result()
            t_next = self.next_time()
            if math.isinf(t_next):
                raise SimulationStuck(self.describe())
            self.advance(t_next)
            self.fire_due()
            if self.dirty and self.steps.version < self.wl.steps:
                self.tick()
        raise SimulationStuck(f"over {MAX_EVENTS} events: {self.describe()}")

    def tick(self) -> None:
        """One controller tick, repeated while it changes something (ticks are ~instant here)."""
        for _ in range(8):
            self.dirty = False
            self.plan_steps()
            self.launch()
            self.apply_schedule()
            self.drive_steps()
            self.watch_demand()
            if not self.dirty:
                return

    def next_time(self) -> float:
        best = self.events[0][0] if self.events else math.inf
        for c in self.cells:
            top = self._top_call(c)
            rate = self.call_rate(c)
            if top is not None and rate > 0:
                best = min(best, self.t + max(0.0, top[0] - c.vclock) / rate)
        active = [c.microstep_end for c in self.cells if c.microstep_end is not None]
        if active:
            best = min(best, self.t + max(0.0, min(active) - self.tclock) / self.train_rate())
        if self.starting:
            best = min(best, self.t + max(0.0, self.starting[0][0] - self.sclock) / self.start_rate())
        return best

    def advance(self, t_next: float) -> None:
        dt = t_next - self.t
        if dt <= 0:
            return
        slots = sum(1 for c in self.cells if c.phase == "serving") * self.cfg.capacity_per_cell
        self.overcommit += max(0, self.num_running - slots) * dt
        self.stalled += len(self.waiting) * dt
        self.slot_s += slots * dt
        self.held_s += min(slots, self.num_running) * dt
        self.switching_s += sum(1 for c in self.cells if c.phase in ("draining", "to_serve")) * dt
        for c in self.cells:
            c.vclock += self.call_rate(c) * dt
            if c.phase == "serving":
                c.served_s += dt
            elif c.phase == "training":
                c.trained_s += dt
            if c.microstep_end is not None:
                c.computed_s += dt
        if any(c.microstep_end is not None for c in self.cells):
            self.tclock += self.train_rate() * dt
        if self.starting:
            self.sclock += self.start_rate() * dt
        self.t = t_next

    def fire_due(self) -> None:
        while self.events and self.events[0][0] <= self.t + EPS:
            _, _, handler, args = heapq.heappop(self.events)
            handler(*args)
        for c in self.cells:
            while (top := self._top_call(c)) is not None and top[0] <= c.vclock + EPS and self.call_rate(c) > 0:
                heapq.heappop(c.calls)
                self.call_done(top[2])
        for c in self.cells:
            if c.microstep_end is not None and c.microstep_end <= self.tclock + EPS:
                self.microstep_done(c)
        while self.starting and self.starting[0][0] <= self.sclock + EPS:
            self.started(heapq.heappop(self.starting)[2])

    def at(self, delay: float, handler: Callable, *args: object) -> None:
        heapq.heappush(self.events, (self.t + delay, next(self.seq), handler, args))

    # ================================================================ rates

    def call_rate(self, c: SimCell) -> float:
        # A serving cell that loads new weights keeps serving with the old ones until the load
        # lands, as the engine does; its calls are stamped with the version that produced them.
        if c.phase != "serving":
            return 0.0
        return min(1.0, self.cfg.capacity_per_cell / max(1, c.bound)) * self.compute_share()

    def train_rate(self) -> float:
        return self.compute_share()

    def compute_share(self) -> float:
        """Speed of each computing cell: 1 while they fit in the compute slots, less beyond."""
        busy = sum(1 for c in self.cells if c.microstep_end is not None
                   or (c.phase == "serving" and self._top_call(c) is not None))
        return min(1.0, self.cc.compute_slots / max(1, busy))

    def start_rate(self) -> float:
        """Speed of each harness start under way: one CPU each while they fit in ``launch_cpus``."""
        return min(1.0, self.wl.launch_cpus / max(1, len(self.starting)))

    def _top_call(self, c: SimCell) -> tuple | None:
        while c.calls:
            v, _, ex, seq = c.calls[0]
            if ex.state == "running" and ex.call_seq == seq and ex.cell is c:
                return c.calls[0]
            heapq.heappop(c.calls)
        return None

    # ================================================================ controller: steps and launches

    def plan_steps(self) -> None:
        limit = steps_to_plan(version=self.steps.version, staleness=self.cfg.staleness, total_steps=self.wl.steps)
        while self.planned < limit:
            step = self.planned
            self.steps.plan(step, self.wl.groups_per_step)
            for g in range(self.wl.groups_per_step):
                gid = f"s{step}-g{g}"
                group = [SimExecution(execution_id=f"{gid}-e{i}", step=step, group_id=gid,
                                      segments=self.runs(f"{gid}-e{i}", step)) for i in range(self.wl.group_size)]
                self.groups[gid] = group
                self.executions += group
                self.queue.extend(group)
            self.planned += 1
            self.dirty = True

    def launch(self) -> None:
        room = launch_room(self.view(), self.cfg)
        while room > 0 and self.queue:
            ex = self.queue.popleft()
            ex.state, ex.launched_at = "running", self.t
            self.num_running += 1
            if ex.train:
                self.running_by_step[ex.step] = self.running_by_step.get(ex.step, 0) + 1
            room -= 1
            self.at(self.wl.timeout_s, self.timeout, ex)
            if self.wl.launch_cpus:
                heapq.heappush(self.starting, (self.sclock + self.wl.launch_s, next(self.seq), ex))
            else:
                self.at(self.wl.launch_s, self.started, ex)
            self.dirty = True

    def reroute_waiting(self) -> None:
        waiting, self.waiting = self.waiting, []
        for ex in waiting:
            if ex.state == "running":
                self.route(ex)

    def plan_eval(self, version: int) -> None:
        """The trace's held-out round at ``version``, behind the queued rollouts (``start_eval``)."""
        ev = self.trace.eval
        if ev is None or version % ev.every or version >= self.wl.steps:
            return
        for i in range(ev.runs):
            eid = f"eval-v{version}-e{i}"
            ex = SimExecution(execution_id=eid, step=version, group_id=f"eval-v{version}",
                              segments=self.runs(eid, version), train=False)
            self.executions.append(ex)
            self.queue.append(ex)
        self.dirty = True

    def view(self) -> SchedulerView:
        busy = self.steps.busy_cells()
        st = self.steps.current
        return SchedulerView(
            cells=tuple(CellView(cell_id=c.cell_id, role="train" if c.phase in ("draining", "training") else "serve",
                                 phase=c.phase, is_core=c.is_core, busy=c.cell_id in busy, num_running=c.bound,
                                 trained_s=c.trained_s) for c in self.cells),
            queued=len(self.queue), running=self.num_running,
            queued_ahead=sum(1 for ex in self.queue if st is not None and ex.step > st.step + 1),
            running_ahead=sum(n for step, n in self.running_by_step.items() if st is not None and step > st.step),
            rollouts_pending=self.planned < self.wl.steps,
            train_demand=self.steps.train_demand(),
            step_rollouts_done=st is not None and st.rollouts_done,
            ready_microsteps=len(st.ready) if st is not None else 0,
            queued_at_apply=executions_at_apply(version=self.steps.version, staleness=self.cfg.staleness,
                                                total_steps=self.wl.steps, planned=self.planned,
                                                per_step=self.wl.groups_per_step * self.wl.group_size),
            steps_left=self.wl.steps - self.steps.version,
            updates_applied=self.steps.version,
            grading_groups=self.grading_groups(),
        )

    def grading_groups(self) -> int:
        """Groups of the trainable step whose runs all ended, their shards still to come."""
        st = self.steps.current
        if st is None:
            return 0
        if self.partial:  # whichever groups are graded first fill the trainable step
            ended = sum(1 for g in self.groups.values() if all(e.state == "ended" for e in g))
            return min(ended, self.wl.groups_per_step - self.filled.get(st.step, 0))
        return sum(1 for g in self.groups.values() if g[0].step == st.step and all(e.state == "ended" for e in g))

    def apply_schedule(self) -> None:
        for sw in decide(self.view(), self.cfg):
            c = self.cells[sw.cell_id]
            c.switches += 1
            c.switch_version = self.steps.version
            if sw.role == "train":
                c.phase = "draining"
                self.unroute(c)
                self.at(self.cc.to_train_s, self.switched, c, "training")
            else:
                c.phase = "to_serve"
                self.at(self.cc.to_serve_s, self.switched, c, "serving")
            self.dirty = True

    def drive_steps(self) -> None:
        st = self.steps.current
        if st is None:
            return
        running = {cell for cell, _ in st.running.values()}
        free = [c.cell_id for c in self.cells if c.phase == "training" and not c.loading and not c.sending
                and c.version == self.steps.version and c.cell_id not in running]
        for cell_id, _msg in self.steps.assign(sorted(free, key=lambda i: (i != 0, i))):
            self.cells[cell_id].microstep_end = self.tclock + self.trace.microstep_s_of_step(st.step)
            self.dirty = True
        for cell_id, msg in self.steps.finish(core_training=self.core.phase == "training"):
            if msg.TAG == "send_grads":
                self.cells[cell_id].sending = True
                self.at(self.cc.grad_transfer_s, self.grads_sent, self.cells[cell_id], msg.step)
            else:
                self.at(self.cc.apply_s, self.applied, msg.step)
            self.dirty = True

    def watch_demand(self) -> None:
        """Time the trainable step has demand while no cell is training it (invariant 3)."""
        st = self.steps.current
        waiting = self.steps.train_demand() > 0 and st is not None and not st.running and not st.apply_sent
        if waiting and self.demand_since is None:
            self.demand_since = self.t
        elif not waiting and self.demand_since is not None:
            self.max_demand_wait = max(self.max_demand_wait, self.t - self.demand_since)
            self.demand_since = None

    # ================================================================ events: executions

    def started(self, ex: SimExecution) -> None:
        if ex.state == "running":
            ex.started_at = self.t
            self.start_segment(ex)

    def start_segment(self, ex: SimExecution) -> None:
        if ex.state != "running":
            return
        if ex.seg >= len(ex.segments):
            self.end(ex, timed_out=False)
        elif ex.seg % 2 == 0:
            ex.in_call, ex.call_left = True, ex.segments[ex.seg]
            self.route(ex)
        else:
            self.at(ex.segments[ex.seg], self.think_done, ex, ex.seg)

    def think_done(self, ex: SimExecution, seg: int) -> None:
        if ex.state == "running" and ex.seg == seg:
            ex.seg += 1
            self.start_segment(ex)

    def route(self, ex: SimExecution) -> None:
        """Sticky to its cell while that serves, else the least-loaded serving cell (the proxy's
        rule), among cells whose weights the execution's step may use (the floor in its token;
        an eval run's is its own version)."""
        floor = ex.step - self.cfg.staleness if ex.train else ex.step
        serving = [c for c in self.cells if c.phase == "serving" and c.version >= floor]
        if not serving:
            self.bind(ex, None)
            self.waiting.append(ex)
            return
        cell = ex.cell if ex.cell in serving else min(serving, key=lambda c: (c.bound, c.cell_id))
        self.bind(ex, cell)
        ex.call_seq += 1
        heapq.heappush(cell.calls, (cell.vclock + ex.call_left, next(self.seq), ex, ex.call_seq))

    def bind(self, ex: SimExecution, cell: SimCell | None) -> None:
        if ex.cell is cell:
            return
        if ex.cell is not None:
            ex.cell.bound -= 1
        if cell is not None:
            cell.bound += 1
        ex.cell = cell

    def unroute(self, c: SimCell) -> None:
        """``c`` left serving: its calls go elsewhere with what they had left (plus the reroute cost)."""
        moved = []
        for v, _, ex, seq in c.calls:
            if ex.state == "running" and ex.call_seq == seq and ex.cell is c:
                ex.call_left = max(0.0, v - c.vclock) + self.cc.reroute_s
                moved.append(ex)
        c.calls.clear()
        for ex in [e for e in self.executions_on(c) if e not in moved]:
            self.bind(ex, None)
        for ex in moved:
            ex.call_seq += 1
            self.bind(ex, None)
            self.route(ex)

    def executions_on(self, c: SimCell) -> list[SimExecution]:
        if c.bound == 0:
            return []
        return [ex for ex in self.executions if ex.state == "running" and ex.cell is c]

    def call_done(self, ex: SimExecution) -> None:
        ex.in_call = False
        ex.call_versions.append(ex.cell.version)
        ex.seg += 1
        self.start_segment(ex)

    def timeout(self, ex: SimExecution) -> None:
        if ex.state == "running":
            self.end(ex, timed_out=True)

    def end(self, ex: SimExecution, *, timed_out: bool) -> None:
        if timed_out:
            self.cut_call_s += self.calls_left(ex)
        if ex.started_at is None and self.starting:  # killed while its harness started: its CPU share frees
            self.starting = [item for item in self.starting if item[2] is not ex]
            heapq.heapify(self.starting)
        ex.state, ex.ended_at, ex.timed_out = "ended", self.t, timed_out
        ex.call_seq += 1
        ex.in_call = False
        self.bind(ex, None)
        if ex in self.waiting:
            self.waiting.remove(ex)
        self.num_running -= 1
        self.dirty = True
        if ex.train:
            self.running_by_step[ex.step] -= 1
        else:
            return  # an eval run: graded for the eval's mean, never trained on
        group = self.groups[ex.group_id]
        if all(e.state == "ended" for e in group):
            self.at(self.wl.grade_s, self.group_ready, ex.group_id)
        elif self.release == "run":
            self.at(self.wl.grade_s, self.run_ready, ex.group_id, ex.step)

    def calls_left(self, ex: SimExecution) -> float:
        """Model seconds ``ex`` has still to get: the rest of its current call and its later calls."""
        left = 0.0
        if ex.in_call:
            left = ex.call_left
            if ex.cell is not None:  # served now: its call's end is on the cell's clock
                left = next((max(0.0, v - ex.cell.vclock) for v, _, e, seq in ex.cell.calls
                             if e is ex and seq == ex.call_seq), ex.call_left)
        later = range(ex.seg + (1 if ex.in_call else 0), len(ex.segments))
        return left + sum(ex.segments[j] for j in later if j % 2 == 0)

    def run_ready(self, gid: str, step: int) -> None:
        """What-if: one graded run releases its share of the group's microsteps (whole ones only)."""
        if gid not in self.groups:
            return
        before = self.released.get(gid, 0.0)
        n = self.trace.microsteps_of_step(step)
        after = before + n / self.wl.group_size
        self.released[gid] = after
        for k in range(int(before + EPS), min(int(after + EPS), n)):
            self.steps.on_shard(Shard(step=step, shard_id=f"{gid}-m{k}", num_executions=0, sequences=[]))
            self.dirty = True

    def group_ready(self, gid: str) -> None:
        group = self.groups.pop(gid)
        step = self.step_to_fill(group[0].step)
        versions = [v for ex in group for v in ex.call_versions]
        if versions:
            self.max_staleness = max(self.max_staleness, step - min(versions))
        n = self.trace.microsteps_of_step(group[0].step)  # the group's own data, wherever it trains
        first = min(int(self.released.pop(gid, 0.0) + EPS), n - 1)  # the last shard carries the group
        for k in range(first, n):
            self.steps.on_shard(Shard(step=step, shard_id=f"{gid}-m{k}", num_executions=len(group) if k == first else 0,
                                      sequences=[]))
        self.steps.on_group_done(GroupDone(group_id=gid, step=step, num_usable=len(group), mean_reward=0.0))
        self.dirty = True

    def step_to_fill(self, planned: int) -> int:
        """The step a graded group trains in: the one it was planned for, or with ``partial`` the
        first step not yet full from the trainable one on (slime's partial rollouts, the group
        kept whole: a step trains on the first groups graded, and the ones still running when it
        fills go to a later step, their calls up to that many versions staler). A slot is always
        there: every step planned so far expects as many groups as were planned."""
        if not self.partial:
            return planned
        step = self.steps.version
        while self.filled.get(step, 0) >= self.wl.groups_per_step:
            step += 1
        self.filled[step] = self.filled.get(step, 0) + 1
        self.carried += step > planned
        return step

    # ================================================================ events: cells

    def switched(self, c: SimCell, phase: str) -> None:
        if c.phase == "dead":
            return
        c.phase = phase
        c.version = self.steps.version if c.is_core else c.switch_version
        if c.version < self.steps.version:
            self.load(c)
        if phase == "serving":
            self.reroute_waiting()
        self.dirty = True

    def load(self, c: SimCell) -> None:
        c.loading = True
        self.at(self.cc.weight_transfer_s, self.loaded, c, self.steps.version)

    def loaded(self, c: SimCell, version: int) -> None:
        if c.phase == "dead":
            return
        c.loading = False
        c.version = max(c.version, version)
        if c.version < self.steps.version and c.phase in ("serving", "training"):
            self.load(c)
        if c.phase == "serving":
            self.reroute_waiting()
        self.dirty = True

    def microstep_done(self, c: SimCell) -> None:
        c.microstep_end = None
        st = self.steps.current
        shard_id = next(sid for sid, (cell, _) in st.running.items() if cell == c.cell_id)
        self.steps.on_microstep_done(c.cell_id, st.step, shard_id, 0.0, 0)
        self.dirty = True

    def grads_sent(self, c: SimCell, step: int) -> None:
        if c.phase == "dead":
            return  # lost with it: on_cell_lost put its microsteps back
        c.sending = False
        self.steps.on_grads_sent(c.cell_id, step)
        self.dirty = True

    def applied(self, step: int) -> None:
        if self.core.phase == "training":
            self.core_trained_steps += 1
        self.steps.on_step_applied(step, step + 1)
        self.step_done.append(self.t)
        for c in self.cells:
            if c.is_core:
                c.version = self.steps.version
            elif c.phase in ("serving", "training"):
                self.load(c)
        for loss in self.trace.cell_losses:
            if loss.at_version == self.steps.version:
                self.lose(self.cells[loss.cell])
        self.plan_eval(self.steps.version)
        self.dirty = True

    def lose(self, c: SimCell) -> None:
        """A satellite gone for good, as the controller drops a silent cell: its calls move to
        serving cells (paying ``reroute_s``), its microsteps and unsent gradients are trained again."""
        serving = c.phase == "serving"
        c.phase, c.microstep_end, c.loading, c.sending = "dead", None, False, False
        if serving:
            self.unroute(c)
        self.steps.on_cell_lost(c.cell_id)
        self.dirty = True

    # ================================================================ output

    def result(self) -> SimResult:
        if self.demand_since is not None:
            self.max_demand_wait = max(self.max_demand_wait, self.t - self.demand_since)
        ended = [ex for ex in self.executions if ex.state == "ended" and ex.train]
        return SimResult(
            policy=self.cfg.kind, trace=self.trace.name, makespan_s=self.t, step_done_s=tuple(self.step_done),
            num_executions=len(ended), num_timed_out=sum(1 for ex in ended if ex.timed_out),
            switches=tuple(c.switches for c in self.cells), served_s=tuple(c.served_s for c in self.cells),
            trained_s=tuple(c.trained_s for c in self.cells), computed_s=tuple(c.computed_s for c in self.cells),
            max_staleness=self.max_staleness, core_trained_steps=self.core_trained_steps,
            max_demand_wait_s=self.max_demand_wait, overcommit_s=self.overcommit, stalled_call_s=self.stalled,
            slot_s=self.slot_s, held_s=self.held_s, switching_s=self.switching_s,
            call_s=sum(sum(ex.segments[0::2]) for ex in self.executions), cut_call_s=self.cut_call_s,
            carried_groups=self.carried, start_s_median=statistics.median([
                (ex.ended_at if ex.started_at is None else ex.started_at) - ex.launched_at for ex in ended] or [0.0]),
        )

    def describe(self) -> str:
        phases = " ".join(f"{c.cell_id}:{c.phase}{'(L)' if c.loading else ''}" for c in self.cells)
        st = self.steps.current
        return (f"t={self.t:.1f}s version {self.steps.version}/{self.wl.steps} planned {self.planned} "
                f"queued {len(self.queue)} running {self.num_running} waiting {len(self.waiting)} "
                f"demand {self.steps.train_demand()} rollouts_done {st.rollouts_done if st else None} | {phases}")
