"""A prompt past ``proxy.max_context_tokens`` gets each API's own "too long" 400, read through the
official SDKs: Anthropic's ``invalid_request_error`` "prompt is too long: N tokens > M maximum"
(Claude Code answers it by compacting) and OpenAI's ``context_length_exceeded``. The engine never
sees such a prompt; one that fits leaves the engine room to answer inside the context.
"""

from __future__ import annotations

import re
from pathlib import Path

import anthropic
import openai
import pytest
import yaml

from base.execution_token import mint_token
from tests.harness_proxy import SECRET, LiveProxy

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 300


@pytest.fixture
def proxy():
    p = LiveProxy(num_engines=1, max_context_tokens=LIMIT, max_new_tokens_cap=64)
    yield p
    p.close()


def words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


def anthropic_client(proxy: LiveProxy, execution_id: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key=mint_token(SECRET, execution_id), max_retries=0, timeout=30)


def prompt_tokens(proxy: LiveProxy, execution_id: str, content: str) -> int:
    counted = anthropic_client(proxy, execution_id).messages.count_tokens(
        model="m", messages=[{"role": "user", "content": content}])
    return counted.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_prompt_too_long(proxy, stream):
    content = words(400)
    with pytest.raises(anthropic.BadRequestError) as err:
        anthropic_client(proxy, "ex-a").messages.create(
            model="m", max_tokens=5, stream=stream, messages=[{"role": "user", "content": content}])
    assert err.value.status_code == 400
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    found = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", err.value.body["error"]["message"])
    assert found, err.value.body
    assert int(found[1]) == prompt_tokens(proxy, "ex-a", content) > LIMIT and int(found[2]) == LIMIT
    assert proxy.engines[0].requests == []


@pytest.mark.parametrize("stream", [False, True])
def test_openai_context_length_exceeded(proxy, stream):
    content = words(400)
    with pytest.raises(openai.BadRequestError) as err:
        proxy.client("ex-o").chat.completions.create(
            model="m", stream=stream, messages=[{"role": "user", "content": content}])
    assert err.value.status_code == 400 and err.value.code == "context_length_exceeded"
    assert err.value.type == "invalid_request_error" and err.value.param == "messages"
    found = re.fullmatch(
        r"This model's maximum context length is (\d+) tokens\. However, your messages resulted in (\d+) tokens\. "
        r"Please reduce the length of the messages\.", err.value.body["message"])
    assert found, err.value.body
    assert int(found[1]) == LIMIT and int(found[2]) > LIMIT
    assert proxy.engines[0].requests == []


def test_a_prompt_that_fits_leaves_the_answer_inside_the_context(proxy):
    content = words(90)
    num_prompt = prompt_tokens(proxy, "ex-fit", content)
    assert LIMIT - 64 < num_prompt < LIMIT, num_prompt  # the cap, not the harness, bounds the answer
    reply = anthropic_client(proxy, "ex-fit").messages.create(
        model="m", max_tokens=1000, messages=[{"role": "user", "content": content}])
    assert reply.content[0].text == "ok"
    (request,) = proxy.engines[0].requests
    assert len(request["input_ids"]) == num_prompt
    assert request["sampling_params"]["max_new_tokens"] == LIMIT - num_prompt


def test_default_proxy_limit_is_the_model_context():
    """Claude Code's first prompt (~22k ids) and Qwen Code's (~35k) fit the defaults."""
    proxy_cfg = yaml.safe_load((ROOT / "conf/proxy/default.yaml").read_text())
    model_cfg = yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text())
    assert proxy_cfg["max_context_tokens"] == model_cfg["max_position_embeddings"] >= 40_000
