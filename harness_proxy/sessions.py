"""Exact token-in/token-out across the calls of one agent: splice the engine's own ids back in.

Per (execution id, agent key) a session remembers its latest calls: the request's messages and
tools, and the ids the engine saw and produced. When a new request's messages begin with one of
those calls' messages followed by the assistant message the proxy returned for it, the new prompt
is that call's exact ``prompt_ids + output_ids`` (plus ``<|im_end|>`` if the output did not end
with it, e.g. cut by length), the turn separator, and only the new messages rendered. The policy's
tokens are therefore never re-derived from text, so re-tokenisation cannot drift. Any other
request (history rewritten, tools changed, compaction) is rendered from scratch; the trajectory
processor sees that as a branch.

Messages are compared on role, content and tool calls after normalising: key order ignored,
missing / null / empty content alike, list-of-text-parts content as its text, tool-call arguments
as parsed JSON (a harness may re-serialise them), tool-call ids ignored. Tools are compared as
JSON values (key order ignored). This module keeps no trajectories; it only decides prompt ids.

Cost per spliced call (the hot path of a long conversation): one pass comparing the request's
messages with the remembered ones (no JSON work unless a harness re-serialised a tool call), the
template only for the new messages, and one copy of the remembered ids into the new prompt list;
``remember`` then appends only the new ids. To make that work, the ids of an agent's line of calls
live on one append-only list (a *tape*): a remembered call is ``(tape, length)``, and the next call
that extends it from the tape's end appends in place; a call that branches off an earlier point
copies the prefix onto a new tape. Token ids on tapes are shared ``int`` objects (one per vocabulary
id), so a held id costs 8 bytes, and successive calls share their messages' normalised text.
"""

from __future__ import annotations

import functools
import json
import operator
from collections import deque
from dataclasses import dataclass
from typing import Any

from harness_proxy.template import (
    content_text, generation_prompt, render_appended, render_messages, tool_call_parts, turn_separator,
)
from harness_proxy.tokenizer import QwenTokenizer

NormMessage = tuple[str, str, tuple[tuple[str, str], ...]]
RawArgs = tuple[Any, ...]
"""A message's tool-call arguments as the request carried them (a fast equality check before JSON)."""

PLANS_PER_AGENT = 4
"""Prompt plans kept per agent until ``remember``; more in flight at once only lose the fast path."""


def _canonical_arguments(args: Any) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return args
    return json.dumps(args, sort_keys=True, ensure_ascii=False)


def _tool_calls(m: dict[str, Any]) -> list[tuple[str, Any]]:
    return [tool_call_parts(c) for c in (m.get("tool_calls") or []) if isinstance(c, dict)]


def _role(m: dict[str, Any]) -> str:
    role = str(m.get("role"))
    return "system" if role == "developer" else role


def _content(m: dict[str, Any]) -> str:
    c = m.get("content")
    return c if type(c) is str else content_text(c)


def normalize_message(m: dict[str, Any]) -> NormMessage:
    """The parts of a message that decide its rendering, in a comparable form."""
    calls = tuple((name, _canonical_arguments(args)) for name, args in _tool_calls(m))
    return _role(m), _content(m), calls


def _raw_arguments(m: dict[str, Any]) -> RawArgs:
    return tuple(args for _, args in _tool_calls(m)) if m.get("tool_calls") else ()


def _same_message(m: dict[str, Any], norm: NormMessage, raw: RawArgs) -> bool:
    """``normalize_message(m) == norm``, without JSON work when the arguments came back verbatim."""
    role, content, calls = norm
    if _content(m) != content or _role(m) != role:
        return False
    if not m.get("tool_calls"):
        return not calls
    parts = _tool_calls(m)
    if len(parts) != len(calls):
        return False
    for i, ((name, args), (want_name, want_args)) in enumerate(zip(parts, calls)):
        if name != want_name:
            return False
        # Verbatim (the same string, or the same object the proxy minted) needs no JSON round trip.
        verbatim = args is raw[i] or (type(args) is str and (args == raw[i] or args == want_args))
        if not (verbatim or _canonical_arguments(args) == want_args):
            return False
    return True


def tools_key(tools: list[Any] | None) -> str:
    return json.dumps(tools or [], sort_keys=True, ensure_ascii=False)


@functools.lru_cache(maxsize=4)
def _int_table(size: int) -> tuple[int, ...]:
    """One shared ``int`` object per token id, so a held id is a pointer, not a 32-byte object."""
    return tuple(range(size))


@dataclass(frozen=True, slots=True)
class _Remembered:
    messages: tuple[NormMessage, ...]
    """The call's request messages followed by the assistant reply the proxy returned."""
    raw_args: tuple[RawArgs, ...]
    """Per message, its tool-call arguments as first received (same order as ``messages``)."""
    tools: list[Any]
    """The request's tools as JSON values ([] for none)."""
    tape: list[int]
    length: int
    """``tape[:length]`` = prompt_ids + output_ids (+ <|im_end|>) + turn separator: where the next
    turn's ids begin. Tapes only grow, so this prefix never changes."""


@dataclass(frozen=True, slots=True)
class _Plan:
    """What ``build_prompt`` decided, kept so ``remember`` appends instead of redoing the work."""

    prompt_ids: list[int]
    num_prompt: int
    messages: list[dict[str, Any]]
    base: _Remembered | None
    """The remembered call the prompt extends (None: rendered from scratch)."""


@dataclass(frozen=True, slots=True)
class PromptPlan:
    prompt_ids: list[int]
    spliced: bool
    """True when built on an earlier call's exact ids; False when rendered from scratch."""
    num_new_messages: int
    """Messages rendered for this prompt (all of them when not spliced)."""


class SessionStore:
    """Remembered calls per (execution id, agent key); each agent keeps its newest ``calls_per_agent``.

    More than one is kept so that a side call sharing the prefix (a compaction summary, a
    retried turn) does not break the main line's splice. ``remember`` expects the ``prompt_ids``
    list that ``build_prompt`` returned, unmodified (any other list works too, by a slower path).
    """

    def __init__(self, tok: QwenTokenizer, *, calls_per_agent: int = 2):
        if calls_per_agent < 1:
            raise ValueError("calls_per_agent: want >= 1")
        self.tok = tok
        self.calls_per_agent = calls_per_agent
        self._sessions: dict[str, dict[str, deque[_Remembered]]] = {}
        self._plans: dict[str, dict[str, deque[_Plan]]] = {}
        self._ints = _int_table(tok.vocab_size)
        self._generation_prompt = self._shared(generation_prompt(tok))
        self._separator = self._shared(turn_separator(tok))

    def _shared(self, ids: list[int]) -> list[int]:
        """``ids`` as the table's int objects (ids outside the vocabulary stay as they are)."""
        table = self._ints
        if len(ids) > 1 and 0 <= min(ids) and max(ids) < len(table):
            return list(operator.itemgetter(*ids)(table))
        return [table[t] if 0 <= t < len(table) else t for t in ids]

    def build_prompt(
        self, execution_id: str, agent: str, messages: list[dict[str, Any]], tools: list[Any] | None
    ) -> PromptPlan:
        best = self._best_match(execution_id, agent, messages, tools or [])
        if best is None:
            ids = self._shared(render_messages(self.tok, messages, tools=tools))
            plan = PromptPlan(ids, False, len(messages))
        else:
            new = messages[len(best.messages) :]
            ids = best.tape[: best.length]
            ids += self._shared(render_appended(self.tok, new))
            ids += self._generation_prompt
            plan = PromptPlan(ids, True, len(new))
        agents = self._plans.setdefault(execution_id, {})
        agents.setdefault(agent, deque(maxlen=PLANS_PER_AGENT)).append(_Plan(ids, len(ids), messages, best))
        return plan

    def _best_match(
        self, execution_id: str, agent: str, messages: list[dict[str, Any]], tools: list[Any]
    ) -> _Remembered | None:
        """The longest remembered call whose messages (and tools) the request begins with; newest on ties."""
        best: _Remembered | None = None
        for cand in reversed(self._sessions.get(execution_id, {}).get(agent, ())):
            n = len(cand.messages)
            if len(messages) < n or (best is not None and n <= len(best.messages)) or cand.tools != tools:
                continue
            if all(map(_same_message, messages[:n], cand.messages, cand.raw_args)):
                best = cand
        return best

    def remember(
        self,
        execution_id: str,
        agent: str,
        *,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
        reply: dict[str, Any],
        prompt_ids: list[int],
        output_ids: list[int],
    ) -> None:
        """Record a successful call; ``reply`` is the assistant message returned to the harness."""
        plan = self._take_plan(execution_id, agent, prompt_ids, messages)
        base = plan.base if plan is not None else None
        known = len(base.messages) if base is not None else 0
        new = messages[known:]
        norms = (*(base.messages if base else ()), *map(normalize_message, new), normalize_message(reply))
        raws = (*(base.raw_args if base else ()), *map(_raw_arguments, new), _raw_arguments(reply))
        tail = self._shared(output_ids)
        if not output_ids or output_ids[-1] != self.tok.im_end:
            tail.append(self._ints[self.tok.im_end])
        tail += self._separator
        if base is not None and len(base.tape) == base.length:  # the line's newest end: append in place
            tape = base.tape
            tape += prompt_ids[base.length :]
        else:  # a first call, a branch, or a prompt not planned here: a tape of its own
            tape = prompt_ids.copy() if plan is not None else self._shared(prompt_ids)
        tape += tail
        entry = _Remembered(
            messages=norms, raw_args=raws, tools=base.tools if base is not None else list(tools or []),
            tape=tape, length=len(tape),
        )
        agents = self._sessions.setdefault(execution_id, {})
        agents.setdefault(agent, deque(maxlen=self.calls_per_agent)).append(entry)

    def _take_plan(
        self, execution_id: str, agent: str, prompt_ids: list[int], messages: list[dict[str, Any]]
    ) -> _Plan | None:
        plans = self._plans.get(execution_id, {}).get(agent)
        for plan in plans or ():
            if plan.prompt_ids is prompt_ids:
                plans.remove(plan)  # type: ignore[union-attr]
                # Trust the plan only if nothing changed the prompt or the messages since.
                ok = plan.messages is messages and len(prompt_ids) == plan.num_prompt
                return plan if ok else None
        return None

    def drop_execution(self, execution_id: str) -> None:
        self._sessions.pop(execution_id, None)
        self._plans.pop(execution_id, None)

    def num_executions(self) -> int:
        return len(self._sessions)
