"""How a run's shape moves as training goes: the drift of agentic RL, as a pure function of the step.

In agentic RL the balance between rollouts and training does not stay put: runs grow longer as the
policy learns to use more turns and more tool time, and a curriculum changes the task mix. A
split of cells fixed at the start is then wrong later. ``workload.drift`` describes such a run
for the bundled harness (``bench.elastic --workload drift``): at step ``s`` a training run has
``max_turns x k`` turns and ``think_time.median_s x k`` of think time, with
``k = growth ** (s / (over_steps - 1))`` (``growth`` at step ``over_steps - 1`` and after), and from
``mix_step`` on the task mix changes: think time x ``mix_think``, turns x ``mix_turns``.

With ``block_steps > 0`` two task families alternate in blocks of that many steps, tool-heavy
first (``bench.elastic --workload moving``): tool-heavy runs think ``tool_think`` times longer with
``tool_turns`` times the turns (long wall time, few tokens: serving capacity is what a step waits
on), token-heavy ones ``token_think`` / ``token_turns`` (short runs with many tokens: training is).
That is the balance that moves, which a split of cells fixed at the start cannot follow.

``bench.simulate`` replays the same function, so the simulator predicts runs of the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from workloads.config import WorkloadConfig


@dataclass(frozen=True)
class RunShape:
    max_turns: int
    think_scale: float
    """Multiplies ``think_time.median_s`` for this run."""
    family: str = ""
    """``tool`` or ``token`` in a run of alternating task families (``block_steps``), else empty."""


def family_of(workload: WorkloadConfig, step: int) -> str:
    """The task family of ``step``'s training runs: ``tool`` in even blocks, ``token`` in odd ones."""
    block = workload.drift.block_steps
    if block <= 0:
        return ""
    return "tool" if (step // block) % 2 == 0 else "token"


def run_shape(workload: WorkloadConfig, step: int, *, train: bool = True) -> RunShape:
    """The shape of a run of ``step`` (held-out eval runs keep the configured one)."""
    d = workload.drift
    if not train or (d.growth == 1.0 and d.mix_step < 0 and d.block_steps <= 0):
        return RunShape(max_turns=workload.max_turns, think_scale=1.0)
    k = d.growth ** (min(step, d.over_steps - 1) / max(1, d.over_steps - 1))
    turns, think = workload.max_turns * k, k
    if 0 <= d.mix_step <= step:
        turns, think = turns * d.mix_turns, think * d.mix_think
    family = family_of(workload, step)
    if family == "tool":
        turns, think = turns * d.tool_turns, think * d.tool_think
    elif family == "token":
        turns, think = turns * d.token_turns, think * d.token_think
    return RunShape(max_turns=max(1, round(turns)), think_scale=think, family=family)
