"""The Anthropic Messages API end to end: official anthropic SDK and raw HTTP against the real proxy,
scripted SGLang-API engines, real ZMQ records."""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit

import anthropic
import pytest

from base import wire
from harness_proxy.anthropic_api import SUMMARY_MARKER
from base.execution_token import mint_token
from harness_proxy.template import render_messages
from tests.harness_proxy import SECRET, TOK, LiveProxy, Step, text_ids

EDIT_TOOL = {
    "name": "Edit",
    "description": "Edit a file.",
    "input_schema": {
        "type": "object",
        "properties": {"file_path": {"type": "string"}, "old_string": {"type": "string"},
                       "new_string": {"type": "string"}, "replace_all": {"type": "boolean"}},
        "required": ["file_path", "old_string", "new_string"],
    },
}
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=0;"},
    {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
]


@pytest.fixture(scope="module")
def proxy():
    p = LiveProxy(num_engines=1, max_new_tokens_cap=256)
    yield p
    p.close()


@pytest.fixture(autouse=True)
def _drain(proxy):
    proxy.recv_all(20)
    for e in proxy.engines:
        e.script.clear()
        e.requests.clear()
    yield


def client(proxy: LiveProxy, execution_id: str, *, bearer: bool = False) -> anthropic.Anthropic:
    token = mint_token(SECRET, execution_id)
    if bearer:
        return anthropic.Anthropic(base_url=proxy.url, auth_token=token, api_key=None, max_retries=0, timeout=30)
    return anthropic.Anthropic(base_url=proxy.url, api_key=token, max_retries=0, timeout=30)


def char_split_ids(text: str) -> list[int]:
    """Decodes to ``text`` but is not how the tokenizer would encode it: re-rendering would drift."""
    return [t for ch in text for t in TOK.encode(ch)]


def tool_call_ids(name: str, arguments: dict[str, Any]) -> list[int]:
    inner = "\n" + json.dumps({"name": name, "arguments": arguments}) + "\n"
    return [TOK.specials["<tool_call>"], *char_split_ids(inner), TOK.specials["</tool_call>"]]


def think_ids(thought: str) -> list[int]:
    return [TOK.specials["<think>"], *text_ids(f"\n{thought}\n"), TOK.specials["</think>"], *text_ids("\n\n")]


def records(proxy: LiveProxy) -> list[wire.CallRecord]:
    return [m for m in proxy.recv_all() if isinstance(m, wire.CallRecord)]


def raw(proxy: LiveProxy, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None):
    parts = urlsplit(proxy.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    status, payload, hdrs = resp.status, resp.read(), dict(resp.getheaders())
    conn.close()
    return status, payload, hdrs


# ---------------------------------------------------------------- splicing


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip_with_a_reserialised_echo_splices_the_engine_ids(proxy, stream):
    args = {"file_path": "a.txt", "old_string": "x", "new_string": "y"}
    out1 = [*char_split_ids("Editing."), *text_ids("\n"), *tool_call_ids("Edit", args), TOK.im_end]
    out2 = [*char_split_ids("Done."), TOK.im_end]
    proxy.engines[0].script.extend([Step(out1), Step(out2)])
    c = client(proxy, f"ex-splice-{stream}")
    first_user = {"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>be good</system-reminder>"},
        {"type": "text", "text": "fix a.txt", "cache_control": {"type": "ephemeral"}},
    ]}

    def ask(messages):
        kw = dict(model="claude-opus-5-5", max_tokens=1000, system=SYSTEM, tools=[EDIT_TOOL], messages=messages,
                  extra_body={"thinking": {"type": "adaptive"}, "context_management": {"edits": []},
                              "output_config": {"effort": "medium"}},
                  metadata={"user_id": "u"})
        if stream:
            with c.messages.stream(**kw) as s:
                return s.get_final_message()
        return c.messages.create(**kw)

    r1 = ask([first_user])
    assert r1.stop_reason == "tool_use" and r1.id.startswith("msg_")
    text, use = r1.content
    assert text.type == "text" and text.text == "Editing."
    assert use.type == "tool_use" and use.id.startswith("toolu_") and use.name == "Edit" and use.input == args
    # The echo as Claude Code re-serialises it: a default inserted first, keys reordered, the
    # first user message's list turned into a string, cache markers moved.
    echo_input = {"replace_all": False, "new_string": "y", "file_path": "a.txt", "old_string": "x"}
    messages = [
        {"role": "user", "content": "<system-reminder>be good</system-reminder>\nfix a.txt"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Editing."},
            {"input": echo_input, "name": "Edit", "id": use.id, "type": "tool_use"},
            {"type": "text", "text": ""},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "ok"}]},
            {"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}},
        ]},
    ]
    r2 = ask(messages)
    assert r2.stop_reason == "end_turn" and [b.text for b in r2.content] == ["Done."]
    rec1, rec2 = records(proxy)
    assert rec1.call_id == r1.id and rec2.call_id == r2.id
    head = rec1.prompt_ids + rec1.output_ids
    assert rec2.prompt_ids[: len(head)] == head and rec1.output_ids == out1
    tail = TOK.decode(rec2.prompt_ids[len(head):])
    assert "<tool_response>\nok\n</tool_response>" in tail and "go on" in tail
    assert r1.usage.input_tokens == len(rec1.prompt_ids) and r1.usage.output_tokens == len(out1)


def test_a_history_rendered_afresh_still_carries_the_engine_ids_of_echoed_turns(proxy):
    """After a compaction Claude Code starts a new root that keeps the last assistant turn verbatim:
    no earlier call is a prefix, yet that turn must be the engine's ids, not a re-encoding. A fork
    that copies only the tool_use blocks (its text dropped) is a different turn and is rendered."""
    args = {"file_path": "a.txt", "old_string": "x", "new_string": "y"}
    out1 = [*char_split_ids("Editing."), *text_ids("\n"), *tool_call_ids("Edit", args), TOK.im_end]
    proxy.engines[0].script.extend([Step(out1), Step(), Step()])
    c = client(proxy, "ex-new-root")
    r1 = c.messages.create(model="m", max_tokens=1000, tools=[EDIT_TOOL], messages=[{"role": "user", "content": "fix"}])
    use = r1.content[1]
    echoed = {"role": "assistant", "content": [
        {"type": "text", "text": "Editing."},
        {"type": "tool_use", "id": use.id, "name": "Edit", "input": {"replace_all": False, **args}},
    ]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "ok"}]}
    new_root = [{"role": "user", "content": "This session is being continued from a previous conversation."}]
    c.messages.create(model="m", max_tokens=1000, tools=[EDIT_TOOL], messages=new_root + [echoed, result])
    fork = {"role": "assistant", "content": [echoed["content"][1]]}
    c.messages.create(model="m", max_tokens=1000, tools=[EDIT_TOOL], messages=new_root + [fork, result])
    rec1, rec2, rec3 = records(proxy)
    assert rec2.prompt_ids[: len(rec1.prompt_ids)] != rec1.prompt_ids  # not a splice: rendered afresh
    n = len(out1)
    assert any(rec2.prompt_ids[i : i + n] == out1 for i in range(len(rec2.prompt_ids)))
    assert not any(rec3.prompt_ids[i : i + n] == out1 for i in range(len(rec3.prompt_ids)))
    assert "Editing." not in TOK.decode(rec3.prompt_ids)


def test_sub_agents_splice_on_their_own_lines(proxy):
    c = client(proxy, "ex-sub")
    sub = {"x-claude-code-agent-id": "a0123456789abcdef"}
    proxy.engines[0].script.extend([Step(char_split_ids("s1") + [TOK.im_end]), Step(), Step(), Step()])
    m1 = [{"role": "user", "content": "sub task"}]
    r1 = c.messages.create(model="m", max_tokens=50, messages=m1, extra_headers=sub)
    c.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": "main 1"}])
    c.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": "main 2"}])
    c.messages.create(model="m", max_tokens=50, extra_headers=sub, messages=m1 + [
        {"role": "assistant", "content": r1.content[0].text}, {"role": "user", "content": "next"}])
    s1, m_1, m_2, s2 = records(proxy)
    assert (s1.lineage, s1.agent_id, m_1.lineage, m_1.agent_id) == ("sub-agent", "a0123456789abcdef", "main", "")
    assert s2.prompt_ids[: len(s1.prompt_ids) + len(s1.output_ids)] == s1.prompt_ids + s1.output_ids


# ---------------------------------------------------------------- responses and SSE


def test_raw_stream_has_exact_event_order(proxy):
    out = [*think_ids("plan"), *text_ids("Hi."), *text_ids("\n"), *tool_call_ids("Edit", {"file_path": "f"}),
           TOK.im_end]
    proxy.engines[0].script.append(Step(out))
    body = {"model": "m", "max_tokens": 100, "stream": True, "tools": [EDIT_TOOL],
            "messages": [{"role": "user", "content": "go"}]}
    status, payload, hdrs = raw(proxy, "POST", "/v1/messages?beta=true", body,
                                {"x-api-key": mint_token(SECRET, "ex-sse")})
    assert status == 200 and hdrs["Content-Type"].startswith("text/event-stream")
    events = []
    for chunk in payload.decode().split("\n\n"):
        if chunk:
            ev, data = chunk.split("\n")
            assert ev.startswith("event: ") and data.startswith("data: ")
            parsed = json.loads(data[6:])
            assert parsed["type"] == ev[7:]
            events.append(parsed)
    kinds = [e["type"] for e in events]
    assert kinds == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["id"] == hdrs["request-id"]
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == [
        "thinking_delta", "signature_delta", "text_delta", "input_json_delta"]
    assert events[9]["content_block"]["input"] == {} and events[9]["content_block"]["id"].startswith("toolu_")
    assert json.loads(events[10]["delta"]["partial_json"]) == {"file_path": "f"}
    assert events[12]["delta"]["stop_reason"] == "tool_use" and events[12]["usage"]["output_tokens"] == len(out)


def test_thinking_and_max_tokens_non_streaming_with_bearer_auth(proxy):
    proxy.engines[0].script.append(Step([*think_ids("hmm"), *text_ids("a b c d e f g h i j k")]))
    r = client(proxy, "ex-think", bearer=True).messages.create(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None and r.role == "assistant"
    assert r.content[0].type == "thinking" and r.content[0].thinking == "hmm"
    assert r.usage.output_tokens == 8


# ---------------------------------------------------------------- lineage


def test_lineage_from_headers_summary_text_and_title_calls(proxy):
    c = client(proxy, "ex-lineage")
    sub = {"x-claude-code-agent-id": "a00000000000000ff"}
    summary_user = {"role": "user", "content": [
        {"type": "text", "text": "earlier"},
        {"type": "text", "text": f"CRITICAL: Respond with TEXT ONLY. {SUMMARY_MARKER} of the conversation."},
    ]}
    c.messages.create(model="m", max_tokens=50, messages=[summary_user])
    c.messages.create(model="m", max_tokens=50, messages=[summary_user], extra_headers=sub)
    c.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": "hi"}], extra_headers=sub)
    c.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": "<session>hi</session>"}],
                      tools=[], extra_body={"output_config": {"format": {"type": "json_schema", "schema": {}}}})
    c.messages.create(model="m", max_tokens=50, messages=[
        {"role": "user", "content": "hi"}, {"role": "system", "content": []},
        {"role": "system", "content": [{"type": "text", "text": "agents: x"}]}])
    got = [(r.lineage, r.agent_id) for r in records(proxy)]
    assert got == [("main-summary", ""), ("sub-agent-summary", sub["x-claude-code-agent-id"]),
                   ("sub-agent", sub["x-claude-code-agent-id"]), ("side", ""), ("main", "")]


# ---------------------------------------------------------------- errors and side endpoints


def test_errors_come_in_anthropic_shape(proxy):
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=proxy.url, api_key="nope", max_retries=0).messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 401 and err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "authentication_error"
    key = {"x-api-key": mint_token(SECRET, "ex-err")}
    for bad in (b"{not json", {"messages": [{"role": "user", "content": "x"}]},
                {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "weird"}]}]}):
        status, payload, _ = raw(proxy, "POST", "/v1/messages", bad, key)
        body = json.loads(payload)
        assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    words = " ".join(f"w{i}" for i in range(2500))
    with pytest.raises(anthropic.BadRequestError) as err:
        client(proxy, "ex-err").messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": words}])
    message = err.value.body["error"]["message"]
    assert message.startswith("prompt is too long: ") and message.endswith(" tokens > 2048 maximum")
    assert proxy.engines[0].requests == [] and records(proxy) == []


def test_no_engine_gets_529_overloaded():
    p = LiveProxy(num_engines=1)
    try:
        p.set_routes([])
        status, payload, _ = raw(p, "POST", "/v1/messages", {"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "x"}]}, {"x-api-key": mint_token(SECRET, "ex-529")})
        body = json.loads(payload)
        assert status == 529 and body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    finally:
        p.close()


def test_count_tokens_and_head_routes(proxy):
    messages = [{"role": "user", "content": "foo"}]
    got = client(proxy, "ex-count").messages.count_tokens(model="m", system="sys", messages=messages, tools=[EDIT_TOOL])
    tool = {"type": "function", "function": {"name": "Edit", "description": EDIT_TOOL["description"],
                                             "parameters": EDIT_TOOL["input_schema"]}}
    want = render_messages(TOK, [{"role": "system", "content": "sys"}, *messages], tools=[tool])
    assert got.input_tokens == len(want)
    for path in ("/", "/api/hello"):
        status, payload, _ = raw(proxy, "HEAD", path)
        assert status == 200 and payload == b""
    assert proxy.engines[0].requests == []


def test_the_billing_line_stays_out_of_the_prompt_so_tasks_share_their_system_prompt():
    """Claude Code's first system block hashes the task's first message: rendered, it would end the
    prefix two tasks' executions share after ~33 ids. Every other block is kept, in order."""
    from harness_proxy.anthropic_api import parse_messages_request

    def system_of(task: str, billing: str) -> str:
        body = {"max_tokens": 8, "messages": [{"role": "user", "content": task}],
                "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.332.{billing}; "
                                                    "cc_entrypoint=sdk-cli;"}, *SYSTEM[1:],
                           {"type": "text", "text": "Working directory: /workspace"}]}
        return parse_messages_request(json.dumps(body).encode(), {}).chat.messages[0]["content"]

    assert system_of("fix a", "3f1") == system_of("fix b", "a07") == "You are a coding agent.\nWorking directory: /workspace"
