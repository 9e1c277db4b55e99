"""Random bodies against the live HTTP API: never a 5xx other than 503, and the proxy keeps serving."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from base.execution_token import mint_token
from tests.harness_proxy import SECRET, LiveProxy
from tests.harness_proxy.test_server import get_raw, post_raw

TOKEN = mint_token(SECRET, "ex-fuzz")

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=12)
_content = st.one_of(
    st.text(max_size=40), st.none(), _json,
    st.lists(st.fixed_dictionaries({}, optional={"type": st.sampled_from(["text", "image_url", 3]),
                                                 "text": st.one_of(st.text(max_size=20), _scalars)}), max_size=3),
)
_tool_call = st.fixed_dictionaries({}, optional={
    "id": _scalars, "type": st.sampled_from(["function", 1]),
    "function": st.one_of(_json, st.fixed_dictionaries({}, optional={
        "name": st.one_of(st.sampled_from(["bash", ""]), _scalars),
        "arguments": st.one_of(st.just('{"command": "ls"}'), st.text(max_size=20), _json)})),
})
_message = st.one_of(_json, st.fixed_dictionaries({}, optional={
    "role": st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"]), _scalars),
    "content": _content,
    "tool_calls": st.one_of(st.lists(_tool_call, max_size=2), _scalars),
    "reasoning_content": st.one_of(st.text(max_size=10), _scalars),
    "tool_call_id": _scalars,
}))
_request = st.fixed_dictionaries({}, optional={
    "model": st.one_of(st.just("m"), _scalars),
    "messages": st.one_of(st.lists(_message, min_size=1, max_size=5), _json),
    "tools": st.one_of(st.just([{"type": "function", "function": {"name": "bash"}}]), _json),
    "temperature": st.one_of(st.floats(0, 2), _scalars),
    "top_p": st.one_of(st.floats(0.01, 1), _scalars),
    "max_tokens": st.one_of(st.integers(1, 10**6), _scalars),
    "max_completion_tokens": st.one_of(st.integers(-3, 100), _scalars),
    "stream": st.one_of(st.booleans(), _scalars),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), _json),
    "n": st.one_of(st.just(1), _scalars),
    "stop": _json,
})

_text = st.text(max_size=60) | st.sampled_from(["<|im_end|>", "<tool_call>", "\ud800", "</think>"])
_plausible = st.fixed_dictionaries(
    {"messages": st.lists(st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "tool", "developer"]), "content": _text}),
        st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none() | _text}, optional={
            "tool_calls": st.lists(st.fixed_dictionaries({"id": st.text(max_size=5), "type": st.just("function"),
                                                          "function": st.fixed_dictionaries({
                                                              "name": st.text(max_size=8),
                                                              "arguments": st.text(max_size=20)})}), max_size=2)}),
    ), min_size=1, max_size=6)},
    optional={"model": _text, "stream": st.booleans(), "temperature": st.floats(0, 2), "max_tokens": st.integers(1, 10**9),
              "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                  {"name": st.text(max_size=8)}, optional={"parameters": _json})}), max_size=2)},
)


def _body(value) -> bytes:
    return value if isinstance(value, bytes) else json.dumps(value, allow_nan=True).encode()


@pytest.fixture(scope="module")
def proxy():
    p = LiveProxy()
    yield p
    p.close()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.one_of(st.binary(max_size=200), _json, _request, _plausible, _plausible),
       authorised=st.sampled_from([True] * 9 + [False]))
def test_random_requests_never_break_the_proxy(proxy, body, authorised):
    token = TOKEN if authorised else "gyre.ex-fuzz." + "0" * 64
    status, got = post_raw(proxy.url, _body(body), token=token)
    event(f"HTTP {status}")
    assert status < 500 or status == 503, (status, got)
    if status != 200:
        assert set(got["error"]) == {"message", "type", "param", "code"}


def test_still_healthy_and_serving_after_the_fuzz(proxy):
    assert get_raw(proxy.url, "/health")[0] == 200
    status, got = post_raw(proxy.url, json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
                           token=TOKEN)
    assert status == 200 and got["choices"][0]["message"]["content"] == "ok"


# ---------------------------------------------------------------- the Anthropic Messages API

_block = st.one_of(_json, st.fixed_dictionaries({}, optional={
    "type": st.one_of(st.sampled_from(["text", "thinking", "redacted_thinking", "tool_use", "tool_result", "image",
                                       "tool_reference"]), _scalars),
    "text": st.one_of(_text, _scalars), "thinking": st.one_of(_text, _scalars), "signature": _scalars,
    "id": st.one_of(st.just("toolu_x"), _scalars), "name": st.one_of(st.just("Bash"), _scalars),
    "input": st.one_of(st.just({"command": "ls"}), _json), "tool_use_id": _scalars,
    "content": st.one_of(_text, st.lists(_json, max_size=2), _scalars), "is_error": _scalars,
    "cache_control": st.one_of(st.just({"type": "ephemeral"}), _scalars),
}))
_anthropic_message = st.one_of(_json, st.fixed_dictionaries({}, optional={
    "role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool"]), _scalars),
    "content": st.one_of(_text, st.lists(_block, max_size=3), _scalars),
    "output_config": _json,
}))
_messages_request = st.fixed_dictionaries({}, optional={
    "model": st.one_of(st.just("claude-opus-5-5"), _scalars),
    "max_tokens": st.one_of(st.integers(-2, 10**6), _scalars),
    "messages": st.one_of(st.lists(_anthropic_message, min_size=1, max_size=5), _json),
    "system": st.one_of(_text, st.lists(_block, max_size=3), _scalars),
    "tools": st.one_of(st.just([{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}]),
                       st.lists(st.fixed_dictionaries({}, optional={"name": _scalars, "input_schema": _json,
                                                                    "defer_loading": _scalars}), max_size=2), _json),
    "stream": st.one_of(st.booleans(), _scalars),
    "temperature": st.one_of(st.floats(0, 1), _scalars),
    "top_p": st.one_of(st.floats(0.01, 1), _scalars),
    "thinking": _json, "context_management": _json, "output_config": _json, "metadata": _json,
})
_good_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _text}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": _text, "signature": st.just("")}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.just("toolu_x"), "name": st.just("Bash"),
                           "input": st.dictionaries(st.text(max_size=5), _text, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.just("toolu_x"),
                           "content": st.one_of(_text, st.lists(st.fixed_dictionaries(
                               {"type": st.just("text"), "text": _text}), max_size=2))}),
)
_plausible_anthropic = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 10**6), "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": st.one_of(_text, st.lists(_good_block, max_size=3))}), min_size=1, max_size=5)},
    optional={"model": _text, "stream": st.booleans(), "system": st.one_of(_text, st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": _text}), max_size=2)), "temperature": st.floats(0, 1)},
)
_ANTHROPIC_ERROR_TYPES = {"invalid_request_error", "authentication_error", "request_too_large", "overloaded_error",
                          "not_found_error", "permission_error", "rate_limit_error", "api_error"}


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.one_of(st.binary(max_size=200), _json, _messages_request, _plausible_anthropic, _plausible_anthropic),
       path=st.sampled_from(["/v1/messages", "/v1/messages?beta=true", "/v1/messages/count_tokens"]),
       authorised=st.sampled_from([True] * 9 + [False]))
def test_random_anthropic_requests_get_anthropic_errors_and_never_break_the_proxy(proxy, body, path, authorised):
    token = TOKEN if authorised else "gyre.ex-fuzz." + "0" * 64
    status, got = post_raw(proxy.url, _body(body), headers={"x-api-key": token}, path=path)
    event(f"{path.split('?')[0]} HTTP {status}")
    assert status < 500 or status == 529, (status, got)
    if status != 200:
        assert got["type"] == "error" and got["error"]["type"] in _ANTHROPIC_ERROR_TYPES, got
        assert isinstance(got["error"]["message"], str) and got["error"]["message"]
    if not authorised:
        assert status == 401


def test_anthropic_still_serving_after_the_fuzz(proxy):
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}]}
    status, got = post_raw(proxy.url, json.dumps(body).encode(), headers={"x-api-key": TOKEN}, path="/v1/messages")
    assert status == 200 and got["content"] == [{"type": "text", "text": "ok"}]
