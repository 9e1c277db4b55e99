"""Per-execution budgets: the calls, tokens, seconds and parallel calls one execution may take.

An execution's token sits in the agent's environment inside its sandbox, so a policy under RL can
call the proxy with it outside its harness (``curl`` in a loop, or hundreds of calls at once) and
take engine capacity from every other execution. ``budget_refusal`` decides, purely, whether an
execution's next call may go to an engine: its ``BudgetState`` and ``proxy.execution_budget`` in,
a ``BudgetRefusal`` or None out. ``ProxyServer`` keeps the counters of each live execution, asks
once a call's token is verified and before any engine time is spent, and answers a refusal in the
API's own shape, counted at ``GET /stats`` under its abuse kind and logged once per execution:

- ``budget_concurrency``: ``max_concurrent_calls`` of the execution are at an engine already.
  429 (Anthropic ``rate_limit_error``, OpenAI code ``rate_limit_exceeded``): both SDKs retry it,
  and the call may go once another of the execution's calls ends.
- ``budget_calls`` / ``budget_tokens`` / ``budget_wall``: the execution has used up a budget.
  403 (Anthropic ``permission_error``, OpenAI code ``budget_exhausted``): neither SDK retries it,
  and it stays refused until the execution is sealed. The message names the budget and its value.

What counts. A call counts once it is sent to an engine (one refused before, e.g. for its prompt
length, does not; one the engines fail still does). Tokens count when a call's result is known:
its prompt ids plus its output ids, or its prompt ids alone when the harness hung up mid-call (the
engine had prefilled them). A call already at an engine when a budget runs out is let finish, so
the tokens spent may pass ``max_tokens`` by what the calls then in flight add. Wall time is on the
monotonic clock, from the first call the proxy saw of the execution (its token verified). A limit
of 0 is no limit.

State and restarts. The counters live in the proxy's memory, in its entry for the execution,
which goes when the execution is sealed. A proxy restarted in place rebuilds an execution's entry
from the CallRecords the processor logged (``trajectory.session_replay``) before it answers the
execution's next call: its calls and tokens count on from there (calls that failed at an engine
were not recorded and are not counted again), while its wall clock starts again at that call. The
controller's own per-execution timeout, which kills and seals it, does not restart with the proxy.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness_proxy.config import ExecutionBudgetConfig

RETRIABLE_KIND = "budget_concurrency"
BUDGET_KINDS = ("budget_calls", "budget_tokens", "budget_wall", RETRIABLE_KIND)
"""The abuse kinds (``abuse.KINDS``) a budget refusal is counted under."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetState:
    """One execution's use so far, as the proxy saw it when a call asked to go to an engine."""

    first_call_at: float
    """Monotonic seconds of the first call the proxy saw of the execution."""
    num_calls: int
    """Calls sent to an engine so far."""
    num_tokens: int
    """Prompt plus output ids of the calls whose result is known."""
    num_in_flight: int
    """Calls at an engine now."""


@dataclass(frozen=True, slots=True)
class BudgetRefusal:
    kind: str
    """One of ``BUDGET_KINDS``."""
    message: str
    """For the harness: which budget, its value, and what was used."""

    @property
    def retriable(self) -> bool:
        """Only concurrency passes: a used-up budget stays used up."""
        return self.kind == RETRIABLE_KIND


def budget_refusal(state: BudgetState, cfg: ExecutionBudgetConfig, now: float) -> BudgetRefusal | None:
    """Why the execution's next call may not go to an engine at monotonic time ``now``, or None.

    A used-up budget is named before concurrency: its refusal is final, so a harness told it stops
    instead of retrying into it."""
    # The messages avoid the words "rate limit": LiteLLM (mini-swe-agent) reads them in an error's
    # text as a rate limit, whatever its status, and retries.
    if cfg.max_calls and state.num_calls >= cfg.max_calls:
        return BudgetRefusal("budget_calls", f"execution budget used up: {state.num_calls} calls made, "
                                             f"max_calls is {cfg.max_calls}; no further calls are served")
    if cfg.max_tokens and state.num_tokens >= cfg.max_tokens:
        return BudgetRefusal("budget_tokens", f"execution budget used up: {state.num_tokens} prompt and output "
                                              f"tokens, max_tokens is {cfg.max_tokens}; no further calls are served")
    elapsed_s = now - state.first_call_at
    if cfg.max_wall_s and elapsed_s >= cfg.max_wall_s:
        return BudgetRefusal("budget_wall", f"execution budget used up: first call {elapsed_s:.1f} s ago, "
                                            f"max_wall_s is {cfg.max_wall_s:g}; no further calls are served")
    if cfg.max_concurrent_calls and state.num_in_flight >= cfg.max_concurrent_calls:
        return BudgetRefusal(RETRIABLE_KIND, f"too many concurrent calls for this execution: {state.num_in_flight} "
                                             f"in flight, max_concurrent_calls is {cfg.max_concurrent_calls}; "
                                             "retry once one has ended")
    return None
