"""The proxy end to end over HTTP: openai SDK client, scripted SGLang-API engines, real ZMQ records."""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest

from base import wire
from base.execution_token import mint_token
from tests.harness_proxy import SECRET, TOK, LiveProxy, Step, text_ids

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


@pytest.fixture
def proxy():
    p = LiveProxy()
    yield p
    p.close()


def post_raw(url: str, body: bytes, *, token: str | None = None, headers: dict[str, str] | None = None,
             path: str = "/v1/chat/completions") -> tuple[int, Any]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    conn.request("POST", path, body=body, headers=hdrs)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(data)
    except ValueError:
        return resp.status, data


def get_raw(url: str, path: str) -> tuple[int, Any]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    status, data = resp.status, json.loads(resp.read())
    conn.close()
    return status, data


def wait_until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def char_split_ids(text: str) -> list[int]:
    """``text`` tokenised one character at a time: decodes to ``text``, re-encodes differently."""
    return [t for ch in text for t in TOK.encode(ch)]


def non_round_tripping_ids(rng: random.Random, n: int) -> list[int]:
    while True:
        ids = [rng.randrange(0, TOK.num_ranks) for _ in range(n)]
        if TOK.encode(TOK.decode(ids)) != ids:
            return ids


def records(msgs: list[wire.Message]) -> list[wire.CallRecord]:
    return [m for m in msgs if isinstance(m, wire.CallRecord)]


# ---------------------------------------------------------------- TITO: zero drift


@pytest.mark.parametrize("stream", [False, True])
def test_multi_turn_prompts_extend_the_engine_ids_exactly(proxy, stream):
    rng = random.Random(7)
    out1 = char_split_ids("hello there, world") + [TOK.im_end]
    out2 = non_round_tripping_ids(rng, 12) + [TOK.im_end]
    out3 = non_round_tripping_ids(rng, 9)  # cut by length: no <|im_end|>
    assert TOK.encode(TOK.decode(out1[:-1])) != out1[:-1]  # the premise: text would drift
    proxy.engines[0].script.extend([Step(out1), Step(out2), Step(out3, finish="length")])
    client = proxy.client("ex-drift")

    def ask(messages):
        if not stream:
            r = client.chat.completions.create(model="policy-model", messages=messages)
            return r.choices[0].message.content, r.choices[0].finish_reason
        content, finish = "", None
        for chunk in client.chat.completions.create(model="policy-model", messages=messages, stream=True):
            if chunk.choices:
                content += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return content, finish

    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    got = []
    for follow_up in ("and then?", [{"type": "text", "text": "more"}], "last"):
        content, finish = ask(messages)
        got.append((content, finish))
        # the harness echoes our reply (content null vs "" alike) and appends a turn
        messages = messages + [{"role": "assistant", "content": content}, {"role": "user", "content": follow_up}]
    recs = records(proxy.recv_all())
    assert [r.call_index for r in recs] == [0, 1, 2]
    assert got[0] == ("hello there, world", "stop") and got[2][1] == "length"
    for prev, nxt in zip(recs, recs[1:]):
        head = prev.prompt_ids + prev.output_ids
        assert nxt.prompt_ids[: len(head)] == head
    # the length-cut output is closed with <|im_end|> as context before the next turn
    assert recs[1].output_ids == out2 and recs[2].output_ids == out3
    assert all(r.weight_version == 3 and r.cell_id == 0 and r.lineage == "main" for r in recs)
    assert all(len(r.output_logprobs) == len(r.output_ids) for r in recs)


def test_rewritten_history_is_rendered_from_scratch(proxy):
    proxy.engines[0].script.extend([Step(char_split_ids("abc") + [TOK.im_end]), Step()])
    client = proxy.client("ex-rewrite")
    m1 = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="m", messages=m1)
    client.chat.completions.create(
        model="m", messages=m1 + [{"role": "assistant", "content": "summary"}, {"role": "user", "content": "go"}]
    )
    r1, r2 = records(proxy.recv_all())
    assert r2.prompt_ids[: len(r1.prompt_ids) + len(r1.output_ids)] != r1.prompt_ids + r1.output_ids
    assert TOK.decode(r2.prompt_ids).endswith("<|im_start|>assistant\nsummary<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n")


# ---------------------------------------------------------------- tool calls


def _tool_call_output(name: str, args_json: str, text: str = "") -> list[int]:
    ids = TOK.encode(text + "\n") if text else []
    return [*ids, TOK.specials["<tool_call>"], *TOK.encode(f'\n{{"name": "{name}", "arguments": {args_json}}}\n'),
            TOK.specials["</tool_call>"], TOK.im_end]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_parse_render_and_splice(proxy, stream):
    out1 = _tool_call_output("bash", '{"command": "ls -la", "timeout": 5}', text="Let me look.")
    proxy.engines[0].script.extend([Step(out1), Step()])
    client = proxy.client("ex-tools")
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You code."}, {"role": "user", "content": "list files"}]
    if stream:
        calls: dict[int, dict[str, Any]] = {}
        content, finish = "", None
        for chunk in client.chat.completions.create(model="m", messages=messages, tools=[BASH_TOOL], stream=True):
            for c in chunk.choices:
                content += c.delta.content or ""
                finish = c.finish_reason or finish
                for tc in c.delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] += tc.id or ""
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
        call = calls[0]
    else:
        r = client.chat.completions.create(model="m", messages=messages, tools=[BASH_TOOL])
        msg, finish = r.choices[0].message, r.choices[0].finish_reason
        content = msg.content
        call = {"id": msg.tool_calls[0].id, "name": msg.tool_calls[0].function.name,
                "arguments": msg.tool_calls[0].function.arguments}
    assert finish == "tool_calls" and content == "Let me look."
    assert call["name"] == "bash" and json.loads(call["arguments"]) == {"command": "ls -la", "timeout": 5}
    # the harness re-serialises the arguments with its own key order; still the same turn
    echoed_args = json.dumps({"timeout": 5, "command": "ls -la"})
    messages += [
        {"role": "assistant", "content": content, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": "bash", "arguments": echoed_args}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "a.txt\nb.txt"},
        {"role": "tool", "tool_call_id": "other", "content": "second"},
    ]
    client.chat.completions.create(model="m", messages=messages, tools=[BASH_TOOL])
    r1, r2 = records(proxy.recv_all())
    first = TOK.decode(r1.prompt_ids)
    assert "# Tools" in first and '<tools>\n{"type": "function", "function": {"name": "bash"' in first
    assert TOK.specials["<tool_call>"] in r1.prompt_ids  # the template's own control tokens are specials
    head = r1.prompt_ids + r1.output_ids
    assert r2.prompt_ids[: len(head)] == head
    tail = r2.prompt_ids[len(head):]
    assert tail == (
        TOK.encode("\n") + [TOK.im_start] + TOK.encode("user\n") + [TOK.specials["<tool_response>"]]
        + TOK.encode("\na.txt\nb.txt\n") + [TOK.specials["</tool_response>"]] + TOK.encode("\n")
        + [TOK.specials["<tool_response>"]] + TOK.encode("\nsecond\n") + [TOK.specials["</tool_response>"]]
        + [TOK.im_end] + TOK.encode("\n") + [TOK.im_start] + TOK.encode("assistant\n")
    )


def test_invalid_tool_call_json_stays_text(proxy):
    bad = [TOK.specials["<tool_call>"], *TOK.encode('\n{"name": "bash", "arguments": {oops}\n'),
           TOK.specials["</tool_call>"], TOK.im_end]
    proxy.engines[0].script.append(Step(bad))
    r = proxy.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], tools=[BASH_TOOL])
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == '<tool_call>\n{"name": "bash", "arguments": {oops}\n</tool_call>'


# ---------------------------------------------------------------- auth and sealing


def test_missing_wrong_and_sealed_tokens_are_refused(proxy):
    msgs = [{"role": "user", "content": "hi"}]
    for token in ("", "not-a-token", mint_token(b"another secret", "ex-1"), mint_token(SECRET, "ex-1")[:-1] + "0"):
        status, body = post_raw(proxy.url, json.dumps({"messages": msgs}).encode(), token=token or None)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", token
    with pytest.raises(openai.AuthenticationError):
        proxy.client(token="gyre.ex-1." + "0" * 64).chat.completions.create(model="m", messages=msgs)

    client = proxy.client("ex-seal")
    client.chat.completions.create(model="m", messages=msgs)
    client.chat.completions.create(model="m", messages=msgs)
    assert proxy.seal("ex-seal") == 2
    with pytest.raises(openai.AuthenticationError) as err:
        client.chat.completions.create(model="m", messages=msgs)
    assert "sealed" in str(err.value)
    got = proxy.recv_all()
    assert [type(m).__name__ for m in got] == ["CallRecord", "CallRecord", "ExecutionSealed"]
    assert got[-1] == wire.ExecutionSealed(execution_id="ex-seal", num_calls=2)
    assert proxy.seal("ex-never-called") == 0
    assert proxy.recv() == wire.ExecutionSealed(execution_id="ex-never-called", num_calls=0)


def test_seal_during_a_call_cancels_it_and_records_nothing(proxy):
    proxy.engines[0].script.append(Step(hang=True))
    result: dict[str, Any] = {}

    def call():
        try:
            proxy.client("ex-mid").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        except openai.APIStatusError as exc:
            result["status"] = exc.status_code

    t = threading.Thread(target=call)
    t.start()
    wait_until(lambda: proxy.lt.call(proxy.engines[0].hanging.is_set), "the engine to hold the call")
    assert proxy.seal("ex-mid") == 0
    t.join(30)
    assert result["status"] == 401
    wait_until(lambda: proxy.engines[0].aborted, "the engine request to be aborted")
    assert proxy.engines[0].aborted == [proxy.engines[0].requests[0]["rid"]]
    assert proxy.recv_all() == [wire.ExecutionSealed(execution_id="ex-mid", num_calls=0)]


def test_harness_disconnect_aborts_the_engine_request_and_records_the_abort(proxy):
    proxy.engines[0].script.append(Step(hang=True))
    parts = urlsplit(proxy.url)
    body = json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {mint_token(SECRET, 'ex-gone')}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_until(lambda: proxy.lt.call(proxy.engines[0].hanging.is_set), "the engine to hold the call")
    sock.close()
    wait_until(lambda: proxy.engines[0].aborted, "the engine request to be aborted")
    rid = proxy.engines[0].requests[0]["rid"]
    assert proxy.engines[0].aborted == [rid]
    [hung_up] = records(proxy.recv_all())
    assert (hung_up.call_id, hung_up.finish_reason, hung_up.output_ids, hung_up.cell_id) == (rid, "abort", [], -1)
    assert hung_up.prompt_ids == proxy.engines[0].requests[0]["input_ids"]
    # still serving
    proxy.client("ex-gone").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert [r.call_index for r in records(proxy.recv_all())] == [1]


# ---------------------------------------------------------------- bad requests


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"\xff\xfe", None),
    (b"[1, 2]", None),
    (b"{}", "messages"),
    (json.dumps({"messages": "hi"}).encode(), "messages"),
    (json.dumps({"messages": []}).encode(), "messages"),
    (json.dumps({"messages": [3]}).encode(), "messages[0]"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "messages[0].role"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "messages[0].content"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}).encode(),
     "messages[0].content[0]"),
    (json.dumps({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 1}}]}]}).encode(),
     "messages[0].tool_calls[0]"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": 9}).encode(), "temperature"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "top_p": 0}).encode(), "top_p"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}).encode(), "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(), "stream"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode(), "n"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}).encode(), "tools[0]"),
])
def test_malformed_requests_get_400_in_openai_shape(proxy, body, param):
    status, got = post_raw(proxy.url, body, token=mint_token(SECRET, "ex-bad"))
    assert status == 400
    assert set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["type"] == "invalid_request_error" and got["error"]["param"] == param
    assert proxy.engines[0].requests == [] and proxy.recv_all(50) == []


def test_oversized_body_gets_413(proxy):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 70_000}]}).encode()
    status, got = post_raw(proxy.url, big, token=mint_token(SECRET, "ex-big"))
    assert status == 413 and got["error"]["type"] == "invalid_request_error"
    # chunked, with no Content-Length to check up front
    parts = urlsplit(proxy.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=iter([big[:40_000], big[40_000:]]), encode_chunked=True,
                 headers={"Authorization": f"Bearer {mint_token(SECRET, 'ex-big')}", "Transfer-Encoding": "chunked"})
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["message"]
    conn.close()
    assert get_raw(proxy.url, "/health")[0] == 200


def test_prompt_over_the_context_limit_is_refused_not_truncated(proxy):
    words = " ".join(f"w{i}" for i in range(2500))
    with pytest.raises(openai.BadRequestError) as err:
        proxy.client().chat.completions.create(model="m", messages=[{"role": "user", "content": words}])
    assert err.value.code == "context_length_exceeded"
    assert proxy.engines[0].requests == []


def test_max_tokens_is_capped_and_eval_sampling_is_passed_through(proxy):
    """An eval execution samples as its harness asks; a training one as the run's algo.rollout."""
    client = proxy.client(token=mint_token(SECRET, "ex-eval", train=False))
    msgs = [{"role": "user", "content": "x"}]
    client.chat.completions.create(model="m", messages=msgs, max_tokens=1000, temperature=0.5, top_p=0.9)
    client.chat.completions.create(model="m", messages=msgs, max_completion_tokens=5)
    client.chat.completions.create(model="m", messages=msgs)
    proxy.client("ex-train").chat.completions.create(model="m", messages=msgs, temperature=0.5, top_p=0.9)
    sp = [r["sampling_params"] for e in proxy.engines for r in e.requests]
    assert {"max_new_tokens": 64, "temperature": 0.5, "top_p": 0.9, "top_k": -1,
            "stop_token_ids": [TOK.im_end, TOK.endoftext]} in sp
    assert sorted(p["max_new_tokens"] for p in sp) == [5, 64, 64, 64]
    assert sum(p["temperature"] == 0.5 for p in sp) == 1  # the training call's 0.5 was not used
    got = sorted((r.execution_id, r.call_index, r.temperature, r.top_p, r.harness_temperature, r.harness_top_p)
                 for r in records(proxy.recv_all()))
    assert got == [("ex-eval", 0, 0.5, 0.9, 0.5, 0.9), ("ex-eval", 1, 1.0, 1.0, 1.0, 1.0),
                   ("ex-eval", 2, 1.0, 1.0, 1.0, 1.0), ("ex-train", 0, 1.0, 1.0, 0.5, 0.9)]


# ---------------------------------------------------------------- routing and retries


@pytest.mark.parametrize("failure", [Step(status=503), Step(output_ids=[], finish="abort"), Step(status=500)])
def test_a_failing_engine_is_retried_on_another_and_recorded_once(proxy, failure):
    proxy.engines[0].script.append(failure)
    r = proxy.client("ex-retry").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].message.content == "ok"
    e0, e1 = proxy.engines[0].requests, proxy.engines[1].requests
    assert len(e0) == 1 and len(e1) == 1 and e0[0]["input_ids"] == e1[0]["input_ids"]
    (rec,) = records(proxy.recv_all())
    assert rec.cell_id == 1 and rec.call_id == r.id and rec.call_index == 0


def test_a_call_cut_mid_decode_goes_on_elsewhere_keeping_each_tokens_logprob_and_version(proxy):
    """A draining cell answers `abort` with what it had generated: the next cell continues from the
    prompt and those tokens, and the harness gets one answer; the record keeps the first cell's
    tokens with their log-probs and version, then the second's."""
    part = text_ids("hel")
    proxy.engines[0].script.append(Step(output_ids=part, finish="abort"))
    proxy.engines[1].weight_version = 4  # the next cell serves a newer version
    proxy.set_routes(proxy.engines)
    try:
        r = proxy.client("ex-cut").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                           max_tokens=20)
    finally:
        proxy.engines[1].weight_version = 3
        proxy.set_routes(proxy.engines)
    assert r.choices[0].message.content == "helok"
    (first,), (second,) = proxy.engines[0].requests, proxy.engines[1].requests
    assert second["input_ids"] == first["input_ids"] + part
    assert second["sampling_params"]["max_new_tokens"] == first["sampling_params"]["max_new_tokens"] - len(part)
    (rec,) = records(proxy.recv_all())
    rest = text_ids("ok") + [TOK.im_end]
    assert rec.output_ids == part + rest and rec.prompt_ids == first["input_ids"]
    lp = [-0.25 - (i % 3) * 0.5 for i in range(len(part))] + [-0.25 - (i % 3) * 0.5 for i in range(len(rest))]
    assert rec.output_logprobs == pytest.approx(lp)
    assert rec.weight_version == 3 and [(s.version, s.start, s.end) for s in rec.weight_versions] == [
        (3, 0, len(part)), (4, len(part), len(part) + len(rest))]


def test_a_dead_engine_is_retried_on_another(proxy):
    dead = wire.EngineRoute(cell_id=0, url="http://127.0.0.1:9")  # discard port: connection refused
    proxy.routing_version += 1
    proxy.lt.call(proxy.server.apply_routing_table, wire.RoutingTable(
        version=proxy.routing_version, engines=[dead, proxy.engines[1].route()]))
    proxy.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    (rec,) = records(proxy.recv_all())
    assert rec.cell_id == 1


def test_no_engine_gives_503_and_no_record(proxy):
    proxy.set_routes([])
    with pytest.raises(openai.APIStatusError) as err:
        proxy.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 503 and err.value.code == "engine_unavailable"
    proxy.set_routes(proxy.engines)
    for e in proxy.engines:
        e.script.extend([Step(status=503)] * 3)
    with pytest.raises(openai.APIStatusError) as err:
        proxy.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 503
    assert proxy.recv_all() == []


def test_calls_stick_to_their_engine_while_it_serves(proxy):
    msgs = [{"role": "user", "content": "x"}]
    a, b = proxy.client("ex-a"), proxy.client("ex-b")
    a.chat.completions.create(model="m", messages=msgs)
    b.chat.completions.create(model="m", messages=msgs)
    a.chat.completions.create(model="m", messages=msgs)
    b.chat.completions.create(model="m", messages=msgs)
    cells = [(r.execution_id, r.cell_id) for r in records(proxy.recv_all())]
    assert cells == [("ex-a", 0), ("ex-b", 1), ("ex-a", 0), ("ex-b", 1)]
    proxy.set_routes([proxy.engines[1]])  # cell 0 leaves serving
    a.chat.completions.create(model="m", messages=msgs)
    proxy.set_routes(proxy.engines)  # back: ex-a stays where its cache now is
    a.chat.completions.create(model="m", messages=msgs)
    assert [r.cell_id for r in records(proxy.recv_all())] == [1, 1]


def test_a_call_never_reaches_an_engine_older_than_its_token_allows(proxy):
    """The staleness race: the harness calls before the routing table that drops a too-old cell
    arrives. The floor in the execution's token keeps the call off that cell; it waits for a table
    with a new-enough engine instead of being answered by old weights."""
    old, new = proxy.engines
    old.weight_version, new.weight_version = 1, 3
    proxy.set_routes([old])  # the stale table: only the v1 cell is listed
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=mint_token(SECRET, "ex-f", min_version=2),
                           max_retries=0, timeout=30)
    done: list[Any] = []
    t = threading.Thread(target=lambda: done.append(
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])))
    t.start()
    time.sleep(0.5)
    assert not done and old.requests == []  # waiting, not served by v1
    proxy.set_routes([old, new])
    t.join(10)
    assert done and old.requests == []
    (rec,) = records(proxy.recv_all())
    assert (rec.cell_id, rec.weight_version) == (1, 3)
    # An engine that answers with older weights than it was listed with is not believed either.
    new.weight_version = 1
    proxy.routing_version += 1
    proxy.lt.call(proxy.server.apply_routing_table, wire.RoutingTable(
        version=proxy.routing_version, engines=[wire.EngineRoute(cell_id=1, url=new.url, weight_version=3)]))
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "y"}])
    assert err.value.status_code == 503 and "served weight v1 < v2" in err.value.message
    assert records(proxy.recv_all()) == []


def test_an_older_routing_table_is_ignored(proxy):
    assert not proxy.lt.call(proxy.server.apply_routing_table, wire.RoutingTable(version=0, engines=[]))
    assert get_raw(proxy.url, "/health")[1]["num_engines"] == 2


# ---------------------------------------------------------------- the rest of the API


def test_call_id_header_models_and_health(proxy):
    raw = proxy.client().chat.completions.with_raw_response.create(
        model="policy-model", messages=[{"role": "user", "content": "x"}])
    r = raw.parse()
    assert raw.headers["x-gyre-call-id"] == r.id and r.id.startswith("chatcmpl-")
    assert r.model == "policy-model" and r.object == "chat.completion"
    assert r.usage.completion_tokens == len(text_ids("ok")) + 1 and r.usage.prompt_tokens > 0
    (rec,) = records(proxy.recv_all())
    assert rec.call_id == r.id and rec.prompt_ids == proxy.engines[0].requests[0]["input_ids"]
    assert rec.started_at <= rec.finished_at
    assert [m.id for m in proxy.client().models.list()] == ["gyre-policy"]
    status, health = get_raw(proxy.url, "/health")
    assert status == 200 and health["status"] == "ok" and health["routing_version"] == 1


def test_stream_with_usage_ends_with_done(proxy):
    parts = urlsplit(proxy.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    body = {"model": "m\ud800", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"Authorization": f"Bearer {mint_token(SECRET, 'ex-s')}"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events = [e for e in resp.read().decode().split("\n\n") if e]
    conn.close()
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert {c["id"] for c in chunks} == {resp.getheader("x-gyre-call-id")}
    assert {c["model"] for c in chunks} == {"m\ud800"}  # a lone surrogate from the harness is echoed, escaped
