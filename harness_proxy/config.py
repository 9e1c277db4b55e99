"""Typed mirror of conf/proxy/*.yaml."""

from __future__ import annotations

from dataclasses import dataclass


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
    record_ack_timeout_s: float
    """How long a call waits for the processor to acknowledge its CallRecord (in its log) before the
    harness gets a retriable 503 (529 on the Anthropic API). The record stays held and is resent."""
    record_resend_s: float
    """A CallRecord or seal the processor has not acknowledged this long after it went out is sent
    again (a processor restarting on the same address; it drops duplicates)."""
    max_unacked_record_bytes: int
    """Records held unacknowledged past this: new calls are refused with a retriable 503 (529)
    before they reach an engine, rather than held without bound."""
