"""The embedded engine's prefix cache: a prompt extending cached tokens prefills only the rest,
with the log-probs a full prefill gives; the cache never outlives the weights it was built with.

Engines and reference forwards come from test_engine's fixtures (the tiny model of conf/).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from cellrunner import engine_batch, prefix_cache
from cellrunner.engine import EmbeddedEngine
from cellrunner.prefix_cache import PrefixCache
from tests.cellrunner.test_engine import (  # noqa: F401 (fixtures)
    TOL, call, generate, make_engine, model_cfg, prompt_of, reference, vocab_size, weights,
)

SAME = 1e-5
"""Cached against uncached: the same weights and tokens, only the prefill's split differs."""


@pytest.fixture
def engines(make_engine):  # noqa: F811
    def make(*, cache_bytes: int = 64 << 20, min_tokens: int = 8, share_prefill: bool = True) -> EmbeddedEngine:
        return make_engine(max_running=8, prefix_cache_bytes=cache_bytes, prefix_cache_min_tokens=min_tokens,
                           share_prefill=share_prefill)

    return make


def logprobs(reply: dict) -> list[float]:
    return [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]


def greedy(engine: EmbeddedEngine, prompt: list[int], n: int = 12) -> dict:
    return generate(engine, prompt, max_new_tokens=n, temperature=0.0)


# ---------------------------------------------------------------- the cache itself


def kv_of(tokens: list[int]) -> prefix_cache.KV:
    """One layer of fake KV whose every value is the token id, so a slice shows its tokens."""
    t = torch.tensor(tokens, dtype=torch.float32)[None, :, None].expand(2, -1, 4)
    return [(t, t + 0.5)]


def test_match_takes_the_longest_common_prefix_of_any_entry() -> None:
    cache = PrefixCache(max_bytes=1 << 20, min_tokens=2)
    cache.insert([1, 2, 3, 4, 5], kv_of([1, 2, 3, 4, 5]))
    cache.insert([1, 2, 9, 9], kv_of([1, 2, 9, 9]))
    n, kv = cache.match([1, 2, 3, 4, 7, 7])
    assert n == 4 and kv[0][0][0, :, 0].tolist() == [1, 2, 3, 4]
    assert cache.match([1, 2, 9, 9, 9])[0] == 4
    assert cache.match([1, 5]) == (0, None)  # one token in common: under min_tokens


def test_a_prefix_of_a_newer_entry_is_dropped_and_eviction_is_least_recent_first() -> None:
    entry_bytes = 2 * 2 * 4 * 4 * 4  # (k, v) x heads x tokens x dim x float32, for 4 tokens
    cache = PrefixCache(max_bytes=3 * entry_bytes, min_tokens=1)
    cache.insert([1, 2], kv_of([1, 2]))
    cache.insert([1, 2, 3, 4], kv_of([1, 2, 3, 4]))  # subsumes [1, 2]
    assert len(cache) == 1 and cache.nbytes == entry_bytes
    cache.insert([1, 2, 3], kv_of([1, 2, 3]))  # held inside [1, 2, 3, 4]: nothing new
    assert len(cache) == 1
    cache.insert([5, 6, 7, 8], kv_of([5, 6, 7, 8]))
    cache.insert([9, 9, 9, 9], kv_of([9, 9, 9, 9]))
    cache.match([1, 2, 3, 4])  # now the most recent
    cache.insert([7, 7, 7, 7], kv_of([7, 7, 7, 7]))  # evicts [5, 6, 7, 8], the least recent
    assert cache.match([5, 6, 7, 8]) == (0, None)
    assert cache.match([1, 2, 3, 4])[0] == 4 and cache.nbytes == 3 * entry_bytes
    cache.insert(list(range(20)), kv_of(list(range(20))))  # bigger than the whole budget: not kept
    assert cache.match(list(range(20))) == (0, None) and len(cache) == 3
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


# ---------------------------------------------------------------- through the engine


def test_second_call_prefills_only_new_tokens_with_the_same_logprobs(engines, reference, monkeypatch) -> None:
    """A session's second call (first prompt + output + a tool result) reuses every token the
    first call ran, and its greedy output and log-probs are those of an engine without a cache."""
    monkeypatch.setattr(engine_batch, "EXTEND_CHUNK_TOKENS", 50)  # several chunks per extension
    cached, plain = engines(), engines(cache_bytes=0)
    first = prompt_of(300)
    r1 = greedy(cached, first)
    assert r1["meta_info"]["cached_tokens"] == 0
    second = first + r1["output_ids"] + prompt_of(140, start=7)
    before = cached.num_prefill_tokens()
    r2 = greedy(cached, second)
    # Every token the first call ran: its prompt and its output but the last, sampled and never run.
    num_run = len(first) + len(r1["output_ids"]) - 1
    assert r2["meta_info"]["cached_tokens"] == num_run
    assert cached.num_prefill_tokens() - before == len(second) - num_run
    want = greedy(plain, second)
    assert want["meta_info"]["cached_tokens"] == 0
    assert r2["output_ids"] == want["output_ids"]
    np.testing.assert_allclose(logprobs(r2), logprobs(want), atol=SAME, rtol=0)
    np.testing.assert_allclose(logprobs(r2), reference(0, second, r2["output_ids"]), atol=TOL, rtol=0)


def test_sampled_outputs_match_with_and_without_a_hit(engines) -> None:
    """Same seed, same sampled tokens and log-probs, whether the prompt's head came from the cache."""
    head = prompt_of(200, start=3)
    prompt = head + prompt_of(60, start=11)
    warm, cold = engines(), engines(cache_bytes=0)
    greedy(warm, head, n=1)  # caches the head; greedy rows leave the sampler's generator alone
    got = generate(warm, prompt, max_new_tokens=16, temperature=1.0)
    want = generate(cold, prompt, max_new_tokens=16, temperature=1.0)
    assert got["meta_info"]["cached_tokens"] == len(head)
    assert got["output_ids"] == want["output_ids"]
    np.testing.assert_allclose(logprobs(got), logprobs(want), atol=SAME, rtol=0)


def test_a_shared_system_prompt_hits_across_sessions(engines, reference) -> None:
    engine = engines()
    system = prompt_of(120, start=5)
    a, b = system + [1, 2, 3] * 10, system + [4, 5, 6] * 10
    greedy(engine, a)
    reply = greedy(engine, b)
    assert reply["meta_info"]["cached_tokens"] == len(system)
    np.testing.assert_allclose(logprobs(reply), reference(0, b, reply["output_ids"]), atol=TOL, rtol=0)
    again = greedy(engine, b)  # the whole prompt is cached: its last token still runs
    assert again["meta_info"]["cached_tokens"] == len(b) - 1
    assert again["output_ids"] == reply["output_ids"]


def test_concurrent_hits_and_misses_keep_their_own_rows(engines, reference) -> None:
    """Newcomers with and without cached prefixes join one batch; each row stays its own."""
    from concurrent.futures import ThreadPoolExecutor

    engine = engines()
    heads = [prompt_of(80 + 30 * i, start=17 * i + 1) for i in range(3)]
    firsts = [greedy(engine, h, n=4) for h in heads]
    prompts = [h + f["output_ids"] + prompt_of(20, start=i) for i, (h, f) in enumerate(zip(heads, firsts))]
    prompts += [prompt_of(50, start=400), prompt_of(90, start=401)]  # misses
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda p: greedy(engine, p, n=10), prompts))
    for i, (p, r) in enumerate(zip(prompts, replies)):
        assert (r["meta_info"]["cached_tokens"] > 0) == (i < 3)
        np.testing.assert_allclose(logprobs(r), reference(0, p, r["output_ids"]), atol=TOL, rtol=0)


def test_new_weights_drain_and_release_empty_the_cache(engines, reference, weights) -> None:
    engine = engines()
    prompt = prompt_of(150, start=9)
    greedy(engine, prompt)
    assert engine.prefix_cache_usage()[0] == 1
    engine.update_weights(weights[1])
    assert engine.prefix_cache_usage() == (0, 0)
    reply = greedy(engine, prompt)
    assert reply["meta_info"]["cached_tokens"] == 0  # the old KV belonged to version 0
    np.testing.assert_allclose(logprobs(reply), reference(1, prompt, reply["output_ids"]), atol=TOL, rtol=0)
    assert greedy(engine, prompt)["meta_info"]["cached_tokens"] == len(prompt) - 1
    engine.drain(5.0)
    assert engine.prefix_cache_usage() == (0, 0)
    engine.release()
    engine.resume(weights[0])
    assert greedy(engine, prompt)["meta_info"]["cached_tokens"] == 0


def test_a_request_that_outlived_a_weight_swap_is_not_cached(engines, weights) -> None:
    """Its KV mixes two versions: caching it would serve old-weight KV under the new weights."""
    import threading

    engine = engines()
    prompt = prompt_of(100, start=13)
    done = {}
    t = threading.Thread(target=lambda: done.update(r=generate(engine, prompt, max_new_tokens=200,
                                                                temperature=0.0, ignore_eos=True)))
    t.start()
    while engine.num_output_tokens() < 5:
        pass
    engine.update_weights(weights[1])
    t.join()
    assert len(done["r"]["meta_info"]["weight_versions"]) == 2
    assert engine.prefix_cache_usage() == (0, 0)
    assert greedy(engine, prompt)["meta_info"]["cached_tokens"] == 0


def test_cache_off_reports_nothing_cached(engines) -> None:
    engine = engines(cache_bytes=0)
    prompt = prompt_of(100)
    greedy(engine, prompt)
    assert greedy(engine, prompt)["meta_info"]["cached_tokens"] == 0
    assert engine.prefix_cache_usage() == (0, 0)
    status, _ = call(engine, "/health")
    assert status == 200


def test_bench_smoke(capsys) -> None:
    """bench.prefix_cache at tiny sizes (random ids, no Claude Code binary), so it cannot rot."""
    import json

    from bench import prefix_cache

    prefix_cache.main(["--synthetic", "300", "--calls", "3", "--max-new-tokens", "4"])
    out = json.loads(capsys.readouterr().out)
    session = out["session"]
    assert session["same_outputs"] and session["max_abs_logprob_diff"] < SAME
    assert session["no_cache_prefill_tokens"] - session["cache_prefill_tokens"] == session["prefill_tokens_saved"] > 0
    assert [c["cached_tokens"] > 0 for c in session["per_call"]] == [False, True, True]



def _one_admission(engine: EmbeddedEngine, prompts: list[list[int]]) -> list[dict]:
    """Greedy replies to `prompts`, all queued before the loop admits any: the loop thread is held
    in a control op until every request is waiting."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    release = threading.Event()
    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        held = pool.submit(engine._batch_loop.call, release.wait)
        futures = [pool.submit(greedy, engine, p, 6) for p in prompts]
        deadline = time.monotonic() + 30
        while engine._batch_loop.num_active() < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.01)
        release.set()
        held.result()
        return [f.result() for f in futures]


def test_a_group_started_at_once_computes_its_shared_prompt_once(engines, reference) -> None:
    """The executions of a group send the same long harness prompt at once: one of them computes
    it, the rest wait one round and extend its KV (before, each ran it whole). Each reply is still
    that prompt's own."""
    engine = engines()
    shared = prompt_of(300, start=21)
    prompts = [shared + prompt_of(8, start=100 + i) for i in range(8)]
    replies = _one_admission(engine, prompts)
    assert engine.num_prefill_tokens() == 308 + 7 * 8  # the first whole, the others past their shared 300
    assert sorted(r["meta_info"]["cached_tokens"] for r in replies) == [0] + [300] * 7
    for p, r in zip(prompts, replies):
        np.testing.assert_allclose(logprobs(r), reference(0, p, r["output_ids"]), atol=TOL, rtol=0)
    unrelated = [prompt_of(60, start=500 + 50 * i) for i in range(3)]  # nothing shared: one round, no wait
    before = engine.num_prefill_tokens()
    assert [r["meta_info"]["cached_tokens"] for r in _one_admission(engine, unrelated)] == [0, 0, 0]
    assert engine.num_prefill_tokens() - before == 180
    unshared = engines(share_prefill=False)  # the engine before: every newcomer computes the prompt
    assert [r["output_ids"] for r in _one_admission(unshared, prompts)] == [r["output_ids"] for r in replies]
    assert unshared.num_prefill_tokens() == 8 * 308


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=12),
       st.lists(st.integers(0, 3), min_size=1, max_size=12), st.integers(1, 6))
def test_the_radix_index_finds_what_a_scan_of_every_entry_finds(sequences, prompt, capacity) -> None:
    """Inserts (with entries dropped as prefixes of newer ones, and evicted past the byte bound)
    leave an index whose longest match equals the longest common prefix over the entries held."""
    from cellrunner.prefix_cache import common_prefix

    entry_bytes = sum(k.nbytes + v.nbytes for k, v in kv_of([0]))  # bytes per token of kv_of
    cache = PrefixCache(max_bytes=capacity * 12 * entry_bytes, min_tokens=1)
    for seq in sequences:
        cache.insert(seq, kv_of(seq))
    ids = np.asarray(prompt, dtype=np.int64)
    want = max((common_prefix(ids, tokens) for tokens, _ in cache.entries()), default=0)
    n, kv = cache.match(prompt)
    assert n == want
    if n:  # the KV returned is that of the prompt's first n tokens
        assert kv[0][0][0, :, 0].tolist() == [float(t) for t in prompt[:n]]
    held = [tuple(t.tolist()) for t, _ in cache.entries()]
    assert not any(a != b and b[: len(a)] == a for a in held for b in held)  # no entry a prefix of another
