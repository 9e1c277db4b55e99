"""The cell registry: each cell's phase, its role, and how long it spent serving and training.

Phases follow a transition table (the elastic-cells issue times each one); the registry is the
only place that moves them, so the served/trained accounting cannot drift from the phases.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

from controller.scheduler import CellView
from base.wire import CellPhase, Role

PHASES: dict[str, tuple[str, ...]] = {
    "starting": ("serving", "dead"),
    "serving": ("draining", "dead"),
    "draining": ("training", "dead"),       # drain + release + trainer start, reported as one switch
    "training": ("to_serve", "dead"),
    "to_serve": ("serving", "dead"),
    "dead": (),
}


@dataclass
class Cell:
    cell_id: int
    is_core: bool
    proc: subprocess.Popen | None = None
    engine_url: str = ""
    engine_urls: list[str] = field(default_factory=list)
    """Every server the cell serves through, ``engine_url`` first (``wire.CellReady.serving_urls``)."""
    down_urls: frozenset[str] = frozenset()
    """Its servers its last heartbeat said stopped answering: not routed to until they answer."""
    weights_addr: str = ""
    grads_addrs: list[str] = field(default_factory=list)
    """The core's ranks' gradient inboxes, in rank order."""
    rank_weights_addrs: list[str] = field(default_factory=list)
    """A multi-rank core's ranks' own-shard publishers, in rank order."""
    phase: CellPhase = "starting"
    weight_version: int = 0
    num_running: int = 0
    last_seen: float = 0.0
    phase_since: float = 0.0
    served_s: float = 0.0
    trained_s: float = 0.0
    switches: list[dict] = field(default_factory=list)
    timeline: list[tuple[float, str]] = field(default_factory=list)

    @property
    def role(self) -> Role:
        return "train" if self.phase in ("draining", "training") else "serve"

    def set_phase(self, phase: CellPhase, now: float) -> None:
        if phase not in PHASES[self.phase]:
            raise RuntimeError(f"cell {self.cell_id}: {self.phase} -> {phase} is not a transition")
        spent = now - self.phase_since
        if self.phase == "serving":
            self.served_s += spent
        elif self.phase == "training":
            self.trained_s += spent
        self.phase = phase
        self.phase_since = now
        self.timeline.append((now, phase))

    def set_down(self, urls: list[str]) -> tuple[list[str], list[str]]:
        """Take a heartbeat's ``down_urls`` (names of other cells' servers ignored); returns the
        servers that (went down, came back)."""
        own = self.engine_urls or [self.engine_url]
        down = frozenset(urls) & frozenset(own)
        went, back = sorted(down - self.down_urls), sorted(self.down_urls - down)
        self.down_urls = down
        return went, back

    def accounted(self, now: float) -> tuple[float, float]:
        """(served_s, trained_s) including the phase the cell is in now."""
        spent = now - self.phase_since
        return (
            self.served_s + (spent if self.phase == "serving" else 0.0),
            self.trained_s + (spent if self.phase == "training" else 0.0),
        )


class CellRegistry:
    def __init__(self, num_cells: int, core_cell: int):
        self.cells = {i: Cell(cell_id=i, is_core=i == core_cell) for i in range(num_cells)}
        self.core_cell = core_cell

    @property
    def core(self) -> Cell:
        return self.cells[self.core_cell]

    def alive(self) -> list[Cell]:
        return [c for c in self.cells.values() if c.phase != "dead"]

    def in_phase(self, *phases: CellPhase) -> list[Cell]:
        return [c for c in self.cells.values() if c.phase in phases]

    def routes(self) -> tuple[tuple[int, str, int], ...]:
        """(cell id, server URL, weight version) of every answering server of every serving cell:
        the proxy routes among all of them, a cell's servers alike."""
        return tuple((c.cell_id, url, c.weight_version) for c in self.in_phase("serving")
                     for url in (c.engine_urls or [c.engine_url]) if url not in c.down_urls)

    def views(self, busy: set[int]) -> tuple[CellView, ...]:
        return tuple(
            CellView(
                cell_id=c.cell_id, role=c.role, phase=c.phase, is_core=c.is_core,
                busy=c.cell_id in busy, num_running=c.num_running, trained_s=c.trained_s,
            )
            for c in self.cells.values()
        )
