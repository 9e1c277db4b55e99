"""Step coordination: shards in, microsteps out to training cells, gradients combined, versions.

Step ``s`` turns weight version ``s`` into ``s + 1``. Its shards stream in from the processor as
groups complete (or, with ``algo.release=run``, as each execution is graded); each goes to a
training cell holding version ``s`` as soon as one is free. When every group of the step is in and
every shard is done, satellites push their gradient sums to the core, and the core applies the
update; both orders carry every group's ``GroupStats``, which turn run-released gradients into
advantage-weighted ones. No tensor passes through here: only ids, counts and group statistics.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field

from base.checkpoints import due
from base.wire import ApplyStep, GroupDone, GroupStats, RunMicrostep, SendGrads, Shard

log = logging.getLogger(__name__)


@dataclass
class StepState:
    step: int
    groups_expected: int
    groups_done: int = 0
    groups_dropped: int = 0
    num_executions: int = 0
    rewards: list[float] = field(default_factory=list)
    groups: dict[str, GroupStats] = field(default_factory=dict)
    """Each closed group's advantage statistics (or ``dropped``), for the cells' run-released shards."""
    ready: deque[Shard] = field(default_factory=deque)
    shard_ids: set[str] = field(default_factory=set)
    """Every shard taken for this step: a resent one (the processor restarted before it logged our
    ``Delivered``) is dropped by id, never trained twice."""
    running: dict[str, tuple[int, Shard]] = field(default_factory=dict)  # shard_id -> (cell, shard)
    done_by_cell: dict[int, list[Shard]] = field(default_factory=dict)
    grads_wanted: set[int] = field(default_factory=set)
    grads_sent: set[int] = field(default_factory=set)
    apply_sent: bool = False
    loss: float = 0.0
    num_tokens: int = 0

    @property
    def rollouts_done(self) -> bool:
        return self.groups_done >= self.groups_expected

    @property
    def mean_reward(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None


class StepCoordinator:
    def __init__(self, *, core_cell: int, total_steps: int, checkpoint_every: int = 0):
        self.core_cell = core_cell
        self.total_steps = total_steps
        self.checkpoint_every = checkpoint_every
        self.version = 0
        self.steps: dict[int, StepState] = {}

    def plan(self, step: int, num_groups: int) -> None:
        st = self.steps.setdefault(step, StepState(step=step, groups_expected=0))
        st.groups_expected += num_groups

    @property
    def current(self) -> StepState | None:
        return self.steps.get(self.version)

    # -- inputs ------------------------------------------------------------------------------

    def on_shard(self, shard: Shard) -> None:
        st = self.steps.get(shard.step)
        if shard.step < self.version:
            log.warning("shard %s for step %d, already applied (version %d): a resend; dropped",
                        shard.shard_id, shard.step, self.version)
            return
        if st is None:
            log.error("shard %s for step %d which is not open (version %d); dropped", shard.shard_id, shard.step, self.version)
            return
        if shard.shard_id in st.shard_ids:
            log.warning("shard %s of step %d taken before: a resend; dropped", shard.shard_id, shard.step)
            return
        st.shard_ids.add(shard.shard_id)
        if not _trainable(st, shard):
            log.info("shard %s of dropped group %s: not trained", shard.shard_id, shard.group_id)
            return
        st.ready.append(shard)

    def is_new_group(self, msg: GroupDone) -> bool:
        """False for a GroupDone taken before (a resend after a processor restart) or of a step
        already applied."""
        st = self.steps.get(msg.step)
        if st is None:
            return msg.step >= self.version
        return msg.group_id not in st.groups

    def on_group_done(self, msg: GroupDone) -> bool:
        """Count a finished group; True if it was dropped (the caller may plan a replacement)."""
        st = self.steps.get(msg.step)
        if st is None:
            log.error("group %s for unknown step %d", msg.group_id, msg.step)
            return False
        st.groups_done += 1
        st.groups[msg.group_id] = GroupStats(
            group_id=msg.group_id, mean_reward=msg.mean_reward or 0.0, adv_divisor=msg.adv_divisor,
            dropped=bool(msg.dropped),
        )
        if msg.dropped:
            st.groups_dropped += 1
            st.ready = deque(s for s in st.ready if _trainable(st, s))  # its run-released shards
            return True
        st.num_executions += msg.num_usable
        if msg.mean_reward is not None:
            st.rewards.append(msg.mean_reward)
        return False

    def on_microstep_done(self, cell_id: int, step: int, shard_id: str, loss: float, num_tokens: int) -> Shard | None:
        """The shard that cell finished (None, logged, if it was not assigned to it)."""
        st = self.steps.get(step)
        if st is None or shard_id not in st.running:
            log.error("microstep %s of step %d from cell %d was not assigned", shard_id, step, cell_id)
            return None
        _, shard = st.running.pop(shard_id)
        st.done_by_cell.setdefault(cell_id, []).append(shard)
        st.loss += loss
        st.num_tokens += num_tokens
        return shard

    def on_grads_sent(self, cell_id: int, step: int, late_loss: float = 0.0) -> None:
        st = self.steps.get(step)
        if st is not None:
            st.grads_sent.add(cell_id)
            st.loss += late_loss

    def on_step_applied(self, step: int, version: int, late_loss: float = 0.0) -> StepState:
        st = self.steps.pop(step)
        st.loss += late_loss
        self.version = version
        return st

    def on_cell_lost(self, cell_id: int) -> None:
        """Its running and completed-but-unsent microsteps go back to the queue: nothing is lost."""
        for st in self.steps.values():
            for sid, (cell, shard) in list(st.running.items()):
                if cell == cell_id:
                    del st.running[sid]
                    if _trainable(st, shard):
                        st.ready.appendleft(shard)
            if cell_id not in st.grads_sent:
                for shard in st.done_by_cell.pop(cell_id, []):
                    if _trainable(st, shard):
                        st.ready.appendleft(shard)
                st.grads_wanted.discard(cell_id)

    # -- outputs ------------------------------------------------------------------------------

    def busy_cells(self) -> set[int]:
        busy: set[int] = set()
        for st in self.steps.values():
            busy |= {cell for cell, _ in st.running.values()}
            busy |= {c for c in st.done_by_cell if c not in st.grads_sent}
            if st.apply_sent:
                busy.add(self.core_cell)
        return busy

    def train_demand(self) -> int:
        st = self.current
        if st is None:
            return 0
        pending = 1 if (st.rollouts_done and st.num_executions > 0) else 0
        return len(st.ready) + len(st.running) + pending

    def assign(self, cells: list[int], *, in_flight: int = 1) -> list[tuple[int, RunMicrostep]]:
        """Give ready shards of the trainable step to ``cells`` (training cells holding its version,
        in the order to serve them) until each has ``in_flight`` running.

        A cell runs its microsteps in order, so a second one queued behind the running one starts
        the moment the first ends instead of a controller round trip later (the controller may be
        busy launching a step's harnesses just then). Queuing ahead only happens while the ready
        shards are at least one per cell: with fewer, the last ones wait for whichever cell frees
        first, so a step's end is not held behind a cell with two to do.
        """
        st = self.current
        out: list[tuple[int, RunMicrostep]] = []
        if st is None:
            return out
        running = Counter(cell for cell, _ in st.running.values())
        for depth in range(1, in_flight + 1):
            if depth > 1 and len(st.ready) < len(cells):
                break
            for cell in cells:
                if not st.ready:
                    return out
                if running[cell] >= depth:
                    continue
                shard = st.ready.popleft()
                st.running[shard.shard_id] = (cell, shard)
                running[cell] += 1
                out.append((cell, RunMicrostep(shard=shard)))
        return out

    def finish(self, *, core_training: bool) -> list[tuple[int, SendGrads | ApplyStep]]:
        """Once the step's data is all trained: gather satellite gradients, then apply on the core
        (only while the core is in the training phase: it holds the optimizer)."""
        st = self.current
        if st is None or not st.rollouts_done or st.ready or st.running or st.apply_sent:
            return []
        if st.num_executions == 0:
            return []  # every group dropped: the caller plans replacements
        out: list[tuple[int, SendGrads | ApplyStep]] = []
        satellites = {c for c in st.done_by_cell if c != self.core_cell}
        for cell in sorted(satellites - st.grads_wanted):
            st.grads_wanted.add(cell)
            out.append((cell, SendGrads(step=st.step, groups=list(st.groups.values()))))
        if core_training and st.grads_wanted <= st.grads_sent:
            st.apply_sent = True
            out.append((self.core_cell, ApplyStep(
                step=st.step, satellite_cells=sorted(st.grads_sent), num_executions=st.num_executions,
                checkpoint=due(st.step + 1, self.checkpoint_every), groups=list(st.groups.values()),
            )))
        return out


def _trainable(st: StepState, shard: Shard) -> bool:
    """False for a run-released shard whose group was dropped: its gradient would be thrown away."""
    stats = st.groups.get(shard.group_id) if shard.run_released else None
    return stats is None or not stats.dropped
