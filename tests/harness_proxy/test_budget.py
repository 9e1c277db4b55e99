"""Per-execution budgets (``proxy.execution_budget``) over real HTTP, through the official SDKs:
each budget used up is refused 403 before any engine time, too many calls at once 429, in both
APIs' shapes; counted at ``GET /stats``, logged once per execution; other executions unaffected;
0 is no limit; bad values refused when the config is built. The decision itself
(``budget.budget_refusal``) is tested without HTTP at the end."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anthropic
import openai
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from base.typed_config import ConfigError, build
from base.execution_token import mint_token
from harness_proxy.budget import BUDGET_KINDS, BudgetState, budget_refusal
from harness_proxy.config import ExecutionBudgetConfig, ProxyConfig
from tests.harness_proxy import PROXY_CONFIG, SECRET, LiveProxy, Step, proxy_config
from tests.harness_proxy.test_server import get_raw, wait_until

ROOT = Path(__file__).resolve().parents[2]
MSGS = [{"role": "user", "content": "hi"}]
UNLIMITED = {"max_calls": 0, "max_tokens": 0, "max_wall_s": 0.0, "max_concurrent_calls": 0}


def budget(**limits: Any) -> dict[str, Any]:
    """``execution_budget`` with only ``limits`` set; the rest unlimited."""
    return {**UNLIMITED, **limits}


@pytest.fixture
def make_proxy():
    made: list[LiveProxy] = []

    def make(**limits: Any) -> LiveProxy:
        made.append(LiveProxy(num_engines=1, execution_budget=budget(**limits)))
        return made[-1]

    yield make
    for p in made:
        p.close()


# ---------------------------------------------------------------- helpers


def anthropic_client(proxy: LiveProxy, execution_id: str, *, max_retries: int = 0) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key=mint_token(SECRET, execution_id), max_retries=max_retries,
                               timeout=30)


def openai_client(proxy: LiveProxy, execution_id: str, *, max_retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=mint_token(SECRET, execution_id),
                         max_retries=max_retries, timeout=30)


def refused(proxy: LiveProxy) -> dict[str, int]:
    return get_raw(proxy.url, "/stats")[1]["refused"]


def budget_lines(caplog: pytest.LogCaptureFixture, kind: str, execution_id: str) -> list[str]:
    want = f"refused {kind} from {execution_id}:"
    return [r.getMessage() for r in caplog.records if r.name == "harness_proxy.abuse" and want in r.getMessage()]


def expect_exhausted(proxy: LiveProxy, execution_id: str, words: str) -> None:
    """Both APIs refuse the execution's next call 403, in their own shapes, naming ``words``."""
    with pytest.raises(openai.PermissionDeniedError) as err:
        openai_client(proxy, execution_id).chat.completions.create(model="m", messages=MSGS)
    body = err.value.response.json()
    assert err.value.status_code == 403
    assert set(body) == {"error"} and body["error"]["code"] == "budget_exhausted", body
    assert body["error"]["type"] == "invalid_request_error" and words in body["error"]["message"], body
    # LiteLLM (mini-swe-agent) would read these words as a rate limit, whatever the status, and retry.
    assert not re.search(r"rate[\s_\-]*limit|\b429\b", str(body), re.I)
    with pytest.raises(anthropic.PermissionDeniedError) as aerr:
        anthropic_client(proxy, execution_id).messages.create(model="m", max_tokens=5, messages=MSGS)
    assert aerr.value.status_code == 403
    abody = aerr.value.body
    assert set(abody) == {"type", "error"} and abody["type"] == "error", abody
    assert set(abody["error"]) == {"type", "message"} and abody["error"]["type"] == "permission_error", abody
    assert words in abody["error"]["message"], abody


def call_ok(proxy: LiveProxy, execution_id: str) -> openai.types.chat.ChatCompletion:
    reply = openai_client(proxy, execution_id).chat.completions.create(model="m", messages=MSGS)
    assert reply.choices[0].message.content == "ok"
    return reply


# ---------------------------------------------------------------- budgets used up: 403


def test_calls_past_max_calls_are_refused_403_before_any_engine_time(make_proxy, caplog):
    caplog.set_level(logging.WARNING, logger="harness_proxy.abuse")
    proxy = make_proxy(max_calls=2)
    call_ok(proxy, "ex-loop")
    anthropic_client(proxy, "ex-loop").messages.create(model="m", max_tokens=5, messages=MSGS)  # both APIs count
    for _ in range(3):
        expect_exhausted(proxy, "ex-loop", "max_calls is 2")
    assert len(proxy.engines[0].requests) == 2  # the refused calls never reached an engine
    assert refused(proxy)["budget_calls"] == 6
    assert len(budget_lines(caplog, "budget_calls", "ex-loop")) == 1  # counted six times, logged once
    # Another execution has its own budget, whole.
    call_ok(proxy, "ex-other")
    call_ok(proxy, "ex-other")
    expect_exhausted(proxy, "ex-other", "max_calls is 2")
    assert refused(proxy)["budget_calls"] == 8


def test_a_403_is_not_retried_by_the_sdks(make_proxy):
    proxy = make_proxy(max_calls=1)
    call_ok(proxy, "ex-1")
    with pytest.raises(openai.PermissionDeniedError):
        openai_client(proxy, "ex-1", max_retries=3).chat.completions.create(model="m", messages=MSGS)
    with pytest.raises(anthropic.PermissionDeniedError):
        anthropic_client(proxy, "ex-1", max_retries=3).messages.create(model="m", max_tokens=5, messages=MSGS)
    assert refused(proxy)["budget_calls"] == 2  # one request each: the harness is told once, and stops


def test_a_call_starting_at_or_past_max_tokens_is_refused(make_proxy, caplog):
    caplog.set_level(logging.WARNING, logger="harness_proxy.abuse")
    limit = 100
    proxy = make_proxy(max_tokens=limit)
    used = 0
    while used < limit:  # each call that starts below the budget is served, whatever it then adds
        reply = call_ok(proxy, "ex-big")
        assert reply.usage is not None
        used += reply.usage.prompt_tokens + reply.usage.completion_tokens
    request = proxy.engines[0].requests[-1]
    assert reply.usage.prompt_tokens == len(request["input_ids"])  # what the budget counts is what the engine saw
    num_served = len(proxy.engines[0].requests)
    assert num_served >= 2
    expect_exhausted(proxy, "ex-big", f"{used} prompt and output tokens, max_tokens is {limit}")
    assert len(proxy.engines[0].requests) == num_served
    assert refused(proxy)["budget_tokens"] == 2
    assert len(budget_lines(caplog, "budget_tokens", "ex-big")) == 1
    call_ok(proxy, "ex-small")


def test_a_call_the_harness_hung_up_on_counts_its_prompt(make_proxy):
    proxy = make_proxy(max_tokens=1)
    engine = proxy.engines[0]
    engine.script.append(Step(hang=True))
    parts = urlsplit(proxy.url)
    body = json.dumps({"messages": MSGS}).encode()
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {mint_token(SECRET, 'ex-gone')}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_until(lambda: proxy.lt.call(engine.hanging.is_set), "the engine to hold the call")
    sock.close()
    wait_until(lambda: engine.aborted, "the engine request to be aborted")
    num_prompt = len(engine.requests[0]["input_ids"])
    expect_exhausted(proxy, "ex-gone", f"{num_prompt} prompt and output tokens")


def test_calls_after_max_wall_s_from_the_first_call_are_refused(make_proxy, caplog):
    caplog.set_level(logging.WARNING, logger="harness_proxy.abuse")
    proxy = make_proxy(max_wall_s=1.0)
    call_ok(proxy, "ex-slow")
    time.sleep(1.1)
    call_ok(proxy, "ex-late")  # its clock starts at its own first call
    expect_exhausted(proxy, "ex-slow", "max_wall_s is 1;")
    assert len(proxy.engines[0].requests) == 2
    assert refused(proxy)["budget_wall"] == 2
    assert len(budget_lines(caplog, "budget_wall", "ex-slow")) == 1


# ---------------------------------------------------------------- too many at once: 429


class Held:
    """``num`` calls of one execution held at a slow engine until ``release``."""

    def __init__(self, proxy: LiveProxy, execution_id: str, num: int):
        self.proxy = proxy
        self.gate = asyncio.Event()
        self.replies: list[str | None] = []
        engine = proxy.engines[0]
        before = len(engine.requests)
        engine.script.extend(Step(until=self.gate) for _ in range(num))
        self.threads = [threading.Thread(target=self._call, args=(execution_id,)) for _ in range(num)]
        for t in self.threads:
            t.start()
        wait_until(lambda: len(engine.requests) - before == num, f"{num} calls at the engine")

    def _call(self, execution_id: str) -> None:
        client = openai_client(self.proxy, execution_id)
        try:
            self.replies.append(client.chat.completions.create(model="m", messages=MSGS).choices[0].message.content)
        except openai.APIError as exc:
            self.replies.append(repr(exc))

    def release(self) -> list[str | None]:
        """The engine answers them all; their replies' texts (or errors)."""
        self.proxy.lt.call(self.gate.set)
        for t in self.threads:
            t.join(30)
        return self.replies


def test_calls_over_max_concurrent_calls_get_a_retriable_429(make_proxy, caplog):
    caplog.set_level(logging.WARNING, logger="harness_proxy.abuse")
    proxy = make_proxy(max_concurrent_calls=2)
    held = Held(proxy, "ex-par", 2)
    for _ in range(2):
        with pytest.raises(openai.RateLimitError) as err:
            openai_client(proxy, "ex-par").chat.completions.create(model="m", messages=MSGS)
        body = err.value.response.json()
        assert err.value.status_code == 429
        assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "requests", body
        assert "max_concurrent_calls is 2" in body["error"]["message"]
        with pytest.raises(anthropic.RateLimitError) as aerr:
            anthropic_client(proxy, "ex-par").messages.create(model="m", max_tokens=5, messages=MSGS)
        assert aerr.value.status_code == 429 and aerr.value.body["error"]["type"] == "rate_limit_error"
        assert "max_concurrent_calls is 2" in aerr.value.body["error"]["message"]
    # The SDKs retry a 429 (here into the same full execution: each retry is refused and counted).
    with pytest.raises(openai.RateLimitError):
        openai_client(proxy, "ex-par", max_retries=1).chat.completions.create(model="m", messages=MSGS)
    assert refused(proxy)["budget_concurrency"] == 4 + 2
    assert len(budget_lines(caplog, "budget_concurrency", "ex-par")) == 1
    call_ok(proxy, "ex-calm")  # served meanwhile: its own calls at once are none
    assert len(proxy.engines[0].requests) == 3
    assert held.release() == ["ok", "ok"]
    call_ok(proxy, "ex-par")  # the calls ended: there is room again
    assert refused(proxy)["budget_concurrency"] == 6


# ---------------------------------------------------------------- 0: no limit; memory


def test_zero_is_no_limit(make_proxy):
    proxy = make_proxy()  # every budget 0
    held = Held(proxy, "ex-free", 9)  # past the default of 8 at once
    call_ok(proxy, "ex-free")
    assert held.release() == ["ok"] * 9, held.replies
    for _ in range(3):
        call_ok(proxy, "ex-free")
    assert all(refused(proxy)[kind] == 0 for kind in BUDGET_KINDS)


def test_an_executions_budget_goes_when_it_is_sealed(make_proxy):
    proxy = make_proxy(max_calls=1)
    call_ok(proxy, "ex-a")
    call_ok(proxy, "ex-b")
    assert get_raw(proxy.url, "/stats")[1]["executions_live"] == 2
    assert proxy.seal("ex-a") == 1
    assert get_raw(proxy.url, "/stats")[1]["executions_live"] == 1
    with pytest.raises(openai.AuthenticationError):  # sealed: the token is refused before the budget
        openai_client(proxy, "ex-a").chat.completions.create(model="m", messages=MSGS)
    assert get_raw(proxy.url, "/stats")[1]["executions_live"] == 1  # and no state is made for it again
    expect_exhausted(proxy, "ex-b", "max_calls is 1")


# ---------------------------------------------------------------- config


def test_the_default_yaml_builds_with_the_documented_defaults():
    data = yaml.safe_load((ROOT / "conf/proxy/default.yaml").read_text())
    cfg = build(ProxyConfig, data, "proxy")
    assert cfg.execution_budget == ExecutionBudgetConfig(
        max_calls=2000, max_tokens=50_000_000, max_wall_s=14400.0, max_concurrent_calls=8)
    assert PROXY_CONFIG["execution_budget"] == data["execution_budget"]  # the tests run the defaults


@pytest.mark.parametrize("key, value", [
    ("max_calls", -1), ("max_tokens", -5), ("max_wall_s", -0.5), ("max_concurrent_calls", -1),
    ("max_wall_s", math.nan), ("max_wall_s", math.inf),
])
def test_bad_budget_values_are_refused(key, value):
    with pytest.raises(ConfigError, match=f"execution_budget.{key}"):
        proxy_config(execution_budget=budget(**{key: value}))
    with pytest.raises(ValueError, match=key):
        ExecutionBudgetConfig(**{**UNLIMITED, key: value}).check()


@pytest.mark.parametrize("bad", [
    {k: v for k, v in UNLIMITED.items() if k != "max_calls"},  # missing: defaults live in conf/
    {**UNLIMITED, "max_call": 3},
    {**UNLIMITED, "max_calls": 2.5},
    {**UNLIMITED, "max_concurrent_calls": True},
])
def test_budget_keys_are_strict(bad):
    with pytest.raises(ConfigError):
        proxy_config(execution_budget=bad)


# ---------------------------------------------------------------- the decision, no HTTP


def cfg(**limits: Any) -> ExecutionBudgetConfig:
    return build(ExecutionBudgetConfig, budget(**limits))


def state(*, calls: int = 0, tokens: int = 0, in_flight: int = 0, first: float = 100.0) -> BudgetState:
    return BudgetState(first_call_at=first, num_calls=calls, num_tokens=tokens, num_in_flight=in_flight)


def test_each_budget_refuses_at_its_value_and_not_before():
    assert budget_refusal(state(calls=4), cfg(max_calls=5), 100.0) is None
    assert budget_refusal(state(calls=5), cfg(max_calls=5), 100.0).kind == "budget_calls"
    assert budget_refusal(state(tokens=999), cfg(max_tokens=1000), 100.0) is None
    assert budget_refusal(state(tokens=1000), cfg(max_tokens=1000), 100.0).kind == "budget_tokens"
    assert budget_refusal(state(), cfg(max_wall_s=10.0), 109.9) is None
    assert budget_refusal(state(), cfg(max_wall_s=10.0), 110.0).kind == "budget_wall"
    assert budget_refusal(state(in_flight=2), cfg(max_concurrent_calls=3), 100.0) is None
    busy = budget_refusal(state(in_flight=3), cfg(max_concurrent_calls=3), 100.0)
    assert busy.kind == "budget_concurrency" and busy.retriable


def test_a_used_up_budget_is_named_before_concurrency():
    why = budget_refusal(state(calls=5, in_flight=3), cfg(max_calls=5, max_concurrent_calls=3), 100.0)
    assert why.kind == "budget_calls" and not why.retriable and "max_calls is 5" in why.message


@given(st.integers(0, 50), st.integers(0, 10**9), st.integers(0, 20), st.floats(0, 1e6),
       st.integers(0, 50), st.integers(0, 10**9), st.integers(0, 20), st.floats(0, 1e6))
def test_a_call_is_refused_exactly_when_some_nonzero_limit_is_reached(
    calls, tokens, in_flight, elapsed, max_calls, max_tokens, max_conc, max_wall,
):
    limits = cfg(max_calls=max_calls, max_tokens=max_tokens, max_concurrent_calls=max_conc, max_wall_s=max_wall)
    why = budget_refusal(state(calls=calls, tokens=tokens, in_flight=in_flight, first=0.0), limits, elapsed)
    over = {
        "budget_calls": max_calls and calls >= max_calls, "budget_tokens": max_tokens and tokens >= max_tokens,
        "budget_wall": max_wall and elapsed >= max_wall, "budget_concurrency": max_conc and in_flight >= max_conc,
    }
    assert (why is None) == (not any(over.values()))
    if why is not None:
        assert over[why.kind] and why.kind in BUDGET_KINDS
        assert why.retriable == (not any(over[k] for k in BUDGET_KINDS[:3]))
