"""Session splicing: echoed assistant turns keep the engine's exact ids."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from harness_proxy.openai_api import reply_message
from harness_proxy.sessions import SessionStore, normalize_message, tools_key
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
    # other tools, another agent or another execution: rendered from scratch
    assert not store.build_prompt("ex", "", nxt, tools + tools).spliced
    assert not store.build_prompt("ex", "sub-1", nxt, tools).spliced
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
    store = SessionStore(TOK, calls_per_agent=2)
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
    as sorted JSON, each call's ids copied whole): the fast store must decide exactly as this."""

    def __init__(self, calls_per_agent: int = 2):
        self.calls: dict[tuple[str, str], list[tuple[tuple, str, list[int]]]] = {}
        self.calls_per_agent = calls_per_agent

    def build_prompt(self, execution_id, agent, messages, tools):
        norm = [normalize_message(m) for m in messages]
        best = None
        for cand in reversed(self.calls.get((execution_id, agent), [])):
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
        line = self.calls.setdefault((execution_id, agent), [])
        line.append(entry)
        del line[: -self.calls_per_agent]


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


def test_consecutive_calls_share_one_tape_and_a_branch_copies():
    store = SessionStore(TOK)
    msgs = [USER]
    for k in range(3):
        plan = store.build_prompt("ex", "", msgs, None)
        _, reply = remember(store, msgs, TOK.encode(f"step {k}") + [TOK.im_end], prompt_ids=plan.prompt_ids)
        msgs = msgs + [reply, {"role": "user", "content": f"go {k}"}]
    line = store._sessions["ex"][""]  # noqa: SLF001 (the sharing is the point of this test)
    assert line[0].tape is line[1].tape and line[0].length < line[1].length
    older = line[0]
    # A side call off the older call: its own tape, and the main line's ids are untouched.
    side = [*msgs[: len(older.messages)], {"role": "user", "content": "summarise"}]
    plan = store.build_prompt("ex", "", side, None)
    assert plan.spliced and plan.prompt_ids[: older.length] == older.tape[: older.length]
    remember(store, side, TOK.encode("summary") + [TOK.im_end], prompt_ids=plan.prompt_ids)
    assert store._sessions["ex"][""][-1].tape is not older.tape  # noqa: SLF001


def test_a_prompt_not_planned_by_the_store_is_remembered_by_the_slow_path():
    store = SessionStore(TOK)
    prompt = render_messages(TOK, [USER])
    out = TOK.encode("yes") + [TOK.im_end]
    _, reply = remember(store, [USER], out, prompt_ids=list(prompt))
    plan = store.build_prompt("ex", "", [USER, reply, {"role": "user", "content": "x"}], None)
    assert plan.spliced and plan.prompt_ids[: len(prompt) + len(out)] == prompt + out
