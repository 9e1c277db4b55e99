"""The redirect half of bench.kv_reuse: a session's KV follows it to another cell through the shared tier.

A session of `n` ids (a Claude Code first prompt, then tool results from this repository's README,
cut to `n`) runs on engine A: its KV is in A's prefix cache, as after any call. A drains, as a cell
does before it trains, and the session's next call (its context, the token A answered and one
more tool result) goes to engine B. Once without the tier (B computes the whole context) and once
with both engines on one Mooncake Store (`cellrunner.kv_tier`, a `mooncake_master` over TCP): A's
drain writes its cached KV there, and B reads what it misses. Measured on B: the ids it prefilled
over the call's prompt, and its time to the first token over HTTP.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from bench.prefix_cache import generate, tool_results
from cellrunner.config import ModelConfig
from cellrunner.engine import EmbeddedEngine
from cellrunner.kv_tier import KVTier
from cellrunner.mooncake_store import MooncakeMaster

SIZES = {"20k": 20_000, "100k": 100_000}
SEGMENT_BYTES = 1 << 30  # 100k ids of the tiny model are 51 MB of KV; room for both sessions and more


def session_context(first: list[int], tok: Any, n: int) -> list[int]:
    """`first`, then tool-result turns, until `n` ids; cut to exactly `n`."""
    ids = list(first)
    while len(ids) < n:
        ids += [t for turn in tool_results(tok, 16) for t in turn]
    return ids[:n]


def _engine(model_cfg: ModelConfig, vocab_size: int, weights: Any, cell_id: int, tier: KVTier | None) -> EmbeddedEngine:
    engine = EmbeddedEngine(model_cfg=model_cfg, vocab_size=vocab_size, host="127.0.0.1", port=0, cell_id=cell_id,
                            max_running=4, seed=0, prefix_cache_bytes=1 << 30, prefix_cache_min_tokens=64,
                            kv_tier=tier)
    engine.start()
    engine.resume(weights)
    return engine


def redirect_once(model_cfg: ModelConfig, vocab_size: int, weights: Any, context: list[int], tail: list[int],
                  master: MooncakeMaster | None) -> dict[str, Any]:
    tiers = [KVTier(master.master_address) if master else None for _ in range(2)]
    a, b = (_engine(model_cfg, vocab_size, weights, i, tiers[i]) for i in range(2))
    try:
        generate(b, list(range(1, 65)), 1)  # warm-up: a process's first forward pays one-off costs
        first_reply, _ = generate(a, context, 1)
        a.drain(0.0)
        prompt = context + first_reply["output_ids"] + tail
        before = b.num_prefill_tokens()
        t0 = time.perf_counter()
        reply, _ = generate(b, prompt, 1)
        ttft_s = time.perf_counter() - t0
        return {"prompt_ids": len(prompt), "prefilled_ids": b.num_prefill_tokens() - before,
                "tier_ids": b.num_tier_tokens(), "ttft_s": round(ttft_s, 3), "first_output": reply["output_ids"]}
    finally:
        a.stop()
        b.stop()
        for tier in tiers:
            if tier is not None:
                tier.close()


def redirect_figures(model_cfg: ModelConfig, tok: Any, weights: Any, *, first: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    long_cfg = dataclasses.replace(model_cfg, max_position_embeddings=max(model_cfg.max_position_embeddings, 131_072))
    tail = [t for turn in tool_results(tok, 1) for t in turn]
    with MooncakeMaster(segment_bytes=SEGMENT_BYTES) as master:
        for label, n in SIZES.items():
            context = session_context(first, tok, n)
            without = redirect_once(long_cfg, tok.vocab_size, weights, context, tail, None)
            with_tier = redirect_once(long_cfg, tok.vocab_size, weights, context, tail, master)
            if with_tier["first_output"] != without["first_output"]:
                raise SystemExit(f"{label}: the tier's KV gave another first token than computing it")
            out[f"redirect_{label}"] = {"without_tier": without, "with_tier": with_tier}
            out[f"redirect_recomputed_fraction_{label}"] = round(with_tier["prefilled_ids"] / with_tier["prompt_ids"], 4)
            out[f"redirect_recomputed_fraction_{label}_without_tier"] = round(
                without["prefilled_ids"] / without["prompt_ids"], 4)
            out[f"redirect_ttft_speedup_{label}"] = round(without["ttft_s"] / with_tier["ttft_s"], 2)
    return out
