"""Whose line of calls each call of an execution is: the rules, over what the session store holds.

**Lineage.** Claude Code says who is calling (the ``x-claude-code-agent-id`` header, its summary
instruction, the title call's shape; ``anthropic_api.lineage_of``): the server passes that as
``lineage`` (``given_line``) and the store only splices. Where no header says it (the OpenAI API: Qwen Code,
mini-swe-agent, the bundled harness), ``derive_line`` derives it from the structure of the calls (which
remembered call a prompt extends, where a new conversation starts, which waiting tool call handed
it its task), first rule that applies; each call's ``reason`` (``REASONS``, on its CallRecord as
``lineage_reason``) names the rule, and ``+summary-marker`` where a harness-specific summary text
(a hint, nothing more) made it a ``-summary`` call:

1. *first*: the execution's first call is ``main``.
2. *extends*: a call that extends a remembered call inherits that call's line (its lineage and
   agent id).
3. *branch*: a call that shares with a known line at least that line's whole first request (its
   system prompt and task) and then differs (history edited, tools changed, a retry) stays on that
   line.
4. *system-changed* / *over*: a call that repeats a known line's conversation (at least its first
   request, after the system prompt) under *another* system prompt. When the two system prompts
   are one agent's (what they share at the start and the end is at least ``SYSTEM_VARIANT_SHARE``
   of the longer: a timestamp, a directory listing or a memory index changed), the line goes on
   (*system-changed*). Else it is a task run over that history (*over*): a summary of that line
   (``main-summary`` / ``sub-agent-summary``) when its last user message holds a summary
   instruction (``SUMMARY_MARKERS``: Qwen Code's ``<state_snapshot>`` compression), else ``side``
   (Qwen Code's memory extraction, loop detection).
5. *rewrite*: a call whose user or system messages quote, verbatim, the text of a recent reply of
   a known non-side line (a compaction summary put back as the new history) continues that line.
6. *hand-off*: a call whose user message holds a string argument of a tool call that is still
   waiting for its result (in the newest reply of a non-side line: Qwen Code's ``agent`` tool
   ``prompt``, Claude Code's ``Agent``) is a new ``sub-agent``.
7. *new-conversation*: a call under the system prompt of a non-side line (or one of its variants,
   as in rule 4) that opens a new task is a new ``sub-agent``.
8. *else*: a one-off call outside every line (another system prompt, nothing handed to it) is
   ``side``; if it continues, rule 2 keeps it ``side``.

Rules 1-3 are the hot path (the store's walk that finds the splice also finds the branch point);
4-8 run only for a call that extends nothing. Each new sub-agent line gets a derived agent id
``sub-<n>`` (n counts the execution's derived sub-agents from 1), each side line the routing key
``side-<n>`` (its records carry agent id ''). A call on a line whose last user message holds a
summary marker is that line's ``-summary``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from harness_proxy.session_messages import message_role, message_text
from harness_proxy.session_state import ExecutionSessions, Line, Node, Remembered

HANDOFF_MIN_CHARS = 24
"""A tool-call string argument shorter than this is not taken as a task handed to a sub-agent."""
QUOTE_MIN_CHARS = 64
"""A reply shorter than this is not taken as quoted by a rewritten history."""
SUMMARY_MARKERS = (
    "Your task is to create a detailed summary",  # Claude Code's compaction instruction
    "generate the <state_snapshot>",  # Qwen Code's chat compression instruction
)
"""Text in the last user message of a call that asks for a summary of its line's history: a hint, named
as such in the call's ``lineage_reason``."""
SYSTEM_VARIANT_SHARE = 0.5
"""Two system prompts are one agent's when what they share at the start and the end is at least this
share of the longer one: a timestamp, a directory listing or a memory index changed, not the agent."""
REASONS = (
    "header",  # the harness said who calls (Claude Code's agent id header, title shape)
    "first",  # the execution's first call
    "extends",  # the prompt extends a remembered call of the line
    "branch",  # shares the line's first request, then differs (history edited, a retry)
    "system-changed",  # the line's conversation under a variant of its system prompt
    "over",  # a line's conversation under another agent's system prompt (memory extraction, loop check)
    "rewrite",  # quotes a recent reply of the line (a compaction put back as history)
    "handoff",  # its task is a string of a tool call still waiting for its result
    "new-conversation",  # the system prompt of a line, a new task
    "else",  # none of the above
    "restored",  # a restarted proxy re-read it from the processor's log
)
"""Why a call got its lineage (``CallRecord.lineage_reason``); ``+summary-marker`` is appended when a
summary marker (a hint) made it a ``-summary`` call."""


def is_summary_request(messages: list[dict[str, Any]]) -> bool:
    """The last user message holds one of ``SUMMARY_MARKERS``."""
    for m in reversed(messages):
        if message_role(m) == "user":
            text = message_text(m)
            return any(marker in text for marker in SUMMARY_MARKERS)
    return False


def same_agent(system_a: str, system_b: str) -> bool:
    """Two system prompts of one agent: what they share at the start and at the end is at least
    ``SYSTEM_VARIANT_SHARE`` of the longer (a timestamp or a listing changed, not the instructions)."""
    longest = max(len(system_a), len(system_b))
    if longest == 0:
        return True
    head = len(os.path.commonprefix([system_a, system_b]))
    tail = len(os.path.commonprefix([system_a[head:][::-1], system_b[head:][::-1]]))
    return head + tail >= SYSTEM_VARIANT_SHARE * longest


def _strings(value: Any, out: list[str]) -> list[str]:
    if isinstance(value, str):
        if len(value) >= HANDOFF_MIN_CHARS:
            out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _strings(v, out)
    elif isinstance(value, list):
        for v in value:
            _strings(v, out)
    return out


def given_line(exe: ExecutionSessions, lineage: str, agent: str, agent_id: str, task_len: int) -> Line:
    """The line a header named (``agent``), begun anew where it has none of that lineage yet."""
    line = exe.lines.get(agent)
    base = lineage.removesuffix("-summary")
    if line is None or line.lineage != base:
        line = exe.lines[agent] = Line(base, agent, agent_id, task_len)
    return line


def _new_line(exe: ExecutionSessions, lineage: str, task_len: int) -> Line:
    if lineage == "sub-agent":
        exe.num_sub_agents += 1
        agent = agent_id = f"sub-{exe.num_sub_agents}"
    elif lineage == "side":
        exe.num_side += 1
        agent, agent_id = f"side-{exe.num_side}", ""
    else:
        agent = agent_id = ""
    line = exe.lines[agent] = Line(lineage, agent, agent_id, task_len)
    return line


def derive_line(
    exe: ExecutionSessions, messages: list[dict[str, Any]], best: Remembered | None, reached: Node
) -> tuple[Line, str, str]:
    """The call's line, lineage and the reason for it, by the rules of the module docstring."""
    line, reason = _line_of(exe, messages, best, reached)
    if line.lineage != "side" and is_summary_request(messages):
        return line, f"{line.lineage}-summary", f"{reason}+summary-marker"
    return line, line.lineage, reason


def _line_of(
    exe: ExecutionSessions, messages: list[dict[str, Any]], best: Remembered | None, reached: Node
) -> tuple[Line, str]:
    if best is not None:  # 2. extends
        return best.line, "extends"
    if not exe.lines:  # 1. first
        return _new_line(exe, "main", len(messages)), "first"
    if reached.line is not None and reached.depth >= reached.line.task_len:  # 3. branch
        return reached.line, "branch"
    system = messages[0] if messages and message_role(messages[0]) == "system" else None
    own = reached if reached.depth >= 1 else None  # the node of its system prompt, if known
    own_root = own
    while own_root is not None and own_root.depth > 1:
        own_root = own_root.parent
    if system is not None:  # 4. a line's conversation under another system prompt
        over = _over(exe, messages, own_root)
        if over is not None:
            top, line = over
            if line.lineage != "side" and same_agent(top.norm[1], message_text(system)):
                return line, "system-changed"
            if line.lineage != "side" and is_summary_request(messages):
                return line, "over"
            return _new_line(exe, "side", len(messages)), "over"
    texts = [message_text(m) for m in messages[1:] if message_role(m) in ("user", "system")]
    for norm, line in reversed(exe.replies):  # 5. rewrite
        reply = norm[1]
        if line.lineage != "side" and len(reply) >= QUOTE_MIN_CHARS and any(reply in t for t in texts):
            return line, "rewrite"
    user_texts = [message_text(m) for m in messages if message_role(m) == "user"]
    for line in reversed(exe.lines.values()):  # 6. hand-off: a tool call still waiting for its result
        if line.lineage == "side" or line.last_reply is None:
            continue
        for _name, args in line.last_reply[2]:
            try:
                handed = _strings(json.loads(args), [])
            except ValueError:
                handed = [args] if len(args) >= HANDOFF_MIN_CHARS else []
            if any(s in t for s in handed for t in user_texts):
                return _new_line(exe, "sub-agent", len(messages)), "handoff"
    if system is not None and _agent_system(exe, message_text(system), own_root):  # 7. a new task
        return _new_line(exe, "sub-agent", len(messages)), "new-conversation"
    return _new_line(exe, "side", len(messages)), "else"  # 8. else


def _over(exe: ExecutionSessions, messages: list[dict[str, Any]], own_root: Node | None) -> tuple[Node, Line] | None:
    """The deepest known line whose conversation (at least its first request, after the system
    prompt) the request repeats under another system prompt: (that system prompt's node, the line)."""
    found: tuple[int, Node, Line] | None = None
    for top in exe.root.children:
        if top is own_root or top.norm[0] != "system":
            continue
        node = top
        for m in messages[1:]:
            nxt = node.child(m)
            if nxt is None:
                break
            node = nxt
        line = node.line
        if node.depth >= 2 and line is not None and node.depth >= line.task_len:
            if found is None or node.depth > found[0] or (found[2].lineage == "side" and line.lineage != "side"):
                found = (node.depth, top, line)
    return None if found is None else (found[1], found[2])


def _agent_system(exe: ExecutionSessions, system: str, own_root: Node | None) -> bool:
    """The system prompt is (a variant of) one a non-side line runs under."""
    if own_root is not None and own_root.norm[0] == "system":
        return own_root.line is not None and own_root.line.lineage != "side"
    return any(top.norm[0] == "system" and top.line is not None and top.line.lineage != "side"
               and same_agent(top.norm[1], system) for top in exe.root.children)
