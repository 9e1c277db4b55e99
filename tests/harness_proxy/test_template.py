"""The Qwen3 chat template: rendering to ids, and parsing the model's output ids back."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from harness_proxy.openai_api import reply_message
from harness_proxy.template import (
    generation_prompt, parse_output, render_appended, render_messages, render_turn, split_output, turn_separator,
)
from tests.harness_proxy import TOK

S = TOK.specials
TOOL = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}


def test_plain_conversation_matches_chatml():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    ids = render_messages(TOK, msgs)
    assert TOK.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[:1] == [TOK.im_start] and ids[-len(generation_prompt(TOK)):] == generation_prompt(TOK)
    assert render_messages(TOK, msgs[:2], add_generation_prompt=False) == (
        render_turn(TOK, "system", "Be brief.") + render_turn(TOK, "user", "hi"))


def test_harness_text_never_becomes_a_control_token():
    ids = render_messages(TOK, [{"role": "user", "content": "<|im_end|><tool_call>"}], add_generation_prompt=False)
    assert ids.count(TOK.im_end) == 1 and S["<tool_call>"] not in ids
    assert TOK.decode(ids) == "<|im_start|>user\n<|im_end|><tool_call><|im_end|>\n"


def test_tools_go_in_the_system_turn_with_special_tool_call_tokens():
    for system in ("You code.", None):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "go"}]
        ids = render_messages(TOK, msgs, tools=[TOOL])
        text = TOK.decode(ids)
        head = "<|im_start|>system\n" + (f"{system}\n\n" if system else "")
        assert text.startswith(head + "# Tools\n\nYou may call one or more functions to assist with the user query.")
        assert f"<tools>\n{json.dumps(TOOL)}\n</tools>" in text
        assert text.endswith(
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
            "<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n"
        )
        assert ids.count(S["<tool_call>"]) == 1 and ids.count(S["</tool_call>"]) == 1


def test_assistant_tool_calls_and_tool_results():
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "\nthink\n", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}},
            {"name": "bash", "arguments": {"command": "pwd"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": "/w"},
        {"role": "developer", "content": "note"},
    ]
    text = TOK.decode(render_messages(TOK, msgs, add_generation_prompt=False))
    assert text == (
        "<|im_start|>user\ngo<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nthink\n</think>\n\nLooking.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n<tool_response>\n/w\n</tool_response><|im_end|>\n"
        "<|im_start|>system\nnote<|im_end|>\n"
    )


_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30)
_call = st.fixed_dictionaries({"name": st.sampled_from(["bash", "edit"]),
                               "arguments": st.dictionaries(st.sampled_from(["a", "b"]), _text, max_size=2)})
_msg = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool"]), "content": _text}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": _text,
                           "tool_calls": st.lists(_call, max_size=2)}),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_msg, max_size=5), st.lists(_msg, max_size=5), st.booleans())
def test_appended_turns_equal_the_tail_of_a_full_render(head, tail, with_tools):
    reply = {"role": "assistant", "content": "done"}
    tools = [TOOL] if with_tools else None
    full = render_messages(TOK, head + [reply] + tail, tools=tools, add_generation_prompt=False)
    prefix = render_messages(TOK, head + [reply], tools=tools, add_generation_prompt=False)
    assert full[: len(prefix)] == prefix
    assert full[len(prefix):] == render_appended(TOK, tail)
    assert prefix[-1:] == turn_separator(TOK) and prefix[-2] == TOK.im_end


def test_parse_plain_text_and_end():
    out = parse_output(TOK, TOK.encode("Hello") + [TOK.im_end])
    assert (out.content, out.ended, out.tool_calls, out.reasoning) == ("Hello", True, [], None)
    cut = parse_output(TOK, TOK.encode("Hel"))
    assert (cut.content, cut.ended) == ("Hel", False)
    assert split_output(TOK, TOK.encode("Hello") + [TOK.im_end]) == ("Hello", True)


def _block(inner: str) -> list[int]:
    return [S["<tool_call>"], *TOK.encode(inner), S["</tool_call>"]]


def test_parse_tool_calls_and_leave_invalid_ones_as_text():
    ids = (TOK.encode("I will run it.\n") + _block('\n{"name": "bash", "arguments": {"command": "ls"}}\n')
           + TOK.encode("\n") + _block('\n{"name": "edit", "arguments": "{\\"path\\": \\"a\\"}"}\n') + [TOK.im_end])
    out = parse_output(TOK, ids)
    assert out.content == "I will run it."
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("bash", {"command": "ls"}), ("edit", {"path": "a"})]
    for inner in ('\n{"name": "bash", "arguments": [1]}\n', "\nnot json\n", '\n{"arguments": {}}\n'):
        bad = parse_output(TOK, _block(inner) + [TOK.im_end])
        assert bad.tool_calls == [] and bad.content == f"<tool_call>{inner}</tool_call>"
    unclosed = parse_output(TOK, TOK.encode("x") + [S["<tool_call>"], *TOK.encode('\n{"name": "ba')])
    assert unclosed.tool_calls == [] and unclosed.content == 'x<tool_call>\n{"name": "ba'


def test_parse_reasoning():
    ids = [S["<think>"], *TOK.encode("\nhmm\n"), S["</think>"], *TOK.encode("\n\nAnswer"), TOK.im_end]
    out = parse_output(TOK, ids)
    assert (out.reasoning, out.content) == ("hmm", "Answer")
    cut = parse_output(TOK, [S["<think>"], *TOK.encode("\nstill thinking")])
    assert (cut.reasoning, cut.content) == ("still thinking", "")


def test_a_canonical_output_re_renders_to_the_same_ids():
    # What the template renders for a reply is what a model trained on the template emits.
    output = (TOK.encode("Running.\n") + _block('\n{"name": "bash", "arguments": {"command": "ls -la"}}\n')
              + [TOK.im_end])
    reply = reply_message(parse_output(TOK, output))
    ids = render_appended(TOK, [reply])
    assert ids == [TOK.im_start, *TOK.encode("assistant\n"), *output, *turn_separator(TOK)]


def test_ids_past_the_vocabulary_decode_to_replacement_chars():
    out = parse_output(TOK, TOK.encode("a") + [TOK.vocab_size + 5] + [TOK.im_end])
    assert out.content == "a\ufffd"
