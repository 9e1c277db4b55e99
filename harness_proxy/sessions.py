"""Exact token-in/token-out across the calls of one agent: splice the engine's own ids back in.

Per (execution id, agent key) a session remembers its latest calls: the request's messages and
tools, and the ids the engine saw and produced. When a new request's messages begin with one of
those calls' messages followed by the assistant message the proxy returned for it, the new prompt
is that call's exact ``prompt_ids + output_ids`` (plus ``<|im_end|>`` if the output did not end
with it, e.g. cut by length), the turn separator, and only the new messages rendered. The policy's
tokens are therefore never re-derived from text, so re-tokenisation cannot drift, and the work per
call is proportional to what is new. Any other request (history rewritten, tools changed,
compaction) is rendered from scratch; the trajectory processor sees that as a branch.

Messages are compared on role, content and tool calls after normalising: key order ignored,
missing / null / empty content alike, list-of-text-parts content as its text, tool-call arguments
as parsed JSON (a harness may re-serialise them), tool-call ids ignored. This module keeps no
trajectories; it only decides prompt ids.
"""

from __future__ import annotations

import json
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any

from harness_proxy.template import (
    content_text, generation_prompt, render_appended, render_messages, tool_call_parts, turn_separator,
)
from harness_proxy.tokenizer import QwenTokenizer

NormMessage = tuple[str, str, tuple[tuple[str, str], ...]]


def _canonical_arguments(args: Any) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return args
    return json.dumps(args, sort_keys=True, ensure_ascii=False)


def normalize_message(m: dict[str, Any]) -> NormMessage:
    """The parts of a message that decide its rendering, in a comparable form."""
    role = str(m.get("role"))
    if role == "developer":
        role = "system"
    calls = tuple(
        (name, _canonical_arguments(args))
        for name, args in (tool_call_parts(c) for c in (m.get("tool_calls") or []) if isinstance(c, dict))
    )
    return role, content_text(m.get("content")), calls


def tools_key(tools: list[Any] | None) -> str:
    return json.dumps(tools or [], sort_keys=True, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class _Remembered:
    messages: tuple[NormMessage, ...]
    """The call's request messages followed by the assistant reply the proxy returned."""
    tools_key: str
    context_ids: array
    """prompt_ids + output_ids (+ <|im_end|>) + turn separator: where the next turn's ids begin."""


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
    retried turn) does not break the main line's splice. Ids are stored as 32-bit arrays.
    """

    def __init__(self, tok: QwenTokenizer, *, calls_per_agent: int = 2):
        if calls_per_agent < 1:
            raise ValueError("calls_per_agent: want >= 1")
        self.tok = tok
        self.calls_per_agent = calls_per_agent
        self._sessions: dict[str, dict[str, deque[_Remembered]]] = {}

    def build_prompt(
        self, execution_id: str, agent: str, messages: list[dict[str, Any]], tools: list[Any] | None
    ) -> PromptPlan:
        norm = [normalize_message(m) for m in messages]
        key = tools_key(tools)
        best: _Remembered | None = None
        for cand in reversed(self._sessions.get(execution_id, {}).get(agent, ())):
            n = len(cand.messages)
            if cand.tools_key != key or len(norm) < n or (best is not None and n <= len(best.messages)):
                continue
            if tuple(norm[:n]) == cand.messages:
                best = cand
        if best is None:
            return PromptPlan(render_messages(self.tok, messages, tools=tools), False, len(messages))
        new = messages[len(best.messages) :]
        ids = best.context_ids.tolist()
        ids += render_appended(self.tok, new)
        ids += generation_prompt(self.tok)
        return PromptPlan(ids, True, len(new))

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
        context = array("i", prompt_ids)
        context.extend(output_ids)
        if not output_ids or output_ids[-1] != self.tok.im_end:
            context.append(self.tok.im_end)
        context.extend(turn_separator(self.tok))
        entry = _Remembered(
            messages=(*(normalize_message(m) for m in messages), normalize_message(reply)),
            tools_key=tools_key(tools),
            context_ids=context,
        )
        agents = self._sessions.setdefault(execution_id, {})
        agents.setdefault(agent, deque(maxlen=self.calls_per_agent)).append(entry)

    def drop_execution(self, execution_id: str) -> None:
        self._sessions.pop(execution_id, None)

    def num_executions(self) -> int:
        return len(self._sessions)
