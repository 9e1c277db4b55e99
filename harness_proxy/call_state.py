"""What the proxy server holds per live execution and per planned call (``harness_proxy.server``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from base import wire
from harness_proxy.budget import BudgetState
from harness_proxy.engine_client import EngineResult


@dataclass
class LiveExecution:
    """A live execution's state; dropped when it is sealed."""

    first_call_at: float
    """Monotonic seconds of its first call (``proxy.execution_budget.max_wall_s`` counts from here)."""
    num_calls: int = 0
    """CallRecords queued so far; the next record's call_index."""
    num_sent: int = 0
    """Calls sent to an engine (``max_calls``)."""
    num_tokens: int = 0
    """Prompt plus output ids of the calls whose result is known (``max_tokens``)."""
    in_flight: set[asyncio.Task[EngineResult]] = field(default_factory=set)

    def budget_state(self) -> BudgetState:
        return BudgetState(first_call_at=self.first_call_at, num_calls=self.num_sent, num_tokens=self.num_tokens,
                           num_in_flight=len(self.in_flight))


@dataclass(frozen=True, slots=True)
class PlannedCall:
    """One call as ``ProxyServer._plan_call`` decided it: prompt ids, line and sampling (the engine
    client reads what ``engine_client.EngineCall`` names)."""

    execution_id: str
    agent: str
    """The session and routing key: whose line of calls this one extends."""
    call_id: str
    prompt_ids: list[int]
    sampling_params: dict[str, Any]
    asked: tuple[float, float] = (1.0, 1.0)
    """The harness's own temperature and top_p, recorded beside what the engine used."""
    lineage: wire.Lineage = "main"
    agent_id: str = ""
    """The harness's agent id, recorded on the CallRecord ('' for the main agent)."""
    lineage_reason: str = ""
    capped_by_run: bool = False
    """The run's own cap (``max_new_tokens_cap``), not the harness's ``max_tokens``, bounds this call."""

    def harness_finish(self, engine_finish: str, ends_turn: bool) -> str:
        """The finish the harness is told: with ``proxy.truncation_ends_turn``, a turn the run's cap cut
        is an ended turn (the harness goes on instead of asking the model to continue); the
        CallRecord keeps the engine's own ``length``."""
        return "stop" if ends_turn and engine_finish == "length" and self.capped_by_run else engine_finish
