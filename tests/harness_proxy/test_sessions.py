"""Session splicing: echoed assistant turns keep the engine's exact ids."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from harness_proxy.openai_api import reply_message
from harness_proxy.sessions import SessionStore, normalize_message
from harness_proxy.template import parse_output, render_messages
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
