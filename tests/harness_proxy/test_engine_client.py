"""The proxy's engine client against real embedded engines: a call a draining cell cuts mid-decode
goes on on another cell, and the joined answer is exactly what one engine would have produced."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from base import wire
from base.typed_config import build
from harness_proxy.config import ProxyConfig
from harness_proxy.engine_client import EngineClient
from harness_proxy.routing import Router
from tests.cellrunner.test_engine import (  # noqa: F401 (fixtures)
    TOL, make_engine, model_cfg, prompt_of, reference, vocab_size, weights,
)
from tests.harness_proxy import PROXY_CONFIG


@dataclass
class Call:
    prompt_ids: list[int]
    sampling_params: dict[str, Any]
    execution_id: str = "ex-cut"
    agent: str = "main"
    call_id: str = "call-1"


def test_a_call_cut_by_a_drain_continues_on_another_engine_exactly(make_engine, reference, weights):  # noqa: F811
    a, b = make_engine(), make_engine()
    b.update_weights(weights[1])  # the next cell already serves the next version
    router = Router()
    router.update(wire.RoutingTable(version=1, engines=[
        wire.EngineRoute(cell_id=0, url=a.url, weight_version=0), wire.EngineRoute(cell_id=1, url=b.url, weight_version=1)]))
    cfg = build(ProxyConfig, {**PROXY_CONFIG, "engine_timeout_s": 60.0})
    client = EngineClient(cfg, router, min_version=lambda _: 0)
    prompt = prompt_of(120, start=7)
    call = Call(prompt, {"max_new_tokens": 300, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True})

    async def generate():
        client.start()
        try:
            return await client.generate(call)
        finally:
            await client.close()

    def drain_a_once_it_decodes() -> None:
        while a.num_output_tokens() < 20:
            pass
        a.drain(0.0)

    drainer = threading.Thread(target=drain_a_once_it_decodes)
    drainer.start()
    result = asyncio.run(generate())
    drainer.join()
    spans = [(s.version, s.start, s.end) for s in result.spans()]
    assert len(result.output_ids) == 300 and result.finish == "length"
    assert spans[0][0] == 0 and spans[-1] == (1, spans[-1][1], 300) and 20 <= spans[-1][1] < 300
    cut = spans[-1][1]
    assert result.route.cell_id == 1 and result.weight_version == 0
    # each token's log-prob is its own version's, over the prompt and the tokens before it
    out = result.output_ids
    want = reference(0, prompt, out[:cut]) + reference(1, prompt + out[:cut], out[cut:])
    np.testing.assert_allclose(result.output_logprobs, want, atol=TOL, rtol=0)
    record = wire.CallRecord(execution_id="ex-cut", call_id="call-1", call_index=0, prompt_ids=prompt, output_ids=out,
                             output_logprobs=result.output_logprobs, weight_version=result.weight_version, cell_id=1,
                             finish_reason="length", started_at=0.0, finished_at=1.0, weight_versions=result.spans())
    assert wire.decode(wire.encode(record)) == record  # what the processor receives, checked
