"""Engines on one shared KV tier (a real Mooncake Store on loopback): a drained cell's sessions
continue on another cell from the KV it wrote, with the same answers as computing it, and never on
KV of other weights."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from cellrunner.engine import EmbeddedEngine
from cellrunner.kv_tier import KVTier
from cellrunner.mooncake_store import MooncakeMaster
from tests.cellrunner.test_engine import (  # noqa: F401 (fixtures)
    generate, make_engine, model_cfg, prompt_of, reference, vocab_size, weights,
)
from tests.cellrunner.test_kv_tier import _require_store

TOL = 2e-4


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    _require_store()
    with MooncakeMaster(segment_bytes=64 << 20) as m:
        yield m


@pytest.fixture
def engines(make_engine, master):  # noqa: F811
    made: list[tuple[EmbeddedEngine, KVTier]] = []

    def make(namespace: str) -> EmbeddedEngine:
        """An engine on the tier; the engines of one run share a namespace (the model's name)."""
        tier = KVTier(master.master_address, namespace=namespace, page_tokens=64, local_buffer_bytes=8 << 20)
        engine = make_engine(max_running=4, prefix_cache_bytes=64 << 20, prefix_cache_min_tokens=8, kv_tier=tier)
        made.append((engine, tier))
        return engine

    yield make
    for engine, tier in made:  # this teardown runs before make_engine's: stop each engine before its tier
        engine.stop()
        tier.close()


def test_a_drained_cells_session_continues_elsewhere_from_its_kv(engines, reference):  # noqa: F811
    a, b = engines("redirect"), engines("redirect")
    context = prompt_of(700, start=3)
    first = generate(a, context, max_new_tokens=5, temperature=0.0)
    a.drain(0.0)  # writes the prefix cache (the session's context and output) to the tier
    prompt = context + first["output_ids"] + prompt_of(40, start=9)
    reply = generate(b, prompt, max_new_tokens=8, temperature=0.0)
    held = (len(context) + len(first["output_ids"]) - 1) // 64 * 64  # whole pages of what A ran
    assert b.num_tier_tokens() == held and reply["meta_info"]["cached_tokens"] == held
    assert b.num_prefill_tokens() == len(prompt) - held
    np.testing.assert_allclose([lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]],
                               reference(0, prompt, reply["output_ids"]), atol=TOL, rtol=0)


def test_kv_of_other_weights_is_never_read(engines, weights):  # noqa: F811
    a, b = engines("versions"), engines("versions")
    context = prompt_of(300, start=5)
    generate(a, context, max_new_tokens=2, temperature=0.0)
    a.drain(0.0)
    b.update_weights(weights[1])
    reply = generate(b, context + prompt_of(20, start=1), max_new_tokens=2, temperature=0.0)
    assert b.num_tier_tokens() == 0 and reply["meta_info"]["cached_tokens"] == 0
