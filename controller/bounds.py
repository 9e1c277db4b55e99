"""The shortest time any scheduling policy could take on a trace: a lower bound, not a schedule.

A ratio goal ("elastic is 1.4x colocate") can be out of reach for every policy. This computes the
makespan of a relaxed problem in which everything a policy decides is free, and what cannot be
decided away is kept. It holds for every policy the simulator can run (``controller/simulator.py``),
on the same runs (``runs`` is consumed in the simulator's planning order: step, group, run):

- step s's rollouts start no earlier than the update of step ``s - staleness - 1`` (the staleness
  bound; ``scheduler.steps_to_plan``);
- a run ends at ``min(launch_s + its segments, timeout_s)`` after launch or later (calls never go
  faster than alone; stalls and reroutes only add), and is graded ``grade_s`` after it ends;
- its microsteps reach the trainers when its group closes (Gyre's processor), or for
  ``release="run"`` each run's share when that run is graded, as the simulator's what-if does;
- step s trains at the weights of version s, so no microstep of s starts before step s-1 is
  applied; each takes ``microstep_s`` at best, at most ``num_cells`` at once, and the cells doing
  them do not outrun ``compute_slots`` in total;
- the update is applied ``apply_s`` after its last microstep.

Left out, so a real schedule pays them on top: role switches, weight and gradient transfers, the
serving capacity that live runs hold (in a step's tail the next step's runs keep cells serving),
and microsteps that do not divide evenly among cells more than once.

``serving_bound`` is the other half, for policies that never leave a running execution without a
serving slot (elastic's first rule, and async's fixed pools; colocate lets running executions wait
while every cell trains). Each run then holds one of a serving cell's ``capacity_per_cell`` slots
from its launch until it ends, at least ``min(launch_s + its segments, timeout_s)``, and a cell that
serves does not train: the cells' time must cover both. Where many runs sit near the timeout and a
cell holds few of them, this binds, and colocate can pass it only by letting runs wait out part of
their timeout without a cell (they are cut with less of their work done).
"""

from __future__ import annotations

import math

from controller.simulator import Release, RunSource
from controller.traces import Trace

EPS = 1e-9


def makespan_bound(trace: Trace, runs: RunSource, *, release: Release = "group") -> float:
    """Seconds to the trace's last update under the relaxation above; every policy takes at least this."""
    if release not in ("group", "run"):
        raise ValueError(f"release={release!r}: 'group' or 'run'")
    wl, cc = trace.workload, trace.cells
    applied: list[float] = []
    for step in range(wl.steps):
        start = applied[step - wl.staleness - 1] if step > wl.staleness else 0.0
        arrivals: list[tuple[float, int]] = []  # (when microsteps reach the trainers, how many)
        for g in range(wl.groups_per_step):
            gid = f"s{step}-g{g}"
            graded = sorted(start + min(wl.launch_s + sum(runs(f"{gid}-e{i}", step)), wl.timeout_s) + wl.grade_s
                            for i in range(wl.group_size))
            arrivals += _group_arrivals(graded, trace.microsteps_of_step(step), release)
        previous = applied[-1] if applied else 0.0
        applied.append(_train_end(arrivals, previous, cc.num_cells, cc.compute_slots, trace.microstep_s_of_step(step))
                       + cc.apply_s)
    return applied[-1]


def serving_bound(trace: Trace, runs: RunSource) -> float:
    """Seconds no policy that keeps every running execution served can beat: the cells' time
    (``num_cells`` x makespan) holds every run's slot time over ``capacity_per_cell`` plus every
    microstep's ``microstep_s``, since a cell either serves or trains."""
    held, _, training = _work(trace, runs)
    return (held + training) / trace.cells.num_cells


def phase_balance(trace: Trace, runs: RunSource) -> list[dict[str, float | int | str]]:
    """Each phase of the trace at every policy's throughput (``throughput_what_if``'s terms, step by
    step): the fixed split that suits the phase best (``ideal_training_cells``, with the fractional
    split that would balance its serving and training work exactly) and that split's time over any
    policy's (``what_if``). Where the ideal split differs between phases, no fixed split suits the run."""
    cc, wl = trace.cells, trace.workload
    work = _work_by_step(trace, runs)
    out: list[dict[str, float | int | str]] = []
    for i, phase in enumerate(trace.phases):
        end = trace.phases[i + 1].first_step if i + 1 < len(trace.phases) else wl.steps
        steps = work[phase.first_step:end]
        if not steps:
            continue
        any_policy = sum(max((h + t) / cc.num_cells, (c + t) / cc.compute_slots) for h, c, t in steps)
        split = {k: sum(max(t / min(k, cc.compute_slots), h / (cc.num_cells - k), (c + t) / cc.compute_slots)
                        for h, c, t in steps) for k in range(1, cc.num_cells)}
        best = min(split, key=split.get)
        held, training = sum(s[0] for s in steps), sum(s[2] for s in steps)
        out.append({"phase": phase.name, "first_step": phase.first_step, "steps": len(steps),
                    "ideal_training_cells": best, "balanced_training_cells": cc.num_cells * training / (held + training),
                    "what_if": split[best] / any_policy})
    return out


def _work(trace: Trace, runs: RunSource) -> tuple[float, float, float]:
    """Cell-seconds of the trace's work, as the two throughput views count it: serving slots
    (every run's ``min(launch + segments, timeout)`` over ``capacity_per_cell``), serving cells'
    calls (their model time over ``capacity_per_cell``: a cell serves that many at full speed),
    and training (every microstep)."""
    steps = _work_by_step(trace, runs)
    return sum(s[0] for s in steps), sum(s[1] for s in steps), sum(s[2] for s in steps)


def _work_by_step(trace: Trace, runs: RunSource) -> list[tuple[float, float, float]]:
    """``_work`` of each step: (serving slots, calls, training) in cell-seconds."""
    wl, cc = trace.workload, trace.cells
    out = []
    for step in range(wl.steps):
        held = calls = 0.0
        for g in range(wl.groups_per_step):
            for i in range(wl.group_size):
                segs = runs(f"s{step}-g{g}-e{i}", step)
                held += min(wl.launch_s + sum(segs), wl.timeout_s)
                calls += sum(segs[0::2])
        training = wl.groups_per_step * trace.microsteps_of_step(step) * trace.microstep_s_of_step(step)
        out.append((held / cc.capacity_per_cell, calls / cc.capacity_per_cell, training))
    return out


def _group_arrivals(graded: list[float], microsteps: int, release: Release) -> list[tuple[float, int]]:
    """When a group's microsteps arrive: all at its last grade, or (``release="run"``) whole ones
    as its runs' shares add up, the remainder at group close (the simulator's what-if rule)."""
    if release == "group":
        return [(graded[-1], microsteps)]
    out, share, done = [], microsteps / len(graded), 0
    for i, when in enumerate(graded[:-1], start=1):
        ready = min(int(i * share + EPS), microsteps - 1)
        if ready > done:
            out.append((when, ready - done))
            done = ready
    return out + [(graded[-1], microsteps - done)]


def _train_end(arrivals: list[tuple[float, int]], previous: float, cells: int, slots: int, microstep_s: float) -> float:
    """The earliest the last microstep can end: for every arrival time t, the microsteps arriving
    at t or later still have to run after max(t, previous), on at most ``cells`` cells (whole
    microsteps each) and ``slots`` compute slots (their total rate)."""
    end, left = previous, 0
    for when, count in sorted(arrivals, reverse=True):
        left += count
        after = max(when, previous)
        end = max(end, after + max(math.ceil(left / cells) * microstep_s, left * microstep_s / min(cells, slots)))
    return end


def throughput_what_if(trace: Trace, runs: RunSource) -> dict[str, float | int]:
    """Elastic over the best fixed split if every policy ran at its throughput: a what-if for step
    semantics in which no step waits for its slowest run (partial rollouts, a preempted tail), for
    every policy alike. Only the work binds then, step by step: staleness keeps one step's spare
    capacity from doing another step's work, so each step's time is its own work's, summed over
    the steps. In a step, any policy needs the cells' time for every run's slot and every microstep
    (``serving_bound``), and the compute slots for every microstep and each serving cell's calls
    (``capacity_per_cell`` of them at full speed, as the simulator runs them). A fixed split of
    ``k`` training cells also needs ``k`` cells (at most ``compute_slots``) for the step's
    microsteps, and the other ``N - k`` for its slots. ``ratio`` is the best split's time over any
    policy's. Where the balance of serving and training holds through the run, it is near 1.

    Not a bound on what elastic measures: under today's semantics a fixed split held back by the
    step chain can trail its throughput further than elastic does.

    Returns ``any_policy_s``, ``best_split_s``, ``best_split_cells`` and ``ratio``."""
    cc = trace.cells
    any_policy, splits = 0.0, dict.fromkeys(range(1, cc.num_cells), 0.0)
    for held, calls, training in _work_by_step(trace, runs):
        compute = (calls + training) / cc.compute_slots
        any_policy += max((held + training) / cc.num_cells, compute)
        for k in splits:
            splits[k] += max(training / min(k, cc.compute_slots), held / (cc.num_cells - k), compute)
    best = min(splits, key=splits.get)
    return {"any_policy_s": any_policy, "best_split_s": splits[best], "best_split_cells": best,
            "ratio": splits[best] / any_policy}
