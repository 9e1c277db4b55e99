"""Exact token-in/token-out across the calls of an execution, and whose line of calls each one is.

**Splicing.** Per execution the store remembers its calls: the request's messages and tools, the
assistant reply the proxy returned, and the ids the engine saw and produced. When a new request's
messages begin with one of those calls' messages followed by its reply (and its tools are the
same), the new prompt is that call's exact ``prompt_ids + output_ids`` (plus ``<|im_end|>`` if the
output did not end with it, e.g. cut by length), the turn separator, and only the new messages
rendered. The base is the *longest* such call among **all** the execution's remembered calls,
whichever agent made it (newest on ties), so a sub-agent or side call in between never pushes the
main line out. The policy's tokens are therefore never re-derived from text, so re-tokenisation
cannot drift. Any other request (history rewritten, tools changed, a new task) is rendered from
scratch; the trajectory processor sees that as a branch.

Messages are compared on role, content and tool calls after normalising: key order ignored,
missing / null / empty content alike, list-of-text-parts content as its text, tool-call arguments
as parsed JSON (a harness may re-serialise them), tool-call ids ignored. Tools are compared as
JSON values (key order ignored). This module keeps no trajectories; it decides prompt ids and
lineage.

**Memory, not a count.** What an execution holds is bounded by ``memory_bytes``
(``proxy.session_memory_bytes``; approximate: 8 bytes per remembered id, the length of each
remembered message's text, a fixed overhead per message): past it, the oldest calls are forgotten
first (the newest always stays), and a tape or message no remembered call needs any more is freed.
Nothing is forgotten by count. The prompt plans of calls at an engine are counted apart (8 bytes
an id) and dropped when a call fails; ``total_bytes`` sums everything, which the server holds
under ``proxy.max_session_bytes``.

**Lineage.** Claude Code says who is calling (the ``x-claude-code-agent-id`` header, its summary
instruction, the title call's shape; ``anthropic_api.lineage_of``): the server passes that as
``lineage`` and the store only splices. Where no header says it (the OpenAI API: Qwen Code,
mini-swe-agent, the bundled harness), the store derives it from the structure of the calls (which
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

**Restarts.** ``remember`` returns what it remembered of the call (``wire.SessionEntry``: the
call it was spliced onto, the messages after that call's, the reply, the tools where they changed,
the line), which goes out on the call's CallRecord; ``restore`` remembers a call again from its
record. A restarted proxy reads an execution's records back from the processor's log before it
answers the execution's next call, so splicing, lineage and the line's agent ids go on exactly.

Rules 1-3 are the hot path (the walk that finds the splice also finds the branch point); 4-8 run
only for a call that extends nothing. Each new sub-agent line gets a derived agent id
``sub-<n>`` (n counts the execution's derived sub-agents from 1), each side line the routing key
``side-<n>`` (its records carry agent id ''). A call on a line whose last user message holds a
summary marker is that line's ``-summary``.

Cost per spliced call (the hot path of a long conversation): one pass comparing the request's
messages with those of the ends of the most recent lines (``TIPS_CHECKED``), then a walk of the
message trie (shared by all calls) over only what follows; no JSON work unless a harness
re-serialised a tool call; the template only for the new messages, and one copy of the remembered
ids into the new prompt list; ``remember`` then appends only the new ids and messages. To make
that work, the ids (and the messages) of a line of calls live on append-only lists (a *tape*): a
remembered call is ``(tape, length)``, and the next call that extends it from the tape's end
appends in place; a call that branches off an earlier point copies the prefix onto a new tape.
No step is quadratic in the number of calls: the trie holds each distinct message once, and the
derivation rules 4-8, which look further, run only for calls that extend nothing. Token ids on tapes are shared
``int`` objects (one per vocabulary id), so a held id costs 8 bytes, and successive calls share
their messages' normalised text.
"""

from __future__ import annotations

import functools
import json
import operator
import os
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from base import wire
from harness_proxy.template import (
    content_text, generation_prompt, render_appended, render_messages, tool_call_parts, turn_separator,
)
from base.tokenizer import QwenTokenizer

NormMessage = tuple[str, str, tuple[tuple[str, str], ...]]
RawArgs = tuple[Any, ...]
"""A message's tool-call arguments as the request carried them (a fast equality check before JSON)."""

SESSION_MEMORY_BYTES = 64 << 20
"""Default bound on what one execution's remembered calls hold (ids and message text)."""
PLANS_PER_EXECUTION = 64
"""Prompt plans kept per execution until ``remember``; more in flight at once only lose the fast path."""
NODE_OVERHEAD_BYTES = 200
"""Counted per remembered message on top of its text (the node, its tuples and lists)."""
TIPS_CHECKED = 8
"""Line ends (newest first) a request is compared with before the trie walk."""
RECENT_REPLIES = 32
"""Replies per execution looked at by the hand-off and rewrite rules."""
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


def is_summary_request(messages: list[dict[str, Any]]) -> bool:
    """The last user message holds one of ``SUMMARY_MARKERS``."""
    for m in reversed(messages):
        if _role(m) == "user":
            text = _content(m)
            return any(marker in text for marker in SUMMARY_MARKERS)
    return False


def _wire_message(norm: NormMessage) -> wire.SessionMessage:
    role, content, calls = norm
    return wire.SessionMessage(role=_utf8(role), content=_utf8(content),
                               tool_calls=[[_utf8(name), _utf8(args)] for name, args in calls])


def _utf8(text: str) -> str:
    """``text``, or, where JSON escapes gave it lone surrogates (UTF-8 cannot carry them), with those
    replaced: such a message no longer matches after a restore, and the call after it is rendered
    from scratch (a branch in the tree), never refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text


def _message(m: wire.SessionMessage) -> dict[str, Any]:
    """A message that normalises back to ``m`` (its arguments are canonical JSON already)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"function": {"name": name, "arguments": args}} for name, args in m.tool_calls]
    return out


def _same_agent(system_a: str, system_b: str) -> bool:
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


@functools.lru_cache(maxsize=4)
def _int_table(size: int) -> tuple[int, ...]:
    """One shared ``int`` object per token id, so a held id is a pointer, not a 32-byte object."""
    return tuple(range(size))


@dataclass(eq=False, slots=True)
class _Line:
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
class _Node:
    """One remembered message at one position: a trie over the messages of all of an execution's calls."""

    norm: NormMessage
    raw: RawArgs
    parent: _Node | None
    depth: int
    """Messages from the start through this one."""
    line: _Line | None
    """The line of the call that first remembered this message."""
    cost: int
    children: list[_Node] = field(default_factory=list)
    calls: list[_Remembered] = field(default_factory=list)
    """Remembered calls whose messages (request + reply) end here, oldest first."""

    def child(self, m: dict[str, Any]) -> _Node | None:
        for c in self.children:
            if _same_message(m, c.norm, c.raw):
                return c
        return None


@dataclass(eq=False, slots=True)
class _Remembered:
    node: _Node
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
    line: _Line
    call_id: str = ""
    forgotten: bool = False
    """Set once dropped for memory: a plan built on it no longer appends to its tape or trie path."""


@dataclass(frozen=True, slots=True)
class _Plan:
    """What ``build_prompt`` decided, kept so ``remember`` appends instead of redoing the work."""

    prompt_ids: list[int]
    num_prompt: int
    messages: list[dict[str, Any]]
    base: _Remembered | None
    """The remembered call the prompt extends (None: rendered from scratch)."""
    line: _Line
    tools: list[Any] | None
    """The execution's object for the request's tools (None: not seen before)."""


@dataclass(eq=False)
class _Execution:
    root: _Node
    calls: deque[_Remembered] = field(default_factory=deque)
    """Remembered calls, oldest first (the order they are forgotten in)."""
    tools: list[list[Any]] = field(default_factory=list)
    """Distinct tools values seen, so calls compare theirs by identity."""
    tape_refs: dict[int, int] = field(default_factory=dict)
    """id(tape) -> remembered calls on it."""
    tips: OrderedDict[int, _Remembered] = field(default_factory=OrderedDict)
    """id(tape) -> the newest call on it, least recently extended first."""
    bytes: int = 0
    replies: deque[tuple[NormMessage, _Line]] = field(default_factory=lambda: deque(maxlen=RECENT_REPLIES))
    plans: OrderedDict[int, _Plan] = field(default_factory=OrderedDict)
    lines: dict[str, _Line] = field(default_factory=dict)
    """Lines by agent key."""
    num_sub_agents: int = 0
    num_side: int = 0
    by_call: dict[str, _Remembered] = field(default_factory=dict)
    """Remembered calls by call id (a restored call names its base by it)."""
    plan_bytes: int = 0
    """What the prompt plans waiting for ``remember`` hold (their prompt ids)."""


@dataclass(frozen=True, slots=True)
class PromptPlan:
    prompt_ids: list[int]
    spliced: bool
    """True when built on an earlier call's exact ids; False when rendered from scratch."""
    num_new_messages: int
    """Messages rendered for this prompt (all of them when not spliced)."""
    lineage: str = "main"
    """main | main-summary | sub-agent | sub-agent-summary | side: given, or derived (module docstring)."""
    agent: str = ""
    """The session and routing key of the call's line."""
    agent_id: str = ""
    """For the CallRecord: the harness's or the derived sub-agent id ('' for main and side)."""
    reason: str = "first"
    """Why the lineage (``REASONS``, maybe with ``+summary-marker``)."""


class SessionStore:
    """Remembered calls per execution, bounded by ``memory_bytes`` each; see the module docstring.

    ``remember`` expects the ``prompt_ids`` list that ``build_prompt`` returned, unmodified (any
    other list works too, by a slower path).
    """

    def __init__(self, tok: QwenTokenizer, *, memory_bytes: int = SESSION_MEMORY_BYTES):
        if memory_bytes < 1:
            raise ValueError("memory_bytes: want >= 1")
        self.tok = tok
        self.memory_bytes = memory_bytes
        self._executions: dict[str, _Execution] = {}
        self._ints = _int_table(tok.vocab_size)
        self._generation_prompt = self._shared(generation_prompt(tok))
        self._separator = self._shared(turn_separator(tok))

    def _shared(self, ids: list[int]) -> list[int]:
        """``ids`` as the table's int objects (ids outside the vocabulary stay as they are)."""
        table = self._ints
        if len(ids) > 1 and 0 <= min(ids) and max(ids) < len(table):
            return list(operator.itemgetter(*ids)(table))
        return [table[t] if 0 <= t < len(table) else t for t in ids]

    def _execution(self, execution_id: str) -> _Execution:
        exe = self._executions.get(execution_id)
        if exe is None:
            root = _Node(("", "", ()), (), None, 0, None, 0)
            exe = self._executions[execution_id] = _Execution(root)
        return exe

    # ------------------------------------------------------------ planning a call

    def build_prompt(
        self, execution_id: str, agent: str, messages: list[dict[str, Any]], tools: list[Any] | None,
        *, lineage: str | None = None, agent_id: str = "",
    ) -> PromptPlan:
        """The call's prompt ids and line. ``lineage`` (with ``agent``, ``agent_id``): what a header
        said; None derives it (then ``agent`` is not used)."""
        exe = self._execution(execution_id)
        want_tools = next((t for t in exe.tools if t == (tools or [])), None)
        best, reached = self._walk(exe, messages, want_tools)
        if lineage is None:
            line, lineage, reason = self._derive(exe, messages, best, reached)
        else:
            line = self._given_line(exe, lineage, agent, agent_id, len(messages))
            reason = "header+summary-marker" if lineage.endswith("-summary") else "header"
        if best is None:
            ids = self._shared(render_messages(self.tok, messages, tools=tools))
            plan = PromptPlan(ids, False, len(messages), lineage, line.agent, line.agent_id, reason)
        else:
            new = messages[best.node.depth :]
            ids = best.tape[: best.length]
            ids += self._shared(render_appended(self.tok, new))
            ids += self._generation_prompt
            plan = PromptPlan(ids, True, len(new), lineage, line.agent, line.agent_id, reason)
        exe.plans[id(ids)] = _Plan(ids, len(ids), messages, best, line, want_tools)
        exe.plan_bytes += 8 * len(ids)
        while len(exe.plans) > PLANS_PER_EXECUTION:
            exe.plan_bytes -= 8 * exe.plans.popitem(last=False)[1].num_prompt
        return plan

    def discard_plan(self, execution_id: str, prompt_ids: list[int]) -> None:
        """Forget the plan of a call that failed (``remember`` will not come for it)."""
        exe = self._executions.get(execution_id)
        if exe is not None:
            plan = exe.plans.get(id(prompt_ids))
            if plan is not None and plan.prompt_ids is prompt_ids:
                del exe.plans[id(prompt_ids)]
                exe.plan_bytes -= 8 * plan.num_prompt
            if not exe.calls and not exe.plans:
                del self._executions[execution_id]

    def _walk(
        self, exe: _Execution, messages: list[dict[str, Any]], tools: list[Any] | None
    ) -> tuple[_Remembered | None, _Node]:
        """The longest remembered call whose messages (and tools) the request begins with, newest on
        ties; and the deepest node the request's messages reach (where it leaves what is known)."""
        best: _Remembered | None = None
        node = exe.root
        same = _same_message
        start = 0
        # The hot path: a request that extends the end of a recent line is checked against that
        # line's messages in one pass; the trie walk then only covers what follows (and any longer
        # call, which can only lie below that end). Tools that differ there: the full walk.
        n = len(messages)
        for k, tip in enumerate(reversed(exe.tips.values())):
            if k == TIPS_CHECKED:
                break
            d = tip.node.depth
            if start < d <= n and all(map(same, messages, tip.norms, tip.raws)):
                node, start = tip.node, d
        if start:
            for cand in reversed(node.calls):
                if cand.tools is tools:
                    best = cand
                    break
            if best is None:
                node, start = exe.root, 0
        for m in messages[start:] if start else messages:  # no method calls but the comparison
            for c in node.children:
                if same(m, c.norm, c.raw):
                    node = c
                    break
            else:
                break
            if node.calls and tools is not None:
                for cand in reversed(node.calls):
                    if cand.tools is tools:
                        best = cand
                        break
        return best, node

    def _given_line(self, exe: _Execution, lineage: str, agent: str, agent_id: str, task_len: int) -> _Line:
        line = exe.lines.get(agent)
        base = lineage.removesuffix("-summary")
        if line is None or line.lineage != base:
            line = exe.lines[agent] = _Line(base, agent, agent_id, task_len)
        return line

    def _new_line(self, exe: _Execution, lineage: str, task_len: int) -> _Line:
        if lineage == "sub-agent":
            exe.num_sub_agents += 1
            agent = agent_id = f"sub-{exe.num_sub_agents}"
        elif lineage == "side":
            exe.num_side += 1
            agent, agent_id = f"side-{exe.num_side}", ""
        else:
            agent = agent_id = ""
        line = exe.lines[agent] = _Line(lineage, agent, agent_id, task_len)
        return line

    def _derive(
        self, exe: _Execution, messages: list[dict[str, Any]], best: _Remembered | None, reached: _Node
    ) -> tuple[_Line, str, str]:
        """The call's line, lineage and the reason for it, by the rules of the module docstring."""
        line, reason = self._line_of(exe, messages, best, reached)
        if line.lineage != "side" and is_summary_request(messages):
            return line, f"{line.lineage}-summary", f"{reason}+summary-marker"
        return line, line.lineage, reason

    def _line_of(
        self, exe: _Execution, messages: list[dict[str, Any]], best: _Remembered | None, reached: _Node
    ) -> tuple[_Line, str]:
        if best is not None:  # 2. extends
            return best.line, "extends"
        if not exe.lines:  # 1. first
            return self._new_line(exe, "main", len(messages)), "first"
        if reached.line is not None and reached.depth >= reached.line.task_len:  # 3. branch
            return reached.line, "branch"
        system = messages[0] if messages and _role(messages[0]) == "system" else None
        own = reached if reached.depth >= 1 else None  # the node of its system prompt, if known
        own_root = own
        while own_root is not None and own_root.depth > 1:
            own_root = own_root.parent
        if system is not None:  # 4. a line's conversation under another system prompt
            over = self._over(exe, messages, own_root)
            if over is not None:
                top, line = over
                if line.lineage != "side" and _same_agent(top.norm[1], _content(system)):
                    return line, "system-changed"
                if line.lineage != "side" and is_summary_request(messages):
                    return line, "over"
                return self._new_line(exe, "side", len(messages)), "over"
        texts = [_content(m) for m in messages[1:] if _role(m) in ("user", "system")]
        for norm, line in reversed(exe.replies):  # 5. rewrite
            reply = norm[1]
            if line.lineage != "side" and len(reply) >= QUOTE_MIN_CHARS and any(reply in t for t in texts):
                return line, "rewrite"
        user_texts = [_content(m) for m in messages if _role(m) == "user"]
        for line in reversed(exe.lines.values()):  # 6. hand-off: a tool call still waiting for its result
            if line.lineage == "side" or line.last_reply is None:
                continue
            for _name, args in line.last_reply[2]:
                try:
                    handed = _strings(json.loads(args), [])
                except ValueError:
                    handed = [args] if len(args) >= HANDOFF_MIN_CHARS else []
                if any(s in t for s in handed for t in user_texts):
                    return self._new_line(exe, "sub-agent", len(messages)), "handoff"
        if system is not None and self._agent_system(exe, _content(system), own_root):  # 7. a new task
            return self._new_line(exe, "sub-agent", len(messages)), "new-conversation"
        return self._new_line(exe, "side", len(messages)), "else"  # 8. else

    @staticmethod
    def _over(exe: _Execution, messages: list[dict[str, Any]], own_root: _Node | None) -> tuple[_Node, _Line] | None:
        """The deepest known line whose conversation (at least its first request, after the system
        prompt) the request repeats under another system prompt: (that system prompt's node, the line)."""
        found: tuple[int, _Node, _Line] | None = None
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

    @staticmethod
    def _agent_system(exe: _Execution, system: str, own_root: _Node | None) -> bool:
        """The system prompt is (a variant of) one a non-side line runs under."""
        if own_root is not None and own_root.norm[0] == "system":
            return own_root.line is not None and own_root.line.lineage != "side"
        return any(top.norm[0] == "system" and top.line is not None and top.line.lineage != "side"
                   and _same_agent(top.norm[1], system) for top in exe.root.children)

    # ------------------------------------------------------------ remembering a call

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
        call_id: str = "",
    ) -> wire.SessionEntry:
        """Record a successful call; ``reply`` is the assistant message returned to the harness.
        ``agent`` is unused (the plan carries the line); kept for callers' symmetry. Returns what
        was remembered, for the call's CallRecord (``restore`` remembers it again from there)."""
        exe = self._execution(execution_id)
        plan = self._take_plan(exe, prompt_ids, messages)
        if plan is None:  # a prompt not planned here: decide its line now, keep its ids on a tape of its own
            tools_obj = next((t for t in exe.tools if t == (tools or [])), None)
            best, reached = self._walk(exe, messages, tools_obj)
            line, _, _ = self._derive(exe, messages, best, reached)
            base = None
            prompt_ids = self._shared(prompt_ids)
        else:
            base, line, tools_obj = plan.base, plan.line, plan.tools
            if base is not None and base.forgotten:
                base = None
        new = messages[base.node.depth :] if base is not None else messages
        return self._store(exe, base, line, tools_obj, tools, new, reply, prompt_ids, output_ids, call_id)

    def restore(self, record: wire.CallRecord) -> bool:
        """Remember a call again from its CallRecord, as ``remember`` did when it was made: a restarted
        proxy rebuilds an execution's sessions from the processor's log, call after call, so
        splicing and lineage go on exactly. False (and nothing remembered) for a record that carries
        no session entry or names a base this store does not hold."""
        entry = record.session
        if entry is None:
            return False
        exe = self._execution(record.execution_id)
        base = exe.by_call.get(entry.base_call_id) if entry.base_call_id else None
        if entry.base_call_id and (base is None or base.length != entry.base_length
                                   or record.prompt_ids[: base.length] != base.tape[: base.length]):
            return False
        line = exe.lines.get(entry.line)
        if line is None or line.lineage != entry.line_lineage:
            line = exe.lines[entry.line] = _Line(entry.line_lineage, entry.line, record.agent_id, entry.line_task_len)
            kind, _, n = entry.line.partition("-")
            if n.isdigit() and kind == "sub":
                exe.num_sub_agents = max(exe.num_sub_agents, int(n))
            elif n.isdigit() and kind == "side":
                exe.num_side = max(exe.num_side, int(n))
        if entry.tools_json is None and base is not None:
            tools, tools_obj = base.tools, base.tools
        else:
            tools = json.loads(entry.tools_json) if entry.tools_json else []
            tools_obj = next((t for t in exe.tools if t == tools), None)
        new = [_message(m) for m in entry.new_messages]
        self._store(exe, base, line, tools_obj, tools, new, _message(entry.reply), self._shared(record.prompt_ids),
                    record.output_ids, record.call_id)
        return True

    def _store(
        self, exe: _Execution, base: _Remembered | None, line: _Line, tools_obj: list[Any] | None,
        tools: list[Any] | None, new: list[dict[str, Any]], reply: dict[str, Any], prompt_ids: list[int],
        output_ids: list[int], call_id: str,
    ) -> wire.SessionEntry:
        """Remember one call: ``new`` are its request's messages after ``base``'s (all without one);
        ``prompt_ids`` a list the store may keep (its table's ints)."""
        node = base.node if base is not None else exe.root
        added = []
        for m in new:
            node = self._child(exe, node, m, line)
            added.append(node)
        node = self._child(exe, node, reply, line)
        added.append(node)
        tail = self._shared(output_ids)
        if not output_ids or output_ids[-1] != self.tok.im_end:
            tail.append(self._ints[self.tok.im_end])
        tail += self._separator
        if base is not None and len(base.tape) == base.length:  # the line's newest end: append in place
            tape, norms, raws = base.tape, base.norms, base.raws
            grown = len(prompt_ids) - base.length + len(tail)
            tape += prompt_ids[base.length :]
            exe.tips.pop(id(tape), None)
        else:  # a first call, a branch, or a prompt not planned here: a tape of its own
            tape = prompt_ids.copy()
            grown = len(tape) + len(tail)
            path = []  # the messages before the added ones: the trie path above them
            up = added[0].parent
            while up is not None and up.parent is not None:
                path.append(up)
                up = up.parent
            path.reverse()
            norms, raws = [n.norm for n in path], [n.raw for n in path]
            grown += 2 * len(norms)
        norms += [n.norm for n in added]
        raws += [n.raw for n in added]
        tape += tail
        exe.bytes += 8 * (grown + 2 * len(added))
        exe.tape_refs[id(tape)] = exe.tape_refs.get(id(tape), 0) + 1
        if tools_obj is None:  # unseen when planned; another call may have brought the same tools since
            tools_obj = next((t for t in exe.tools if t == (tools or [])), None)
        if tools_obj is None:
            tools_obj = list(tools or [])
            exe.tools.append(tools_obj)
        entry = _Remembered(node=node, tools=tools_obj, tape=tape, length=len(tape), norms=norms, raws=raws,
                            line=line, call_id=call_id)
        exe.tips[id(tape)] = entry
        node.calls.append(entry)
        exe.calls.append(entry)
        if call_id:
            exe.by_call[call_id] = entry
        exe.replies.append((node.norm, line))
        line.last_reply = node.norm
        while exe.bytes > self.memory_bytes and len(exe.calls) > 1:
            self._forget(exe, exe.calls.popleft())
        named = base is not None and bool(base.call_id)  # a restore can find it by its id
        return wire.SessionEntry(
            base_call_id=base.call_id if named else "", base_length=base.length if named else 0,  # type: ignore[union-attr]
            new_messages=[_wire_message(n) for n in norms[base.node.depth if named else 0 : node.depth - 1]],  # type: ignore[union-attr]
            reply=_wire_message(node.norm),
            tools_json=None if named and base.tools is tools_obj else tools_key(tools_obj),  # type: ignore[union-attr]
            line=line.agent, line_lineage=line.lineage, line_task_len=line.task_len,  # type: ignore[arg-type]
            reply_tool_ids=[_utf8(str(c.get("id", ""))) for c in reply.get("tool_calls") or [] if isinstance(c, dict)],
        )

    def _child(self, exe: _Execution, node: _Node, m: dict[str, Any], line: _Line) -> _Node:
        found = node.child(m)
        if found is not None:
            return found
        norm = normalize_message(m)
        cost = NODE_OVERHEAD_BYTES + len(norm[1]) + sum(len(a) for _, a in norm[2])
        new = _Node(norm, _raw_arguments(m), node, node.depth + 1, line, cost)
        node.children.append(new)
        exe.bytes += cost
        return new

    def _forget(self, exe: _Execution, call: _Remembered) -> None:
        """Drop one remembered call, and what only it held."""
        call.forgotten = True
        call.node.calls.remove(call)
        if exe.by_call.get(call.call_id) is call:
            del exe.by_call[call.call_id]
        refs = exe.tape_refs[id(call.tape)] - 1
        if refs:
            exe.tape_refs[id(call.tape)] = refs
        else:
            del exe.tape_refs[id(call.tape)]
            exe.bytes -= 8 * (len(call.tape) + 2 * len(call.norms))
        if exe.tips.get(id(call.tape)) is call:
            del exe.tips[id(call.tape)]
        node = call.node
        while node.parent is not None and not node.calls and not node.children:
            node.parent.children.remove(node)
            exe.bytes -= node.cost
            node = node.parent

    def _take_plan(self, exe: _Execution, prompt_ids: list[int], messages: list[dict[str, Any]]) -> _Plan | None:
        plan = exe.plans.pop(id(prompt_ids), None)
        if plan is not None:
            exe.plan_bytes -= 8 * plan.num_prompt
        if plan is None or plan.prompt_ids is not prompt_ids:
            return None
        # Trust the plan only if nothing changed the prompt or the messages since.
        return plan if plan.messages is messages and len(prompt_ids) == plan.num_prompt else None

    def drop_execution(self, execution_id: str) -> None:
        self._executions.pop(execution_id, None)

    def num_executions(self) -> int:
        return sum(1 for exe in self._executions.values() if exe.calls)

    def total_bytes(self) -> int:
        """What all executions' remembered calls and waiting prompt plans hold (``proxy.max_session_bytes``)."""
        return sum(exe.bytes + exe.plan_bytes for exe in self._executions.values())

    def held_bytes(self, execution_id: str) -> int:
        """What the execution's remembered calls hold, as counted against ``memory_bytes``."""
        exe = self._executions.get(execution_id)
        return exe.bytes if exe is not None else 0
