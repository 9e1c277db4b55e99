"""``proxy.truncation_ends_turn``: a turn cut by the run's own output cap reads as an ended turn to the
harness (Claude Code would otherwise spend calls asking the model to go on); the record keeps ``length``."""

from __future__ import annotations

import anthropic
import openai
import pytest

from base import wire
from base.execution_token import mint_token
from tests.harness_proxy import SECRET, TOK, LiveProxy, Step

CAP = 4


@pytest.fixture(scope="module")
def proxy():
    p = LiveProxy(num_engines=1, max_new_tokens_cap=CAP, truncation_ends_turn=True)
    yield p
    p.close()


def words(n: int) -> list[int]:
    return TOK.encode(" ".join(["return"] * n))


def finishes(proxy: LiveProxy) -> list[str]:
    return [m.finish_reason for m in proxy.recv_all(20) if isinstance(m, wire.CallRecord)]


def test_anthropic_cut_by_the_run_cap_is_end_turn_cut_by_max_tokens_is_max_tokens(proxy):
    c = anthropic.Anthropic(base_url=proxy.url, api_key=mint_token(SECRET, "ex-cap-a"), max_retries=0, timeout=30)
    proxy.engines[0].script.append(Step(words(10)))
    r = c.messages.create(model="m", max_tokens=32000, messages=[{"role": "user", "content": "x"}])
    assert r.stop_reason == "end_turn" and r.usage.output_tokens == CAP
    proxy.engines[0].script.append(Step(words(10)))
    r = c.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "y"}])
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 2  # the harness's own limit: said as such
    assert finishes(proxy) == ["length", "length"]


def test_openai_cut_by_the_run_cap_is_stop(proxy):
    c = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=mint_token(SECRET, "ex-cap-o"), max_retries=0, timeout=30)
    proxy.engines[0].script.append(Step(words(10)))
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == CAP
    assert finishes(proxy) == ["length"]
