"""Who serves and who trains: a pure function of a snapshot of the controller's state.

``decide(view, cfg) -> list[Switch]`` does no I/O and reads no clock, so the live controller, the
simulator and replays run the same code. Cells in the middle of a switch are left alone; cells
that are ``busy`` (holding microsteps, unsent gradients, or applying a step) keep their role.

Policies (same interface, same staleness bound, so they compare on equal terms):
- ``elastic`` (water level): while there is training work, every serving cell beyond what the live
  work needs turns to training, the core first; when live work would overflow the serving cells,
  idle training cells turn back. With no training work, every cell serves.
- ``async``: fixed pools; the core and the next ``train_cells - 1`` cells train, the rest serve.
- ``colocate``: everyone serves until the trainable step's rollouts are all in, then everyone trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controller.config import SchedulerConfig
from controller.wire import CellPhase, Role

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


@dataclass(frozen=True)
class Switch:
    cell_id: int
    role: Role


def decide(view: SchedulerView, cfg: SchedulerConfig) -> list[Switch]:
    cells = [c for c in view.cells if c.phase != "dead"]
    if cfg.kind == "async":
        return _fixed_pools(cells, cfg)
    if cfg.kind == "colocate":
        want: Role = "train" if view.train_demand > 0 and view.step_rollouts_done else "serve"
        return [Switch(c.cell_id, want) for c in cells if _movable(c) and c.role != want]
    return _water_level(view, cells, cfg)


def serving_need(view: SchedulerView, cfg: SchedulerConfig, num_cells: int) -> int:
    live = view.queued + view.running
    need = math.ceil(live / cfg.capacity_per_cell)
    if live > 0 or view.rollouts_pending:
        need = max(need, cfg.min_serving_cells)
    return min(need, num_cells)


def _movable(c: CellView) -> bool:
    return c.phase in STABLE and not c.busy


def _water_level(view: SchedulerView, cells: list[CellView], cfg: SchedulerConfig) -> list[Switch]:
    need = serving_need(view, cfg, len(cells))
    serving = [c for c in cells if c.role == "serve"]
    training = [c for c in cells if c.role == "train"]
    if view.train_demand <= 0:
        return [Switch(c.cell_id, "serve") for c in training if _movable(c)]
    # Only cells serving now hold work now: one still turning to serve does not free another.
    spare = sum(1 for c in serving if c.phase == "serving") - need
    if spare > 0:
        # Core first (the step is applied there), then the least loaded, then who trained least.
        order = sorted((c for c in serving if _movable(c)), key=lambda c: (not c.is_core, c.num_running, c.trained_s, c.cell_id))
        return [Switch(c.cell_id, "train") for c in order[:spare]]
    shortfall = need - len(serving)
    if shortfall > 0:
        # Live work would overflow the serving cells: idle satellites first, the core last.
        back = sorted((c for c in training if _movable(c)), key=lambda c: (c.is_core, -c.trained_s, c.cell_id))
        return [Switch(c.cell_id, "serve") for c in back[:shortfall]]
    if spare < 0:
        return []  # enough cells are on their way to serving
    core = next((c for c in serving if c.is_core and _movable(c)), None)
    idle = sorted((c for c in training if _movable(c) and not c.is_core), key=lambda c: c.cell_id)
    if core is not None and idle:
        # No cell to spare, but the step can only be applied on the core: swap it with a satellite.
        return [Switch(core.cell_id, "train"), Switch(idle[0].cell_id, "serve")]
    return []


def _fixed_pools(cells: list[CellView], cfg: SchedulerConfig) -> list[Switch]:
    core = [c for c in cells if c.is_core]
    others = sorted((c for c in cells if not c.is_core), key=lambda c: c.cell_id)
    trainers = {c.cell_id for c in (core + others)[: cfg.train_cells]}
    out = []
    for c in cells:
        want: Role = "train" if c.cell_id in trainers else "serve"
        if c.role != want and _movable(c):
            out.append(Switch(c.cell_id, want))
    return out
