"""Typed mirror of conf/proxy/*.yaml."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True)
class ExecutionBudgetConfig:
    """What one execution may take from the engines (``harness_proxy.budget``); 0: no limit.

    The execution's token sits in its sandbox, so a policy can call the proxy outside its harness;
    these bound what such calls can take from every other execution."""

    max_calls: int
    """Calls the proxy sends to an engine for the execution, in all; past them: 403."""
    max_tokens: int
    """Prompt plus output token ids, summed over the execution's calls (an agent re-sends its whole
    context each call); a call that would start at or past it: 403."""
    max_wall_s: float
    """Seconds from the first call the proxy saw of the execution; a call after them: 403."""
    max_concurrent_calls: int
    """Calls of the execution at an engine at once; one more: 429, which the harness retries."""

    def check(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"execution_budget.{f.name}: want >= 0 (0: no limit), got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    host: str
    port: int
    """0 picks a free port."""
    model_name: str
    """The model id harnesses see (OpenAI `/v1/models`)."""
    max_request_bytes: int
    """A larger body is refused 413, from its Content-Length before any of it is read, or once that
    many bytes of a chunked one are in."""
    read_timeout_s: float
    """A request's head (request line and headers) must be in within this of its first byte (the
    first request of a connection: of its opening), and its body within this of its head; else 408
    and the connection is closed (a slow-loris holds no more than its socket meanwhile)."""
    max_context_tokens: int
    """Prompts longer than this are refused (400), never truncated."""
    max_new_tokens_cap: int
    truncation_ends_turn: bool
    """A call cut by ``max_new_tokens_cap`` (the run's per-turn output budget, below what the harness
    asked) is reported to the harness as an ended turn (``end_turn`` / ``stop``), so a harness such as
    Claude Code does not spend calls asking the model to continue; the CallRecord keeps ``length``.
    A cut at the harness's own ``max_tokens`` is always reported as such."""
    engine_timeout_s: float
    retry_attempts: int
    """Engines tried for one call before the harness gets an error (503 while re-routing)."""
    route_wait_s: float
    """How long a call waits for a serving engine to appear (all cells mid-switch) before 503."""
    affinity_slack: int
    """A new session goes to the server that holds the longest prefix of its prompt (at least
    ``affinity_min_prefix`` ids) while that server has at most this many more calls in flight than
    the least-loaded one; past it, to the least-loaded. 0: only among equally loaded servers."""
    affinity_min_prefix: int
    """Ids of a prompt a server must hold to be preferred for it (``harness_proxy.routing``)."""
    record_ack_timeout_s: float
    """How long a call waits for the processor to acknowledge its CallRecord (in its log) before the
    harness gets a retriable 503 (529 on the Anthropic API). The record stays held and is resent."""
    record_resend_s: float
    """A CallRecord or seal the processor has not acknowledged this long after it went out is sent
    again (a processor restarting on the same address; it drops duplicates)."""
    max_unacked_record_bytes: int
    """Records held unacknowledged past this: new calls are refused with a retriable 503 (529)
    before they reach an engine, rather than held without bound."""
    session_memory_bytes: int
    """What one execution's remembered calls may hold (token ids and message text, as
    ``harness_proxy.sessions`` counts them); past it its oldest calls are forgotten (a later call
    that extended one is rendered from scratch, a branch in its tree)."""
    max_session_bytes: int
    """What all executions' remembered calls and waiting prompts may hold together; past it, new
    calls are refused with a retriable 503 (529 on the Anthropic API) until executions end, before
    the proxy runs out of memory. 0: no limit."""
    execution_budget: ExecutionBudgetConfig
    """What each execution may take from the engines; over it, its calls are refused (403, or 429
    for too many at once) before they reach one."""

    def check(self) -> None:
        if self.affinity_slack < 0 or self.affinity_min_prefix < 1:
            raise ValueError(f"affinity_slack, affinity_min_prefix: want >= 0 and >= 1, got {self.affinity_slack}, "
                             f"{self.affinity_min_prefix}")
        if self.session_memory_bytes < 1:
            raise ValueError(f"session_memory_bytes: want >= 1, got {self.session_memory_bytes}")
        if self.max_session_bytes < 0:
            raise ValueError(f"max_session_bytes: want >= 0 (0: no limit), got {self.max_session_bytes}")
