"""The trajectory processor: CallRecords and grades in, shards out. The decisions only: no
sockets, no log, no clock.

Three layers, each testable alone, each in its own module:

- ``Processor`` (here) — the state machine, no I/O. ``on_record`` / ``on_sealed`` / ``on_grade``
  take decoded messages and return the messages to send (``ShardReady``..., ``GroupDone``,
  ``ErrorReply``); ``take_facts`` hands over the ``ExecutionFacts`` of executions done since.
- ``trajectory.delivery.ProcessorService`` — decodes frames, appends the valid ones to the
  ``AppendLog`` *before* processing (and acknowledging) them, rebuilds the state from the log on
  start, and logs a marker for a group (or a run-released execution) once the controller has taken
  all of its messages, so a restart sends again exactly what may not have arrived.
- ``trajectory.service.serve`` — the ZMQ loop: a ``RecordInbox`` (ROUTER) bound for records (from
  the proxy, each acknowledged once logged; a restarted proxy's ``SessionReplayRequest`` is
  answered there with the execution's logged records, ``trajectory.session_replay``), DEALER
  connected to the controller (``Hello``, then ``Grade`` and ``Delivered`` in, ``ShardReady`` /
  ``GroupDone`` / ``ErrorReply`` out).

Grading rules. An execution is *usable* when its outcome is ``finished`` or ``timed_out`` and its
reward is not None (the controller grades timed-out runs from their workspace), or when it
``crashed`` after the policy acted in it: graded from its workspace, with at least one call
recorded. A crash is then no way out of a 0 the policy earned (a harness killed from inside is the
agent's doing); a crash before any call was answered is none of the policy's doing, and is
excluded and counted, as are grader failures (reward None), never a reward of 0. So is a *cut*
execution: sealed with fewer calls received than the proxy recorded, or with a record the tree
refused. Its reward belongs to the whole run, but only part of the run's tokens would be trained,
so the credit would land on the wrong tokens; it is excluded from training and from its group's
statistics, like a grader failure. ``Grade.train`` False
marks an eval execution: its records are discarded and it joins no group. A group is complete
when each of its ``group_size`` members has a Grade and an ExecutionSealed (they come on
different sockets, in any order). With fewer than ``min_usable`` usable executions it is dropped
(``GroupDone(dropped="too_few_usable")``); else its shards go out, then ``GroupDone`` (with
``mean_reward`` and ``adv_divisor``, from which each member's advantage follows).

Run release (``algo.release="run"``). A usable train execution's shards go out the moment it has
both its Grade and its ExecutionSealed, without waiting for its group: one execution per shard,
advantage 0, ``reward`` and ``group_id`` set (``trajectory.run_release``); its token tree is then
freed and later records for it are late. The group's completion sends only its ``GroupDone``,
always after every shard of the group; a dropped group's shards have already gone out, and the
controller and cells discard them on ``dropped``.

Delivery (at least once, effectively once) is ``trajectory.delivery``'s: the ``Processor`` only
has to skip rebuilding what its log says already went out (``expect_sent_before``,
``mark_group_done``).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from base.wire import (
    CallRecord,
    ErrorReply,
    ExecutionFacts,
    ExecutionSealed,
    Grade,
    GroupDone,
    Message,
    Shard,
    ShardReady,
)
from base.wire import Sequence as TrainingSequence
from base.advantages import advantage, group_stats
from base.algo_config import AlgoConfig
from trajectory.run_release import run_released_shards
from trajectory.samples import build_sequences, pack_shards
from trajectory.sampling import select
from trajectory.tree import TokenTree

log = logging.getLogger(__name__)

USABLE_OUTCOMES = ("finished", "timed_out")
UNTRAINED_LINEAGES = ("side",)
"""Calls whose output the tree never trains (``trajectory.tree``: side calls add no path)."""
DROPPED_TOO_FEW_USABLE = "too_few_usable"

@dataclass
class Counters:
    """Cumulative counts of this process (rebuilt by a replay); ``metrics()`` names them."""

    num_records: int = 0
    num_duplicate_records: int = 0
    num_side_calls: int = 0
    num_hung_up_calls: int = 0
    """Calls the harness hung up on before any output (recorded with finish ``abort``)."""
    num_late_records: int = 0
    """Records or seals for an execution whose group (or eval run) is already done."""
    num_eval_records: int = 0
    num_eval_executions: int = 0
    num_rejected: int = 0
    num_duplicate_grades: int = 0
    num_incomplete_executions: int = 0
    """Sealed with fewer distinct calls received than ``ExecutionSealed.num_calls`` says, or with a
    record the tree refused: excluded from training (``num_excluded_cut`` counts those in groups)."""
    num_excluded_cut: int = 0
    num_excluded_crashed: int = 0
    num_excluded_grade_failed: int = 0
    num_empty_executions: int = 0
    """Usable executions without a single training target (no calls, or no policy tokens)."""
    num_main_mostly_dropped: int = 0
    """Executions whose untrained (side-labelled) output outweighed the main agent's: warned in the log."""
    num_groups_emitted: int = 0
    num_groups_dropped: int = 0
    num_groups_replayed: int = 0
    """Completed again while replaying the log, but already sent before the restart: not rebuilt."""
    num_executions_released: int = 0
    """Run release: executions whose shards went out before their group closed."""
    num_executions_replayed: int = 0
    """Run release: released again while replaying the log, but already sent: not rebuilt."""
    num_shards: int = 0
    num_sequences: int = 0
    num_targets: int = 0

    def metrics(self) -> dict[str, int]:
        """Slash-named counters (sum across processors)."""
        return {f"trajectory/{f.name.removeprefix('num_')}": getattr(self, f.name) for f in fields(self)}


def _usable(grade: Grade) -> bool:
    return grade.outcome in USABLE_OUTCOMES and grade.reward is not None


@dataclass
class _Facts:
    """Running counts of one execution's calls, for ``ExecutionFacts`` (train and eval alike)."""

    calls: int = 0
    by_lineage: Counter = field(default_factory=Counter)
    hung_up: int = 0
    agents: set[str] = field(default_factory=set)
    prompt_tokens: int = 0
    output_tokens: int = 0
    tool_calls: int = 0
    call_s: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    main_output_tokens: int = 0
    untrained_output_tokens: int = 0
    reasons: Counter = field(default_factory=Counter)
    sent: bool = False

    def add(self, record: CallRecord) -> None:
        self.calls += 1
        self.by_lineage[record.lineage] += 1
        self.reasons[record.lineage_reason or "unknown"] += 1
        if record.lineage in UNTRAINED_LINEAGES:
            self.untrained_output_tokens += len(record.output_ids)
        elif record.lineage in ("main", "main-summary"):
            self.main_output_tokens += len(record.output_ids)
        self.hung_up += record.finish_reason == "abort" and not record.output_ids
        if record.lineage in ("sub-agent", "sub-agent-summary") and record.agent_id:
            self.agents.add(record.agent_id)
        self.prompt_tokens += len(record.prompt_ids)
        self.output_tokens += len(record.output_ids)
        self.tool_calls += record.num_tool_calls
        self.call_s.append(max(record.finished_at - record.started_at, 0.0))
        self.versions.append(record.weight_version)

    def message(self, execution_id: str, *, step: int, tree_tokens: int) -> ExecutionFacts:
        lin = self.by_lineage
        stale = [step - v for v in self.versions]
        return ExecutionFacts(
            execution_id=execution_id, num_calls=self.calls, main_calls=lin["main"],
            summary_calls=lin["main-summary"] + lin["sub-agent-summary"], sub_agent_calls=lin["sub-agent"],
            side_calls=lin["side"], hung_up_calls=self.hung_up, num_sub_agents=len(self.agents),
            prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens, tool_calls=self.tool_calls,
            tree_tokens=tree_tokens, call_s_sum=sum(self.call_s), call_s_max=max(self.call_s, default=0.0),
            staleness_mean=sum(stale) / len(stale) if stale else 0.0, staleness_max=max(stale, default=0),
            main_output_tokens=self.main_output_tokens, untrained_output_tokens=self.untrained_output_tokens,
            lineage_reasons=dict(self.reasons.most_common(64)),
        )

    def main_mostly_dropped(self) -> bool:
        """More of the policy's output went untrained for its label than the main agent wrote: a
        harness whose main line the proxy mislabelled ``side`` looks like this."""
        return self.untrained_output_tokens > self.main_output_tokens


@dataclass
class _Execution:
    tree: TokenTree | None
    """None once a grade says this is an eval run: its records are discarded."""
    call_ids: set[str] = field(default_factory=set)
    grade: Grade | None = None
    sealed: ExecutionSealed | None = None
    facts: _Facts = field(default_factory=_Facts)
    num_refused: int = 0
    """Records the tree refused: the execution is cut."""


@dataclass
class _Group:
    group_id: str
    step: int
    group_size: int
    members: dict[str, Grade] = field(default_factory=dict)


class Processor:
    """The processor's state machine; see the module docstring for the rules."""

    def __init__(self, *, algo: AlgoConfig, min_usable: int, max_trajectories: int) -> None:
        if max_trajectories < 1:
            raise ValueError(f"max_trajectories: want >= 1, got {max_trajectories}")
        if algo.max_tokens_per_microstep < 1:
            raise ValueError("max_tokens_per_microstep: want >= 1")
        self.algo = algo
        self.run_release = algo.release == "run"
        self.min_usable = min_usable
        self.max_trajectories = max_trajectories
        self.counters = Counters()
        self._executions: dict[str, _Execution] = {}
        self._groups: dict[str, _Group] = {}
        self._done_executions: set[str] = set()
        self._done_groups: set[str] = set()
        self._sent_before: set[str] = set()
        self._released_before: set[str] = set()
        self._facts: list[ExecutionFacts] = []
        self._cut: set[str] = set()
        """Train executions sealed cut (see the module docstring), until their group completes."""
        self._sealed_calls: dict[str, int] = {}
        """Train executions' ``ExecutionSealed.num_calls`` until their group is done: a crash counts only after a call."""

    # ------------------------------------------------------------------ inputs

    def on_message(self, msg: Message) -> list[Message]:
        if isinstance(msg, CallRecord):
            return self.on_record(msg)
        if isinstance(msg, ExecutionSealed):
            return self.on_sealed(msg)
        if isinstance(msg, Grade):
            return self.on_grade(msg)
        raise TypeError(f"processor: no handler for {type(msg).__name__}")

    def on_record(self, record: CallRecord) -> list[Message]:
        if record.execution_id in self._done_executions:
            self.counters.num_late_records += 1
            return []
        ex = self._execution(record.execution_id)
        if record.call_id in ex.call_ids:
            self.counters.num_duplicate_records += 1
            return []
        ex.facts.add(record)
        if ex.tree is None:
            ex.call_ids.add(record.call_id)
            self.counters.num_eval_records += 1
            return []
        try:
            self._check_sampling(record)
            inserted = ex.tree.insert(record)
        except ValueError as exc:
            self.counters.num_rejected += 1
            ex.num_refused += 1
            log.warning("call_record rejected: %s (execution %s, call %s)", exc, record.execution_id, record.call_id)
            return []
        ex.call_ids.add(record.call_id)
        self.counters.num_records += 1
        if not inserted and record.lineage == "side":
            self.counters.num_side_calls += 1
        elif not inserted:
            self.counters.num_hung_up_calls += 1
        return []

    def _check_sampling(self, record: CallRecord) -> None:
        """A training call must have been sampled as the trainer scores it (``algo.rollout``); any
        other behaviour log-probs would bias every ratio of the trajectory. The proxy enforces it, so
        this refuses only records of another run's config (a resumed run whose rollout changed)."""
        r = self.algo.rollout
        if (record.temperature, record.top_p, record.top_k) != (r.temperature, r.top_p, r.top_k):
            raise ValueError(f"sampled at temperature {record.temperature}, top_p {record.top_p}, top_k {record.top_k}; "
                             f"the run trains at algo.rollout {r.temperature}, {r.top_p}, {r.top_k}")

    def on_sealed(self, sealed: ExecutionSealed) -> list[Message]:
        if sealed.execution_id in self._done_executions:
            self.counters.num_late_records += 1
            return []
        ex = self._execution(sealed.execution_id)
        if ex.sealed is not None:
            self.counters.num_duplicate_records += 1
            return []
        ex.sealed = sealed
        self._sealed_calls[sealed.execution_id] = sealed.num_calls
        self._note_facts(sealed.execution_id)
        if len(ex.call_ids) < sealed.num_calls or ex.num_refused:
            self.counters.num_incomplete_executions += 1
            if ex.grade is None or ex.grade.train:
                self._cut.add(sealed.execution_id)
            log.warning(
                "execution %s sealed with %d of %d calls received and %d refused: cut, excluded from training",
                sealed.execution_id, len(ex.call_ids), sealed.num_calls, ex.num_refused,
            )
        if ex.grade is None:
            return []
        if not ex.grade.train:
            self._forget_execution(sealed.execution_id)
            return []
        group = self._groups[ex.grade.group_id]
        return self._maybe_release(sealed.execution_id) + self._maybe_complete(group)

    def on_grade(self, grade: Grade) -> list[Message]:
        eid = grade.execution_id
        if eid in self._done_executions:
            self.counters.num_duplicate_grades += 1
            return []
        ex = self._executions.get(eid)
        if ex is not None and ex.grade is not None:
            if ex.grade == grade:
                self.counters.num_duplicate_grades += 1
                return []
            return [self._reject_grade(grade, "execution already has a different grade")]
        if not grade.train:
            self._cut.discard(eid)  # eval runs are scored, never trained
            ex = self._execution(eid)
            ex.grade, ex.tree = grade, None
            self.counters.num_eval_executions += 1
            self._note_facts(eid)
            if ex.sealed is not None:
                self._forget_execution(eid)
            return []
        if grade.group_id in self._done_groups:
            return [self._reject_grade(grade, "its group is already done")]
        group = self._groups.get(grade.group_id)
        if group is None:
            group = _Group(grade.group_id, grade.step, grade.group_size)
        elif (group.step, group.group_size) != (grade.step, grade.group_size):
            return [self._reject_grade(
                grade, f"group has step={group.step} group_size={group.group_size}"
            )]
        elif len(group.members) >= group.group_size:
            return [self._reject_grade(grade, f"group already has {group.group_size} members")]
        self._groups[grade.group_id] = group
        group.members[eid] = grade
        self._execution(eid).grade = grade
        self._note_facts(eid)
        return self._maybe_release(eid) + self._maybe_complete(group)

    def expect_sent_before(self, group_ids: set[str], execution_ids: Iterable[str] = ()) -> None:
        """Groups a replay will complete again (and, run release, executions it will release
        again) whose messages already went out: skip building them."""
        self._sent_before |= group_ids
        self._released_before.update(execution_ids)

    def mark_group_done(self, group_id: str) -> None:
        """Forget a group whose messages already went out (a replayed marker)."""
        group = self._groups.pop(group_id, None)
        if group is not None:
            for eid in group.members:
                self._forget_execution(eid)
                self._sealed_calls.pop(eid, None)
        self._done_groups.add(group_id)

    @property
    def num_open_groups(self) -> int:
        return len(self._groups)

    @property
    def num_open_executions(self) -> int:
        return len(self._executions)

    # ------------------------------------------------------------------ groups

    def _maybe_complete(self, group: _Group) -> list[Message]:
        if len(group.members) < group.group_size:
            return []
        if not all(self._is_sealed(eid) for eid in group.members):
            return []
        if group.group_id in self._sent_before:
            self._sent_before.discard(group.group_id)
            self.counters.num_groups_replayed += 1
            self.mark_group_done(group.group_id)
            return []
        out = self._assemble(group)
        self.mark_group_done(group.group_id)
        return out

    def _assemble(self, group: _Group) -> list[Message]:
        grades = sorted(group.members.values(), key=lambda g: g.execution_id)
        usable = [g for g in grades if self._trainable(g)]
        for g in grades:
            if g.outcome == "crashed" and g not in usable:
                self.counters.num_excluded_crashed += 1
            elif g.reward is None:
                self.counters.num_excluded_grade_failed += 1
            elif g.execution_id in self._cut:
                self.counters.num_excluded_cut += 1
            self._cut.discard(g.execution_id)
        rewards = [g.reward for g in usable if g.reward is not None]
        mean_reward = math.fsum(rewards) / len(rewards) if rewards else None
        if len(usable) < max(self.min_usable, 1):
            self.counters.num_groups_dropped += 1
            log.info(
                "group %s (step %d) dropped: %d usable of %d, want %d",
                group.group_id, group.step, len(usable), group.group_size, self.min_usable,
            )
            return [GroupDone(
                group_id=group.group_id, step=group.step, num_usable=len(usable),
                mean_reward=mean_reward, dropped=DROPPED_TOO_FEW_USABLE,
            )]
        mean, divisor = group_stats(rewards, adv_eps=self.algo.adv_eps)
        # Run release: the members' shards already went out; the cells apply mean and divisor.
        shards = [] if self.run_release else self._group_shards(group, usable, mean, divisor)
        self.counters.num_groups_emitted += 1
        self._count_shards(shards)
        log.info(
            "group %s (step %d) done: %d usable of %d, mean reward %.4f, %d shard(s)",
            group.group_id, group.step, len(usable), group.group_size, mean_reward, len(shards),
        )
        out: list[Message] = [ShardReady(shard=s) for s in shards]
        out.append(GroupDone(
            group_id=group.group_id, step=group.step, num_usable=len(usable), mean_reward=mean_reward,
            adv_divisor=divisor,
        ))
        return out

    def _group_shards(self, group: _Group, usable: list[Grade], mean: float, divisor: float) -> list[Shard]:
        per_execution = [
            self._sequences(g.execution_id, advantage(g.reward, mean, divisor))
            for g in usable
            if g.reward is not None
        ]
        return pack_shards(
            group_id=group.group_id, step=group.step, per_execution=per_execution,
            max_tokens=self.algo.max_tokens_per_microstep,
        )

    def _sequences(self, execution_id: str, adv: float) -> list[TrainingSequence]:
        tree = self._executions[execution_id].tree
        assert tree is not None  # train executions keep their tree until their data is built
        kept = select(tree.trajectories(), max_trajectories=self.max_trajectories)
        sequences = build_sequences(execution_id, kept, advantage=adv)
        if not sequences:
            self.counters.num_empty_executions += 1
        return sequences

    # ------------------------------------------------------------------ run release

    def _maybe_release(self, execution_id: str) -> list[Message]:
        """Run release: a train execution graded and sealed sends its data now (when usable).

        Either way it is done with: its tree is freed (the group keeps its grade), and what
        still arrives for it is late.
        """
        ex = self._executions[execution_id]
        if not self.run_release or ex.grade is None or ex.sealed is None:
            return []
        grade = ex.grade
        if not self._trainable(grade):  # counted when its group completes
            self._forget_execution(execution_id)
            return []
        if execution_id in self._released_before:
            self._released_before.discard(execution_id)
            self.counters.num_executions_replayed += 1
            self._forget_execution(execution_id)
            return []
        sequences = self._sequences(execution_id, 0.0)
        self._forget_execution(execution_id)
        if not sequences:
            return []
        shards = run_released_shards(grade, sequences, max_tokens=self.algo.max_tokens_per_microstep)
        self.counters.num_executions_released += 1
        self._count_shards(shards)
        return [ShardReady(shard=s) for s in shards]

    def _trainable(self, grade: Grade) -> bool:
        if grade.execution_id in self._cut or grade.reward is None:
            return False
        if grade.outcome == "crashed":
            return self._sealed_calls.get(grade.execution_id, 0) > 0
        return _usable(grade)

    def _count_shards(self, shards: list[Shard]) -> None:
        self.counters.num_shards += len(shards)
        for shard in shards:
            self.counters.num_sequences += len(shard.sequences)
            self.counters.num_targets += sum(sum(s.target_mask) for s in shard.sequences)

    # ------------------------------------------------------------------ helpers

    def _execution(self, execution_id: str) -> _Execution:
        ex = self._executions.get(execution_id)
        if ex is None:
            ex = self._executions[execution_id] = _Execution(tree=TokenTree(execution_id))
        return ex

    def _note_facts(self, execution_id: str) -> None:
        """Queue the execution's ``ExecutionFacts``, once: when it is both graded and sealed."""
        ex = self._executions[execution_id]
        if ex.grade is None or ex.sealed is None or ex.facts.sent:
            return
        ex.facts.sent = True
        if ex.facts.main_mostly_dropped():
            self.counters.num_main_mostly_dropped += 1
            log.warning(
                "execution %s: %d output tokens not trained for their label (side) against %d of the main agent's; "
                "calls by reason: %s. If the harness's main line was labelled side, its work is not trained",
                execution_id, ex.facts.untrained_output_tokens, ex.facts.main_output_tokens, dict(ex.facts.reasons))
        tree_tokens = ex.tree.num_tokens if ex.tree is not None else 0
        self._facts.append(ex.facts.message(execution_id, step=ex.grade.step, tree_tokens=tree_tokens))

    def take_facts(self) -> list[ExecutionFacts]:
        """The facts of executions done since the last call. Informational (the report's tables),
        so kept apart from the data messages, and not owed again after a restart."""
        facts, self._facts = self._facts, []
        return facts

    def is_sealed(self, execution_id: str) -> bool:
        """The proxy sealed the execution (or it is done with): its token must stay refused."""
        return execution_id in self._done_executions or (
            execution_id in self._executions and self._executions[execution_id].sealed is not None)

    def _is_sealed(self, execution_id: str) -> bool:
        """Sealed, or (run release) already done with: forgotten only once graded and sealed."""
        return execution_id in self._done_executions or self._executions[execution_id].sealed is not None

    def _forget_execution(self, execution_id: str) -> None:
        ex = self._executions.pop(execution_id, None)
        if ex is None or ex.grade is None or not ex.grade.train:
            self._sealed_calls.pop(execution_id, None)  # an eval run's (a train run's: until its group is done)
        self._done_executions.add(execution_id)

    def _reject_grade(self, grade: Grade, why: str) -> ErrorReply:
        self.counters.num_rejected += 1
        text = f"grade for execution {grade.execution_id} (group {grade.group_id}) rejected: {why}"
        log.warning("%s", text)
        return ErrorReply(where="processor.grade", message=text)
