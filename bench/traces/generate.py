"""Write the simulator's trace files, seeded: ``python -m bench.traces.generate [--seed 0] [--out DIR]``.

The traces are shaped like the reference system's workloads (the issue's numbers; nothing here is
a measurement of that system, whose own traces are not public):

- ``p2_4t``: a 2.4T-parameter model on 192 nodes = 4 cells x 48 nodes; ~700k tokens per
  execution, runs of hours with a long tail and many near or past the 2 h timeout, 48 steps.
  Fitted by hand (timeout, live executions per cell, microstep time) so that the simulator,
  running the water-level rule this repository started with, lands near all three of the
  reference's figures: 76.0 h elastic, 132.4 h async, 88.9 h colocate against 75.42 / 134.55 /
  91.47 h. What an improved policy does on it is then the simulator's prediction.
- ``nl2repo_122b``, ``deepswe_122b``: a 122B model on 32 nodes = 4 cells x 8; NL2Repo-like runs
  build a repository from a spec (long, many at the timeout, long contexts so fewer live
  executions per cell), DeepSWE-like runs fix an issue (shorter, long-tailed, few at the timeout).
- ``nl2repo_timeout_122b``: the NL2Repo-like setup with nine runs in ten near or past the timeout,
  the regime where the reference lost to Colocate. A cell holds 48 runs and a step has 128, so the
  serving slots bind (``controller.bounds.serving_bound``).
- ``terminalbench_122b``: the 122B model on 24 nodes = 3 cells x 8; TerminalBench-like runs are
  short and tool-heavy (more think time than model time).
- ``p2_4t_moving``, ``nl2repo_122b_moving``: the 2.4T-like and NL2Repo-like setups with a balance
  that moves: tool-heavy task families (long wall time, many runs near the timeout, one shard a
  group) and token-heavy ones (shorter runs, ten shards a group) alternate in blocks of six steps,
  so the split that suits a step swings between one and three training cells of four
  (``controller.bounds.phase_balance``). ``p2_4t_curriculum``: the same two families as a
  monotone curriculum, from tool-heavy to token-heavy in six stages. ``p2_4t_moving_eval`` and
  ``p2_4t_moving_loss``: ``p2_4t_moving``'s runs with a held-out eval round at every 4th version
  (serving only), and with a satellite lost for good halfway.

A run's length is drawn from a mixture: with probability ``near_timeout`` it is uniform in
``[0.85, 1.3] x timeout`` (a run that would go past the timeout is cut there by the simulator),
else log-normal around ``median_s``. It is then cut into ``turns`` call/think pairs; the share of
model time per run is ``call_share`` +- 0.1, spread unevenly over its turns.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
from dataclasses import dataclass
from pathlib import Path

from controller.traces import CellCosts, CellLoss, EvalRounds, Phase, Trace, WorkloadShape, write_trace

HERE = Path(__file__).resolve().parent
RUNS_PER_PHASE = 384


@dataclass(frozen=True, kw_only=True)
class RunShape:
    median_s: float
    sigma: float
    near_timeout: float
    call_share: float
    turns: int


@dataclass(frozen=True, kw_only=True)
class PhaseShape:
    name: str
    first_step: int
    runs: RunShape
    microsteps_per_group: int = 0
    """0: the workload's."""


@dataclass(frozen=True, kw_only=True)
class Spec:
    name: str
    description: str
    cells: CellCosts
    workload: WorkloadShape
    phases: tuple[PhaseShape, ...]
    reference_h: dict[str, float] | None = None
    runs_per_phase: int = RUNS_PER_PHASE
    pool_of: str = ""
    """Draw the runs as the trace of this name does (the same pool), so two traces differ only
    in what else they say (eval rounds, a lost cell); '': the trace's own name."""
    eval: EvalRounds | None = None
    cell_losses: tuple[CellLoss, ...] = ()


MIN = 60.0
HOUR = 3600.0

# The NL2Repo-like setup: 4 cells x 8 nodes, long contexts (48 live runs per cell), 2 h timeout.
NL2REPO_CELLS = CellCosts(num_cells=4, nodes_per_cell=8, capacity_per_cell=48, to_train_s=150.0, to_serve_s=100.0,
                          weight_transfer_s=30.0, grad_transfer_s=20.0, microstep_s=150.0, apply_s=45.0,
                          compute_slots=4, reroute_s=20.0)
NL2REPO_WORKLOAD = WorkloadShape(steps=48, groups_per_step=8, group_size=16, timeout_s=2 * HOUR, microsteps_per_group=4,
                                 launch_s=MIN, grade_s=2 * MIN, staleness=1, async_train_cells=1)


def nl2repo_runs(*, near_timeout: float) -> RunShape:
    return RunShape(median_s=55 * MIN, sigma=0.5, near_timeout=near_timeout, call_share=0.7, turns=8)


P2_4T_CELLS = CellCosts(num_cells=4, nodes_per_cell=48, capacity_per_cell=128, to_train_s=6 * MIN, to_serve_s=4 * MIN,
                        weight_transfer_s=90.0, grad_transfer_s=60.0, microstep_s=5 * MIN, apply_s=3 * MIN,
                        compute_slots=4, reroute_s=60.0)
P2_4T_WORKLOAD = WorkloadShape(steps=48, groups_per_step=8, group_size=16, timeout_s=2 * HOUR, microsteps_per_group=4,
                               launch_s=2 * MIN, grade_s=3 * MIN, staleness=1, async_train_cells=1)
DRIFT_PHASES = 8
DRIFT_GROWTH = 4.0


def drift_phases(*, steps: int, phases: int = DRIFT_PHASES, growth: float = DRIFT_GROWTH) -> tuple[PhaseShape, ...]:
    """The 2.4T-like setup as training moves it: each of ``phases`` equal stretches of steps has
    runs ``growth ** (i / (phases - 1))`` times the first stretch's median length and turns, and
    as many more shards a group (tokens grow with the turns), so the last stretch's runs are
    ``growth`` times the first's; more of them reach the timeout as they grow. Halfway the task
    mix changes: tool-heavy tasks (a third of a run is model time instead of three quarters,
    a longer tail), as when a curriculum moves from issue fixing to repository building."""
    out = []
    for i in range(phases):
        k = growth ** (i / (phases - 1))
        first = i * steps // phases
        second_half = first >= steps // 2
        out.append(PhaseShape(
            name=f"drift{i}{'-tools' if second_half else ''}", first_step=first,
            microsteps_per_group=max(1, round(2 * k)),
            runs=RunShape(median_s=0.4 * HOUR * k, sigma=0.9 if second_half else 0.5,
                          near_timeout=min(0.5, 0.04 * k * k), call_share=0.35 if second_half else 0.75,
                          turns=max(1, round(4 * k))),
        ))
    return tuple(out)


MOVING_BLOCK = 6
"""Steps a block of one task family lasts in the moving-balance traces."""


def tool_heavy(*, median_s: float) -> RunShape:
    """Tool-heavy tasks: long wall time, mostly think (tool) time, many runs near the timeout, few
    tokens to train (one shard a group): a step's cells are wanted for serving."""
    return RunShape(median_s=median_s, sigma=0.6, near_timeout=0.45, call_share=0.25, turns=12)


def token_heavy(*, median_s: float) -> RunShape:
    """Token-heavy tasks: shorter runs, mostly model time, few at the timeout, many tokens to train
    (ten shards a group): a step's cells are wanted for training."""
    return RunShape(median_s=median_s, sigma=0.4, near_timeout=0.02, call_share=0.8, turns=6)


def moving_phases(*, steps: int, tool_median_s: float, token_median_s: float, block: int = MOVING_BLOCK,
                  ) -> tuple[PhaseShape, ...]:
    """Task families alternating in blocks of ``block`` steps, tool-heavy first: the serving and
    training shares of a step swing between the two."""
    return tuple(
        PhaseShape(name=f"{'tools' if i % 2 == 0 else 'tokens'}{i // 2}", first_step=first,
                   microsteps_per_group=1 if i % 2 == 0 else 10,
                   runs=tool_heavy(median_s=tool_median_s) if i % 2 == 0 else token_heavy(median_s=token_median_s))
        for i, first in enumerate(range(0, steps, block))
    )


def curriculum_phases(*, steps: int, tool_median_s: float, token_median_s: float, stages: int = 6,
                      ) -> tuple[PhaseShape, ...]:
    """A monotone curriculum from tool-heavy to token-heavy tasks in ``stages`` stretches: runs get
    shorter and carry more tokens to train, stage by stage."""
    out = []
    for i in range(stages):
        f = i / (stages - 1)
        out.append(PhaseShape(
            name=f"stage{i}", first_step=i * steps // stages, microsteps_per_group=max(1, round(1 + 9 * f)),
            runs=RunShape(median_s=tool_median_s * (1 - f) + token_median_s * f, sigma=0.6 - 0.2 * f,
                          near_timeout=0.45 * (1 - f) + 0.02 * f, call_share=0.25 + 0.55 * f,
                          turns=round(12 - 6 * f)),
        ))
    return tuple(out)


P2_4T_MOVING = Spec(
    name="p2_4t_moving",
    description=f"2.4T-like with a moving balance: tool-heavy and token-heavy task families alternate in "
                f"blocks of {MOVING_BLOCK} steps (1 vs 10 shards a group; 1.5 h vs 0.35 h median runs, "
                "45% vs 2% near the timeout)",
    cells=P2_4T_CELLS, workload=P2_4T_WORKLOAD,
    phases=moving_phases(steps=P2_4T_WORKLOAD.steps, tool_median_s=1.5 * HOUR, token_median_s=0.35 * HOUR),
    runs_per_phase=RUNS_PER_PHASE // 4,  # a block's 6 steps draw 768 runs from its 96: the file stays small
)
"""The 2.4T-like moving-balance trace; its two variants below draw the same runs."""


SPECS: tuple[Spec, ...] = (
    Spec(
        name="p2_4t",
        description="2.4T-like: 4 cells x 48 nodes, ~700k tokens per execution, hours-long long-tailed runs, "
                    "many near the timeout, 48 steps",
        cells=P2_4T_CELLS, workload=P2_4T_WORKLOAD,
        phases=(PhaseShape(name="all", first_step=0, runs=RunShape(median_s=1.4 * HOUR, sigma=0.5, near_timeout=0.35, call_share=0.75, turns=8)),),
        reference_h={"elastic": 75.42, "async": 134.55, "colocate": 91.47},
    ),
    Spec(
        name="p2_4t_drift",
        description=f"2.4T-like with the drift of agentic RL: runs and tokens grow {DRIFT_GROWTH:g}x from the first "
                    "step to the last (median 0.4 h to 1.6 h, 4 to 16 turns, 2 to 8 shards a group, more at the "
                    "timeout), the task mix turns tool-heavy halfway",
        cells=P2_4T_CELLS, workload=P2_4T_WORKLOAD, phases=drift_phases(steps=P2_4T_WORKLOAD.steps),
        runs_per_phase=RUNS_PER_PHASE // DRIFT_PHASES * 2,  # a phase's 6 steps draw 768 runs from its 96
    ),
    P2_4T_MOVING,
    dataclasses.replace(
        P2_4T_MOVING, name="p2_4t_moving_eval", pool_of=P2_4T_MOVING.name, eval=EvalRounds(every=4, runs=64),
        description="p2_4t_moving's runs with a held-out eval of 64 runs at every 4th version: rounds that "
                    "only serve, beside the rollouts"),
    dataclasses.replace(
        P2_4T_MOVING, name="p2_4t_moving_loss", pool_of=P2_4T_MOVING.name,
        cell_losses=(CellLoss(cell=3, at_version=24),),
        description="p2_4t_moving's runs with one satellite (cell 3) lost for good halfway, once version 24 is "
                    "applied: three cells do the rest"),
    Spec(
        name="p2_4t_curriculum",
        description="2.4T-like with a monotone curriculum: from tool-heavy tasks (1.5 h median, 1 shard a group) "
                    "to token-heavy ones (0.35 h, 10 shards) in six stages",
        cells=P2_4T_CELLS, workload=P2_4T_WORKLOAD,
        phases=curriculum_phases(steps=P2_4T_WORKLOAD.steps, tool_median_s=1.5 * HOUR, token_median_s=0.35 * HOUR),
        runs_per_phase=RUNS_PER_PHASE // 4,  # a block's 6 steps draw 768 runs from its 96: the file stays small
    ),
    Spec(
        name="nl2repo_122b_moving",
        description=f"122B-like with a moving balance: 4 cells x 8 nodes, tool-heavy and token-heavy task "
                    f"families alternate in blocks of {MOVING_BLOCK} steps (1 vs 10 shards a group)",
        cells=NL2REPO_CELLS, workload=NL2REPO_WORKLOAD,
        phases=moving_phases(steps=NL2REPO_WORKLOAD.steps, tool_median_s=70 * MIN, token_median_s=15 * MIN),
        runs_per_phase=RUNS_PER_PHASE // 4,  # a block's 6 steps draw 768 runs from its 96: the file stays small
    ),
    Spec(
        name="nl2repo_122b",
        description="122B-like, NL2Repo-like: 4 cells x 8 nodes, long runs that build a repository, many at the timeout",
        cells=NL2REPO_CELLS, workload=NL2REPO_WORKLOAD,
        phases=(PhaseShape(name="all", first_step=0, runs=nl2repo_runs(near_timeout=0.4)),),
    ),
    Spec(
        name="nl2repo_timeout_122b",
        description="122B-like, NL2Repo-like with nine runs in ten near or past the timeout (where the reference "
                    "lost to Colocate): 4 cells x 8 nodes, few live executions per cell",
        cells=NL2REPO_CELLS, workload=NL2REPO_WORKLOAD,
        phases=(PhaseShape(name="all", first_step=0, runs=nl2repo_runs(near_timeout=0.9)),),
    ),
    Spec(
        name="deepswe_122b",
        description="122B-like, DeepSWE-like: 4 cells x 8 nodes, issue-fixing runs, long-tailed, few at the timeout",
        cells=CellCosts(num_cells=4, nodes_per_cell=8, capacity_per_cell=64, to_train_s=150.0, to_serve_s=100.0,
                        weight_transfer_s=30.0, grad_transfer_s=20.0, microstep_s=90.0, apply_s=45.0,
                        compute_slots=4, reroute_s=20.0),
        workload=WorkloadShape(steps=48, groups_per_step=8, group_size=16, timeout_s=1.5 * HOUR, microsteps_per_group=4,
                               launch_s=MIN, grade_s=MIN, staleness=1, async_train_cells=1),
        phases=(PhaseShape(name="all", first_step=0, runs=RunShape(median_s=18 * MIN, sigma=0.8, near_timeout=0.08, call_share=0.65, turns=8)),),
    ),
    Spec(
        name="terminalbench_122b",
        description="122B-like, TerminalBench-like: 3 cells x 8 nodes, short tool-heavy runs",
        cells=CellCosts(num_cells=3, nodes_per_cell=8, capacity_per_cell=64, to_train_s=150.0, to_serve_s=100.0,
                        weight_transfer_s=30.0, grad_transfer_s=20.0, microstep_s=45.0, apply_s=45.0,
                        compute_slots=3, reroute_s=20.0),
        workload=WorkloadShape(steps=48, groups_per_step=8, group_size=16, timeout_s=40 * MIN, microsteps_per_group=4,
                               launch_s=30.0, grade_s=MIN, staleness=1, async_train_cells=1),
        phases=(PhaseShape(name="all", first_step=0, runs=RunShape(median_s=7 * MIN, sigma=0.9, near_timeout=0.12, call_share=0.4, turns=8)),),
    ),
)


def draw_run(rng: random.Random, shape: RunShape, timeout_s: float) -> list[float]:
    """One run: [call_s, think_s] x turns, seconds rounded to 0.1."""
    if rng.random() < shape.near_timeout:
        total = rng.uniform(0.85, 1.3) * timeout_s
    else:
        total = min(rng.lognormvariate(math.log(shape.median_s), shape.sigma), 1.3 * timeout_s)
    call_share = min(0.95, max(0.05, shape.call_share + rng.uniform(-0.1, 0.1)))
    weights = [rng.uniform(0.5, 1.5) for _ in range(shape.turns)]
    scale = total / sum(weights)
    out: list[float] = []
    for w in weights:
        out += [round(w * scale * call_share, 1), round(w * scale * (1 - call_share), 1)]
    return out


def make_trace(spec: Spec, seed: int) -> Trace:
    rng = random.Random(f"{spec.pool_of or spec.name}/{seed}")
    pool: list[tuple[float, ...]] = []
    phases = []
    for ph in spec.phases:
        lo = len(pool)
        pool += [tuple(draw_run(rng, ph.runs, spec.workload.timeout_s)) for _ in range(spec.runs_per_phase)]
        phases.append(Phase(name=ph.name, first_step=ph.first_step, runs=(lo, len(pool)),
                            microsteps_per_group=ph.microsteps_per_group))
    shapes = "; ".join(f"{ph.name} from step {ph.first_step}: {ph.runs}" for ph in spec.phases)
    return Trace(
        name=spec.name, description=spec.description,
        generator=f"python -m bench.traces.generate --seed {seed} ({shapes})",
        cells=spec.cells, workload=spec.workload, reference_h=spec.reference_h, phases=tuple(phases),
        executions=tuple(pool), eval=spec.eval, cell_losses=spec.cell_losses,
    )


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    written = []
    for spec in SPECS:
        path = args.out / f"{spec.name}.json"
        write_trace(make_trace(spec, args.seed), path)
        written.append(path)
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
