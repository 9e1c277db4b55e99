"""What the session store holds per execution (``harness_proxy.sessions``): a trie of the messages
of all its calls, its lines of calls, its remembered calls on their tapes of ids, and the prompt
plans of the calls at an engine. Plain data; the store decides what goes in and what is forgotten,
the lineage rules (``harness_proxy.lineage``) read it to place a call on a line.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from harness_proxy.session_messages import NormMessage, RawArgs, same_message

RECENT_REPLIES = 32
"""Replies per execution looked at by the hand-off and rewrite rules."""


@dataclass(eq=False, slots=True)
class Line:
    """A line of calls: the main agent, one sub-agent, one side task (or a header-given agent)."""

    lineage: str
    """main | sub-agent | side (a call on it may add ``-summary``)."""
    agent: str
    """The session and routing key."""
    agent_id: str
    """Recorded on the CallRecord ('' for main and side)."""
    task_len: int
    """Messages in the line's first request (its system prompt and task)."""
    last_reply: NormMessage | None = None
    """The newest reply on the line: its tool calls wait for their results (a hand-off's source)."""


@dataclass(eq=False, slots=True)
class Node:
    """One remembered message at one position: a trie over the messages of all of an execution's calls."""

    norm: NormMessage
    raw: RawArgs
    parent: Node | None
    depth: int
    """Messages from the start through this one."""
    line: Line | None
    """The line of the call that first remembered this message."""
    cost: int
    children: list[Node] = field(default_factory=list)
    calls: list[Remembered] = field(default_factory=list)
    """Remembered calls whose messages (request + reply) end here, oldest first."""

    def child(self, m: dict[str, Any]) -> Node | None:
        for c in self.children:
            if same_message(m, c.norm, c.raw):
                return c
        return None


@dataclass(eq=False, slots=True)
class Remembered:
    node: Node
    """The node of the assistant reply the proxy returned (its path: the request's messages)."""
    tools: list[Any]
    """The request's tools as JSON values ([] for none), one object per distinct value."""
    tape: list[int]
    length: int
    """``tape[:length]`` = prompt_ids + output_ids (+ <|im_end|>) + turn separator: where the next
    turn's ids begin. Tapes only grow, so this prefix never changes."""
    norms: list[NormMessage]
    raws: list[RawArgs]
    """The messages of the path to ``node`` (``[:node.depth]``), shared along a tape like its ids:
    the hot path compares a request with them in one C-level pass."""
    line: Line
    call_id: str = ""
    forgotten: bool = False
    """Set once dropped for memory: a plan built on it no longer appends to its tape or trie path."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What ``build_prompt`` decided, kept so ``remember`` appends instead of redoing the work."""

    prompt_ids: list[int]
    num_prompt: int
    messages: list[dict[str, Any]]
    base: Remembered | None
    """The remembered call the prompt extends (None: rendered from scratch)."""
    line: Line
    tools: list[Any] | None
    """The execution's object for the request's tools (None: not seen before)."""


@dataclass(eq=False)
class ExecutionSessions:
    """One execution's sessions: the trie of its messages, its remembered calls and lines, its plans."""

    root: Node
    calls: deque[Remembered] = field(default_factory=deque)
    """Remembered calls, oldest first (the order they are forgotten in)."""
    tools: list[list[Any]] = field(default_factory=list)
    """Distinct tools values seen, so calls compare theirs by identity."""
    tape_refs: dict[int, int] = field(default_factory=dict)
    """id(tape) -> remembered calls on it."""
    tips: OrderedDict[int, Remembered] = field(default_factory=OrderedDict)
    """id(tape) -> the newest call on it, least recently extended first."""
    bytes: int = 0
    replies: deque[tuple[NormMessage, Line]] = field(default_factory=lambda: deque(maxlen=RECENT_REPLIES))
    plans: OrderedDict[int, Plan] = field(default_factory=OrderedDict)
    lines: dict[str, Line] = field(default_factory=dict)
    """Lines by agent key."""
    num_sub_agents: int = 0
    num_side: int = 0
    by_call: dict[str, Remembered] = field(default_factory=dict)
    """Remembered calls by call id (a restored call names its base by it)."""
    plan_bytes: int = 0
    """What the prompt plans waiting for ``remember`` hold (their prompt ids)."""
