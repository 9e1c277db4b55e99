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

Messages are compared after normalising (``harness_proxy.session_messages``: key order, empty
content, re-serialised tool-call arguments and tool-call ids do not count). This module keeps no
trajectories; it decides prompt ids and, by the rules of ``harness_proxy.lineage``, lineage. What it
holds per execution is ``harness_proxy.session_state``.

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
mini-swe-agent, the bundled harness), the store derives it from the structure of the calls, by the
rules of ``harness_proxy.lineage`` (which names each call's ``reason``, ``lineage.REASONS``).

**Restarts.** ``remember`` returns what it remembered of the call (``wire.SessionEntry``: the
call it was spliced onto, the messages after that call's, the reply, the tools where they changed,
the line), which goes out on the call's CallRecord; ``restore`` remembers a call again from its
record. A restarted proxy reads an execution's records back from the processor's log before it
answers the execution's next call, so splicing, lineage and the line's agent ids go on exactly.

The lineage rules 1-3 are the hot path (the walk that finds the splice also finds the branch
point); 4-8 run only for a call that extends nothing.

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
from dataclasses import dataclass
from typing import Any

from base import wire
from harness_proxy.lineage import derive_line, given_line
from harness_proxy.session_messages import (
    message_from_wire, normalize_message, raw_arguments, same_message, tools_key, wire_message, wire_text,
)
from harness_proxy.session_state import ExecutionSessions, Line, Node, Plan, Remembered
from harness_proxy.template import generation_prompt, render_appended, render_messages, turn_separator
from base.tokenizer import QwenTokenizer

SESSION_MEMORY_BYTES = 64 << 20
"""Default bound on what one execution's remembered calls hold (ids and message text)."""
PLANS_PER_EXECUTION = 64
"""Prompt plans kept per execution until ``remember``; more in flight at once only lose the fast path."""
NODE_OVERHEAD_BYTES = 200
"""Counted per remembered message on top of its text (the node, its tuples and lists)."""
TIPS_CHECKED = 8
"""Line ends (newest first) a request is compared with before the trie walk."""


@functools.lru_cache(maxsize=4)
def _int_table(size: int) -> tuple[int, ...]:
    """One shared ``int`` object per token id, so a held id is a pointer, not a 32-byte object."""
    return tuple(range(size))


@dataclass(frozen=True, slots=True)
class PromptPlan:
    prompt_ids: list[int]
    spliced: bool
    """True when built on an earlier call's exact ids; False when rendered from scratch."""
    num_new_messages: int
    """Messages rendered for this prompt (all of them when not spliced)."""
    lineage: str = "main"
    """main | main-summary | sub-agent | sub-agent-summary | side: given, or derived (``harness_proxy.lineage``)."""
    agent: str = ""
    """The session and routing key of the call's line."""
    agent_id: str = ""
    """For the CallRecord: the harness's or the derived sub-agent id ('' for main and side)."""
    reason: str = "first"
    """Why the lineage (``lineage.REASONS``, maybe with ``+summary-marker``)."""


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
        self._executions: dict[str, ExecutionSessions] = {}
        self._ints = _int_table(tok.vocab_size)
        self._generation_prompt = self._shared(generation_prompt(tok))
        self._separator = self._shared(turn_separator(tok))

    def _shared(self, ids: list[int]) -> list[int]:
        """``ids`` as the table's int objects (ids outside the vocabulary stay as they are)."""
        table = self._ints
        if len(ids) > 1 and 0 <= min(ids) and max(ids) < len(table):
            return list(operator.itemgetter(*ids)(table))
        return [table[t] if 0 <= t < len(table) else t for t in ids]

    def _execution(self, execution_id: str) -> ExecutionSessions:
        exe = self._executions.get(execution_id)
        if exe is None:
            root = Node(("", "", ()), (), None, 0, None, 0)
            exe = self._executions[execution_id] = ExecutionSessions(root)
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
            line, lineage, reason = derive_line(exe, messages, best, reached)
        else:
            line = given_line(exe, lineage, agent, agent_id, len(messages))
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
        exe.plans[id(ids)] = Plan(ids, len(ids), messages, best, line, want_tools)
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
        self, exe: ExecutionSessions, messages: list[dict[str, Any]], tools: list[Any] | None
    ) -> tuple[Remembered | None, Node]:
        """The longest remembered call whose messages (and tools) the request begins with, newest on
        ties; and the deepest node the request's messages reach (where it leaves what is known)."""
        best: Remembered | None = None
        node = exe.root
        same = same_message
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
            line, _, _ = derive_line(exe, messages, best, reached)
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
            line = exe.lines[entry.line] = Line(entry.line_lineage, entry.line, record.agent_id, entry.line_task_len)
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
        new = [message_from_wire(m) for m in entry.new_messages]
        self._store(exe, base, line, tools_obj, tools, new, message_from_wire(entry.reply),
                    self._shared(record.prompt_ids), record.output_ids, record.call_id)
        return True

    def _store(
        self, exe: ExecutionSessions, base: Remembered | None, line: Line, tools_obj: list[Any] | None,
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
        entry = Remembered(node=node, tools=tools_obj, tape=tape, length=len(tape), norms=norms, raws=raws,
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
            new_messages=[wire_message(n) for n in norms[base.node.depth if named else 0 : node.depth - 1]],  # type: ignore[union-attr]
            reply=wire_message(node.norm),
            tools_json=None if named and base.tools is tools_obj else tools_key(tools_obj),  # type: ignore[union-attr]
            line=line.agent, line_lineage=line.lineage, line_task_len=line.task_len,  # type: ignore[arg-type]
            reply_tool_ids=[wire_text(str(c.get("id", ""))) for c in reply.get("tool_calls") or [] if isinstance(c, dict)],
        )

    def _child(self, exe: ExecutionSessions, node: Node, m: dict[str, Any], line: Line) -> Node:
        found = node.child(m)
        if found is not None:
            return found
        norm = normalize_message(m)
        cost = NODE_OVERHEAD_BYTES + len(norm[1]) + sum(len(a) for _, a in norm[2])
        new = Node(norm, raw_arguments(m), node, node.depth + 1, line, cost)
        node.children.append(new)
        exe.bytes += cost
        return new

    def _forget(self, exe: ExecutionSessions, call: Remembered) -> None:
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

    def _take_plan(self, exe: ExecutionSessions, prompt_ids: list[int], messages: list[dict[str, Any]]) -> Plan | None:
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
