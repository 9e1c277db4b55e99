"""Session splicing: echoed assistant turns keep the engine's exact ids."""

from __future__ import annotations

import dataclasses
import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from base import wire
from harness_proxy.openai_api import reply_message
from harness_proxy.session_messages import normalize_message, tools_key
from harness_proxy.sessions import SessionStore
from harness_proxy.template import generation_prompt, parse_output, render_appended, render_messages, turn_separator
from tests.harness_proxy import TOK

USER = {"role": "user", "content": "hi"}


def remember(store, messages, output_ids, *, prompt_ids=None, tools=None, execution_id="ex", agent=""):
    prompt = prompt_ids if prompt_ids is not None else store.build_prompt(execution_id, agent, messages, tools).prompt_ids
    reply = reply_message(parse_output(TOK, output_ids))
    store.remember(execution_id, agent, messages=messages, tools=tools, reply=reply,
                   prompt_ids=prompt, output_ids=output_ids)
    return prompt, reply


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, TOK.num_ranks - 1), min_size=1, max_size=40), st.booleans())
def test_prompts_contain_the_exact_engine_ids(output_ids, stopped):
    out = output_ids + ([TOK.im_end] if stopped else [])
    store = SessionStore(TOK)
    prompt, reply = remember(store, [USER], out)
    nxt = [USER, {"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "next"}]
    plan = store.build_prompt("ex", "", nxt, None)
    assert plan.spliced and plan.num_new_messages == 1
    head = prompt + out + ([] if stopped else [TOK.im_end])
    assert plan.prompt_ids[: len(head)] == head
    assert TOK.decode(plan.prompt_ids[len(head):]) == "\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"


def test_decode_encode_does_not_round_trip_yet_the_splice_is_exact():
    rng = random.Random(1)
    drifted = 0
    for _ in range(50):
        ids = [rng.randrange(TOK.num_ranks) for _ in range(16)]
        drifted += TOK.encode(TOK.decode(ids)) != ids
    assert drifted > 25  # BPE is not injective on arbitrary id sequences
    ids = [rng.randrange(TOK.num_ranks) for _ in range(16)] + [TOK.im_end]
    store = SessionStore(TOK)
    prompt, reply = remember(store, [USER], ids)
    nxt = [USER, reply, {"role": "user", "content": "x"}]
    from_text = render_messages(TOK, nxt)
    spliced = store.build_prompt("ex", "", nxt, None).prompt_ids
    assert spliced[: len(prompt) + len(ids)] == prompt + ids
    if TOK.encode(TOK.decode(ids[:-1])) != ids[:-1]:
        assert from_text != spliced


def test_normalisation_ignores_key_order_null_content_and_argument_formatting():
    a = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "bash", "arguments": '{"a": 1, "b": 2}'}}]}
    b = {"tool_calls": [{"function": {"arguments": '{"b":2,"a":1}', "name": "bash"}, "type": "function", "id": "9"}],
         "role": "assistant"}
    assert normalize_message(a) == normalize_message(b)
    assert normalize_message({"role": "user", "content": ""}) == normalize_message({"role": "user"})
    assert normalize_message({"role": "user", "content": [{"type": "text", "text": "x"}]}) == \
        normalize_message({"role": "user", "content": "x"})
    assert normalize_message({"role": "user", "content": "x"}) != normalize_message({"role": "system", "content": "x"})


def test_tool_call_reply_echoed_with_reordered_arguments_is_spliced():
    out = [TOK.specials["<tool_call>"], *TOK.encode('\n{"name": "bash", "arguments": {"z": 1, "a": "q"}}\n'),
           TOK.specials["</tool_call>"], TOK.im_end]
    tools = [{"type": "function", "function": {"name": "bash"}}]
    store = SessionStore(TOK)
    prompt, reply = remember(store, [USER], out, tools=tools)
    call = reply["tool_calls"][0]
    echoed = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call["id"], "type": "function",
         "function": {"name": "bash", "arguments": json.dumps({"a": "q", "z": 1}, indent=2)}}]}
    nxt = [USER, echoed, {"role": "tool", "content": "ok"}]
    assert store.build_prompt("ex", "", nxt, tools).spliced
    # other tools or another execution: rendered from scratch; another agent key splices too
    assert not store.build_prompt("ex", "", nxt, tools + tools).spliced
    assert store.build_prompt("ex", "sub-1", nxt, tools).spliced
    assert not store.build_prompt("ex-2", "", nxt, tools).spliced


def test_rewritten_history_renders_from_scratch():
    store = SessionStore(TOK)
    _, reply = remember(store, [USER], TOK.encode("yes") + [TOK.im_end])
    for nxt in (
        [{"role": "user", "content": "HI"}, reply, {"role": "user", "content": "x"}],  # earlier turn edited
        [USER, {"role": "assistant", "content": "no"}, {"role": "user", "content": "x"}],  # reply edited
        [USER],  # shorter
    ):
        plan = store.build_prompt("ex", "", nxt, None)
        assert not plan.spliced and plan.prompt_ids == render_messages(TOK, nxt)


def test_a_side_call_on_the_same_prefix_does_not_break_the_main_line():
    store = SessionStore(TOK)
    out1 = TOK.encode("main one") + [TOK.im_end]
    p1, r1 = remember(store, [USER], out1)
    main2 = [USER, r1, {"role": "user", "content": "continue"}]
    summary = [USER, r1, {"role": "user", "content": "continue\nNow summarise."}]
    remember(store, summary, TOK.encode("summary") + [TOK.im_end])  # a compaction-style sibling
    plan = store.build_prompt("ex", "", main2, None)
    assert plan.spliced and plan.prompt_ids[: len(p1) + len(out1)] == p1 + out1
    store.drop_execution("ex")
    assert not store.build_prompt("ex", "", main2, None).spliced and store.num_executions() == 0


# ---------------------------------------------------------------- the fast store decides as the plain one does


class _ReferenceStore:
    """The plain algorithm the store implements (every message normalised on every call, tools
    as sorted JSON, each call's ids copied whole, every call of the execution a candidate,
    whichever agent made it): the fast store must decide exactly as this."""

    def __init__(self):
        self.calls: dict[str, list[tuple[tuple, str, list[int]]]] = {}

    def build_prompt(self, execution_id, agent, messages, tools):
        norm = [normalize_message(m) for m in messages]
        best = None
        for cand in reversed(self.calls.get(execution_id, [])):
            n = len(cand[0])
            if cand[1] != tools_key(tools) or len(norm) < n or (best is not None and n <= len(best[0])):
                continue
            if tuple(norm[:n]) == cand[0]:
                best = cand
        if best is None:
            return render_messages(TOK, messages, tools=tools), False, len(messages)
        new = messages[len(best[0]):]
        return best[2] + render_appended(TOK, new) + generation_prompt(TOK), True, len(new)

    def remember(self, execution_id, agent, *, messages, tools, reply, prompt_ids, output_ids):
        context = prompt_ids + output_ids + ([] if output_ids and output_ids[-1] == TOK.im_end else [TOK.im_end])
        entry = ((*map(normalize_message, messages), normalize_message(reply)), tools_key(tools),
                 context + turn_separator(TOK))
        self.calls.setdefault(execution_id, []).append(entry)


TOOL = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
_text_ids = st.lists(st.integers(0, TOK.num_ranks - 1), max_size=6)


def _output(ids: list[int], call: bool, ended: bool) -> list[int]:
    block = [TOK.specials["<tool_call>"], *TOK.encode('\n{"name": "bash", "arguments": {"b": 1, "a": "x"}}\n'),
             TOK.specials["</tool_call>"]] if call else []
    return ids + block + ([TOK.im_end] if ended else [])


def _echo(reply: dict, how: str) -> dict:
    """The reply as a harness sends it back: verbatim, its tool arguments re-serialised, or edited."""
    if how == "verbatim" or not reply.get("tool_calls"):
        return reply
    args = json.loads(reply["tool_calls"][0]["function"]["arguments"])
    text = json.dumps(args, indent=1, sort_keys=True) if how == "reserialised" else json.dumps({**args, "a": "y"})
    calls = [{**c, "function": {**c["function"], "arguments": text}} for c in reply["tool_calls"]]
    return {**reply, "tool_calls": calls}


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_the_store_decides_exactly_as_the_plain_algorithm(data):
    """Linear lines, branches off older calls, rewritten history, changed tools, two agents, calls
    remembered out of order, outputs cut by length, re-serialised or edited echoes: the same prompt ids."""
    fast, plain = SessionStore(TOK), _ReferenceStore()
    states = {"": [[USER]], "sub": [[{"role": "user", "content": "sub task"}]]}
    for _ in range(data.draw(st.integers(1, 10), label="rounds")):
        batch = []
        for _ in range(data.draw(st.integers(1, 2), label="in flight")):
            agent = data.draw(st.sampled_from(["", "sub"]))
            messages = list(data.draw(st.sampled_from(states[agent])))
            if data.draw(st.integers(0, 5)) == 0:  # an earlier turn rewritten (compaction-like)
                messages[0] = {"role": "user", "content": messages[0]["content"] + " (edited)"}
            tools = data.draw(st.sampled_from([None, [TOOL], [TOOL, TOOL]]))
            got = fast.build_prompt("ex", agent, messages, tools)
            want = plain.build_prompt("ex", agent, messages, tools)
            assert (got.prompt_ids, got.spliced, got.num_new_messages) == want
            batch.append((agent, messages, tools, got.prompt_ids, want[0]))
        for i in data.draw(st.permutations(range(len(batch)))):
            agent, messages, tools, fast_ids, plain_ids = batch[i]
            out = _output(data.draw(_text_ids), data.draw(st.booleans()), data.draw(st.booleans()))
            reply = reply_message(parse_output(TOK, out))
            fast.remember("ex", agent, messages=messages, tools=tools, reply=reply, prompt_ids=fast_ids, output_ids=out)
            plain.remember("ex", agent, messages=messages, tools=tools, reply=reply, prompt_ids=plain_ids,
                           output_ids=out)
            nxt = {"role": data.draw(st.sampled_from(["user", "tool"])), "content": data.draw(st.text(max_size=8))}
            how = data.draw(st.sampled_from(["verbatim", "verbatim", "reserialised", "edited"]))
            states[agent].append(messages + [_echo(reply, how), nxt])
        _check_paths(fast)


def test_consecutive_calls_share_one_tape_and_a_branch_copies():
    store = SessionStore(TOK)
    msgs = [USER]
    for k in range(3):
        plan = store.build_prompt("ex", "", msgs, None)
        _, reply = remember(store, msgs, TOK.encode(f"step {k}") + [TOK.im_end], prompt_ids=plan.prompt_ids)
        msgs = msgs + [reply, {"role": "user", "content": f"go {k}"}]
    line = store._executions["ex"].calls  # noqa: SLF001 (the sharing is the point of this test)
    assert line[0].tape is line[1].tape and line[0].length < line[1].length
    older = line[0]
    # A side call off the older call: its own tape, and the main line's ids are untouched.
    side = [*msgs[: older.node.depth], {"role": "user", "content": "summarise"}]
    plan = store.build_prompt("ex", "", side, None)
    assert plan.spliced and plan.prompt_ids[: older.length] == older.tape[: older.length]
    remember(store, side, TOK.encode("summary") + [TOK.im_end], prompt_ids=plan.prompt_ids)
    assert store._executions["ex"].calls[-1].tape is not older.tape  # noqa: SLF001


def test_a_prompt_not_planned_by_the_store_is_remembered_by_the_slow_path():
    store = SessionStore(TOK)
    prompt = render_messages(TOK, [USER])
    out = TOK.encode("yes") + [TOK.im_end]
    _, reply = remember(store, [USER], out, prompt_ids=list(prompt))
    plan = store.build_prompt("ex", "", [USER, reply, {"role": "user", "content": "x"}], None)
    assert plan.spliced and plan.prompt_ids[: len(prompt) + len(out)] == prompt + out


# ---------------------------------------------------------------- every call a splice base; lineage where no header says it

SYSTEM = {"role": "system", "content": "You are the main agent."}
TASK = {"role": "user", "content": "Fix the bug in parser.py, then run the tests."}


def _call(store, messages, text="", *, tool_args=None, tools=None, execution_id="ex"):
    """Plan, then remember a reply (text, or one ``agent`` tool call with ``tool_args``); the plan and reply."""
    plan = store.build_prompt(execution_id, "", messages, tools)
    out = TOK.encode(text or "ok")
    if tool_args is not None:
        out = [TOK.specials["<tool_call>"], *TOK.encode("\n" + json.dumps({"name": "agent", "arguments": tool_args})
                                                        + "\n"), TOK.specials["</tool_call>"]]
    _, reply = remember(store, messages, out + [TOK.im_end], prompt_ids=plan.prompt_ids, tools=tools,
                        execution_id=execution_id)
    return plan, reply


def test_a_long_sub_agent_run_does_not_push_the_main_line_out():
    """With no agent header every call looks alike; the main line still splices after ten sub-agent calls."""
    store = SessionStore(TOK)
    main1, r1 = _call(store, [SYSTEM, TASK], tool_args={"prompt": "Find where parser.py handles escapes, report back."})
    sub = [{"role": "system", "content": "You are a sub-agent."},
           {"role": "user", "content": "Find where parser.py handles escapes, report back."}]
    for k in range(10):
        plan, reply = _call(store, sub, f"looked at {k}")
        assert plan.lineage == "sub-agent" and plan.agent_id == "sub-1" and plan.spliced == (k > 0)
        sub = sub + [reply, {"role": "user", "content": f"more {k}"}]
    main2 = [SYSTEM, TASK, r1, {"role": "tool", "content": "escapes are in lex()"}]
    plan = store.build_prompt("ex", "", main2, None)
    assert plan.spliced and plan.num_new_messages == 1 and (plan.lineage, plan.agent_id) == ("main", "")
    assert plan.prompt_ids[: len(main1.prompt_ids)] == main1.prompt_ids


def test_lineage_rules_without_a_header():
    store = SessionStore(TOK)
    tools = [{"type": "function", "function": {"name": "agent"}}]
    first, r1 = _call(store, [SYSTEM, TASK], "<think>\nread first\n</think>\n\nLooking at it.", tools=tools)
    assert (first.lineage, first.agent, first.agent_id) == ("main", "", "")  # 1. first
    m2 = [SYSTEM, TASK, r1, {"role": "user", "content": "go on"}]
    ext, r2 = _call(store, m2, tool_args={"prompt": "Write a regression test for the escape bug."}, tools=tools)
    assert (ext.lineage, ext.spliced) == ("main", True)  # 2. extends
    edited = [SYSTEM, TASK, r1, {"role": "user", "content": "go on, but faster"}]
    assert store.build_prompt("ex", "", edited, tools).lineage == "main"  # 3. branch (history edited)
    assert store.build_prompt("ex", "", m2, tools + tools).lineage == "main"  # 3. branch (tools changed)

    # 6. hand-off: another system prompt and tools, the task a tool call of the main line carried.
    sub = [{"role": "system", "content": "You are a general-purpose agent."},
           {"role": "user", "content": "Write a regression test for the escape bug."}]
    s1, sr1 = _call(store, sub, "Wrote test_escape.py.")
    assert (s1.lineage, s1.agent, s1.agent_id) == ("sub-agent", "sub-1", "sub-1")
    s2, _ = _call(store, sub + [sr1, {"role": "user", "content": "thanks"}])
    assert (s2.lineage, s2.agent_id, s2.spliced) == ("sub-agent", "sub-1", True)  # 2. its line
    # 7. the main system prompt, a new task nobody handed out: another sub-agent.
    fresh, _ = _call(store, [SYSTEM, {"role": "user", "content": "Review the diff."}])
    assert (fresh.lineage, fresh.agent_id) == ("sub-agent", "sub-2")

    # 4. the main conversation under another system prompt: side, or a summary with the marker.
    memory = [{"role": "system", "content": "You extract memories."}, TASK, r1,
              {"role": "user", "content": "Update the memory files."}]
    mem, _ = _call(store, memory)
    assert (mem.lineage, mem.agent, mem.agent_id) == ("side", "side-1", "")
    compress = [{"role": "system", "content": "You compress chats."}, TASK, r1,
                {"role": "user", "content": "First, reason in your scratchpad. Then, generate the <state_snapshot>."}]
    summary_text = "<state_snapshot>the user wants parser.py fixed; escapes live in lex(); tests next</state_snapshot>"
    comp, cr = _call(store, compress, summary_text)
    assert (comp.lineage, comp.agent) == ("main-summary", "")
    # 5. rewrite: the history restarted from that summary continues the main line.
    root = [SYSTEM, {"role": "user", "content": cr["content"]},
            {"role": "assistant", "content": "Got it. Thanks for the additional context!"}]
    assert store.build_prompt("ex", "", root, tools).lineage == "main"
    # The marker appended on the main line itself: main-summary.
    on_line = [SYSTEM, TASK, r1, {"role": "user", "content": "Now generate the <state_snapshot>."}]
    assert store.build_prompt("ex", "", on_line, tools).lineage == "main-summary"
    # 8. a one-off outside every line.
    title, _ = _call(store, [{"role": "system", "content": "Write a 3-word title."}, {"role": "user", "content": "x"}])
    assert (title.lineage, title.agent, title.agent_id) == ("side", "side-2", "")


def test_a_header_given_lineage_is_kept_and_splices_across_agents():
    store = SessionStore(TOK)
    p1 = store.build_prompt("ex", "a01", [USER], None, lineage="sub-agent", agent_id="a01")
    assert (p1.lineage, p1.agent, p1.agent_id) == ("sub-agent", "a01", "a01")
    _, reply = remember(store, [USER], TOK.encode("yes") + [TOK.im_end], prompt_ids=p1.prompt_ids)
    p2 = store.build_prompt("ex", "", [USER, reply, {"role": "user", "content": "x"}], None, lineage="main")
    assert p2.spliced and (p2.lineage, p2.agent, p2.agent_id) == ("main", "", "")


def test_memory_is_bounded_by_bytes_and_the_newest_calls_stay():
    budget = 40_000
    store = SessionStore(TOK, memory_bytes=budget)
    lines = []
    for k in range(30):  # thirty unrelated one-off conversations of ~2 kB of text each
        msgs = [{"role": "system", "content": f"side task {k} " + "x" * 2000}, {"role": "user", "content": "go"}]
        _, reply = _call(store, msgs, f"answer {k}")
        lines.append(msgs + [reply, {"role": "user", "content": "next"}])
        assert store.held_bytes("ex") <= budget
    assert store.build_prompt("ex", "", lines[-1], None).spliced  # the newest is remembered
    assert not store.build_prompt("ex", "", lines[0], None).spliced  # the oldest was forgotten
    exe = store._executions["ex"]  # noqa: SLF001
    assert len(exe.root.children) == len(exe.calls) < 30  # forgotten conversations left no message behind
    held = sum(8 * (len(c.tape) + 2 * len(c.norms)) for c in exe.calls) + sum(n.cost for n in _nodes(exe.root))
    assert held == store.held_bytes("ex")  # the count is exact for what is held
    # A single call over the budget is still remembered (the newest always stays).
    huge = [{"role": "user", "content": "y" * (2 * budget)}]
    _, reply = _call(store, huge, "big")
    assert store.build_prompt("ex", "", huge + [reply, {"role": "user", "content": "z"}], None).spliced
    assert len(store._executions["ex"].calls) == 1  # noqa: SLF001
    store.drop_execution("ex")
    assert store.held_bytes("ex") == 0


def _nodes(node):
    for c in node.children:
        yield c
        yield from _nodes(c)


def _check_paths(store):
    """Each remembered call's shared message lists begin with its trie path; a line's end is its tape's newest call."""
    for exe in store._executions.values():  # noqa: SLF001
        for c in exe.calls:
            path, node = [], c.node
            while node.parent is not None:
                path.append(node)
                node = node.parent
            path.reverse()
            assert c.norms[: c.node.depth] == [n.norm for n in path] and len(path) == c.node.depth
        for tip in exe.tips.values():
            assert tip.length == len(tip.tape) and len(tip.norms) == tip.node.depth


# ---------------------------------------------------------------- a restarted proxy: sessions rebuilt from CallRecords

STAMPED = "You are the main agent. Today is {day}. Files here: {files}.\n" + "Follow the repository's style. " * 40
AGENT_TOOLS = [{"type": "function", "function": {"name": "agent"}}]


def _script_step(store: SessionStore | None, k: int, messages: list, out_text: str, tool_args=None, tools=None):
    """Call ``k`` through ``store``: (its plan, its reply, its CallRecord as the proxy sends it); with
    no store (a call made before a restart) only the reply the harness got."""
    out = TOK.encode(out_text or "ok")
    if tool_args is not None:
        out = [TOK.specials["<tool_call>"], *TOK.encode("\n" + json.dumps({"name": "agent", "arguments": tool_args})
                                                        + "\n"), TOK.specials["</tool_call>"]]
    out = out + [TOK.im_end]
    reply = reply_message(parse_output(TOK, out))
    if store is None:
        return None, reply, None
    plan = store.build_prompt("ex", "", messages, tools)
    entry = store.remember("ex", plan.agent, messages=messages, tools=tools, reply=reply, prompt_ids=plan.prompt_ids,
                           output_ids=out, call_id=f"c{k}")
    record = wire.CallRecord(
        execution_id="ex", call_id=f"c{k}", call_index=k, prompt_ids=list(plan.prompt_ids), output_ids=out,
        output_logprobs=[-0.5] * len(out), weight_version=0, cell_id=0, finish_reason="stop", lineage=plan.lineage,
        agent_id=plan.agent_id, started_at=0.0, finished_at=0.0, lineage_reason=plan.reason, session=entry)
    return plan, reply, wire.decode(wire.encode(record))  # as it went through the processor's log


def _conversation(store: SessionStore, *, start: int = 0):
    """A header-less run: main hands a task to a sub-agent, the sub-agent works, main goes on under a
    system prompt whose date and listing change, a memory extraction (side), a compression (summary),
    the history restarted from the summary, a title call, main again. Calls before ``start`` were made
    before a restart (not through ``store``). Yields (plan, record) per call through ``store``."""
    sys1 = {"role": "system", "content": STAMPED.format(day="Monday", files="a.py")}
    sys2 = {"role": "system", "content": STAMPED.format(day="Tuesday", files="a.py b.py")}
    sub = [{"role": "system", "content": "You are a general-purpose agent."},
           {"role": "user", "content": "Write a regression test for the escape bug."}]
    calls = iter(range(100))

    def step(messages, text, tool_args=None, tools=None):
        k = next(calls)
        plan, reply, record = _script_step(store if k >= start else None, k, messages, text, tool_args, tools)
        if plan is not None:
            done.append((plan, record))
        return reply

    done: list = []
    r1 = step([sys1, TASK], "", {"prompt": "Write a regression test for the escape bug."}, AGENT_TOOLS)
    sr1 = step(sub, "Wrote test_escape.py.")
    step(sub + [sr1, {"role": "user", "content": "run it"}], "It passes.")
    m2 = [sys2, TASK, r1, {"role": "tool", "content": "the sub-agent wrote test_escape.py"}]
    r2 = step(m2, "Now the fix.", tools=AGENT_TOOLS)
    m3 = m2 + [r2, {"role": "user", "content": "go on"}]
    r3 = step(m3, "Fixed.", tools=AGENT_TOOLS)
    step([{"role": "system", "content": "You extract memories."}, TASK, r1, {"role": "user", "content": "Save them."}],
         "Nothing to save.")
    cr = step([{"role": "system", "content": "You compress chats."}, TASK, r1,
               {"role": "user", "content": "Then, generate the <state_snapshot>."}],
              "<state_snapshot>parser.py fixed, escapes in lex(), test added</state_snapshot>")
    step([sys2, {"role": "user", "content": cr["content"]}, {"role": "assistant", "content": "Got it."},
          {"role": "user", "content": "continue"}], "Continuing.", tools=AGENT_TOOLS)
    step([{"role": "system", "content": "Write a 3-word title."}, {"role": "user", "content": "x"}], "Parser escape fix")
    step(m3 + [r3, {"role": "user", "content": "and the docs"}], "Docs done.", tools=AGENT_TOOLS)
    return done


def _plan_key(plan):
    return plan.prompt_ids, plan.spliced, plan.lineage, plan.agent, plan.agent_id, plan.reason


def test_an_unbroken_run_labels_by_token_structure_and_says_why():
    got = [(p.lineage, p.agent_id, p.reason) for p, _ in _conversation(SessionStore(TOK))]
    assert got == [
        ("main", "", "first"), ("sub-agent", "sub-1", "handoff"), ("sub-agent", "sub-1", "extends"),
        ("main", "", "system-changed"),  # the date and listing changed: still the main agent, trained
        ("main", "", "extends"), ("side", "", "over"), ("main-summary", "", "over+summary-marker"),
        ("main", "", "rewrite"), ("side", "", "else"), ("main", "", "extends"),
    ]


def test_a_store_rebuilt_from_the_records_decides_every_later_call_as_the_unbroken_one():
    unbroken = _conversation(SessionStore(TOK))
    records = [rec for _, rec in unbroken]
    for cut in range(len(records) + 1):  # the proxy restarts before call `cut`
        rebuilt = SessionStore(TOK)
        assert all(rebuilt.restore(r) for r in records[:cut])
        rest = _conversation(rebuilt, start=cut)
        assert [_plan_key(p) for p, _ in rest] == [_plan_key(p) for p, _ in unbroken[cut:]], f"restart before call {cut}"
        fresh_ids = [dataclasses.replace(r.session, reply_tool_ids=[]) for _, r in rest]  # ids are minted anew
        assert fresh_ids == [dataclasses.replace(r.session, reply_tool_ids=[]) for r in records[cut:]]


def test_without_the_records_a_restarted_store_gets_lineage_wrong():
    """What the rebuild is for: a store that starts empty mid-run calls the sub-agent's next call
    ``main`` (it comes first) and splices nothing."""
    unbroken = _conversation(SessionStore(TOK))
    fresh = _conversation(SessionStore(TOK), start=2)
    assert (fresh[0][0].lineage, fresh[0][0].spliced) == ("main", False)
    assert (unbroken[2][0].lineage, unbroken[2][0].spliced) == ("sub-agent", True)


def test_a_record_naming_a_base_the_store_does_not_hold_is_not_restored():
    records = [rec for _, rec in _conversation(SessionStore(TOK))]
    rebuilt = SessionStore(TOK)
    assert records[2].session.base_call_id == "c1"
    assert not rebuilt.restore(records[2])  # c1 was never restored
    assert rebuilt.restore(records[0]) and rebuilt.restore(records[1]) and rebuilt.restore(records[2])


def test_prompt_plans_are_counted_and_a_failed_calls_plan_is_dropped():
    store = SessionStore(TOK)
    assert store.total_bytes() == 0
    plan = store.build_prompt("ex", "", [SYSTEM, TASK], None)
    assert store.total_bytes() == 8 * len(plan.prompt_ids)
    store.discard_plan("ex", plan.prompt_ids)
    assert store.total_bytes() == 0 and store.num_executions() == 0
    _call(store, [SYSTEM, TASK], "done")
    assert store.total_bytes() == store.held_bytes("ex") > 0
