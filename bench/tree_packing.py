"""Tree packing vs the unrolled batch: forward + backward time and FLOPs on the same executions.

    .venv/bin/python -m bench.tree_packing [--small] [--executions 4] [--repeats 3] [--k 5]
                                           [--billing-header] [--threads 1] [--no-mask]

What is measured: one microstep's work on Claude-Code-shaped executions (``bench.fixtures``),
after the processor's path (tree, K=5 bounded sampling, dedup, fair weights), with on-policy
behaviour log-probs: chunking, the model's forward, log-probs, ``gspo_loss`` and backward, on
the tiny model of ``conf/model/tiny.yaml`` (context widened), one thread. Methods, same data and
weights, run in rotating order ``--repeats`` times (medians reported):

- ``unrolled``: what ``EmbeddedTrainer.microstep`` does today: ``split_by_tokens`` chunks of at
  most ``max_tokens_per_microstep`` padded tokens, ``pack``, ``token_logprobs``.
- ``packed``: ``tree_chunks`` + ``packed_token_logprobs(targets_only=True)`` — the call to wire
  into the trainer. The head (LM head + log-softmax over the ~4.1k vocabulary) runs only where
  the next token is a target; ``gspo_loss`` and its gradient are the same (checked below).
- ``packed_full_head``: the tree alone: head at every position, as ``token_logprobs``.
- ``packed_mask``: the dense 4-D mask path (one padded row per execution, the model's own sdpa).

``speedup`` = unrolled / packed; ``speedup_full_head`` and ``speedup_mask`` likewise.
``grad_check`` compares each method's gradient with the unrolled one (cosine, max abs diff).

FLOPs estimate (fwd + bwd = 3 x fwd): per computed token, the layers' projections and MLP
(2 x weights); per head row 2 x hidden x vocab; per attention (query, key) pair the kernel is
given, 4 x heads x head_dim per layer: causal calls without a mask count n(n+1)/2 pairs (the
unrolled chunk of one sequence, a tree run without a shared prefix), masked ones every pair
(a padded chunk; a block of a tree run after its prefix: rows x (prefix + run up to the
block's end); a dense-mask row). Norms, softmax and rotary are left out.

Left out: optimizer step, processor time, process boundaries. Baseline and candidates run in
one process on one thread, each once untimed first (warm-up); a shared machine shows up as
noise in ``times_s``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np
import torch

from bench.fixtures import (
    VOCAB_SIZE,
    algo_config,
    bench_model_config,
    executions,
    median,
    on_policy,
    preset,
    run_info,
    trajectories_to_sequences,
)
from cellrunner.config import ModelConfig
from cellrunner.gspo import gspo_loss, pack, token_logprobs
from cellrunner.model import build_model, flatten_grads
from cellrunner.trainer import split_by_tokens
from cellrunner.tree_pack import packed_token_logprobs, plan, run_blocks, tree_chunks
from base.wire import Sequence
from base.algo_config import AlgoConfig

METHODS: dict[str, dict[str, object] | None] = {
    "unrolled": None,  # the trainer's own path
    "packed": {"targets_only": True},
    "packed_full_head": {},
    "packed_mask": {"attention": "mask"},
}
"""Method name -> ``packed_token_logprobs`` keyword arguments (None: unrolled)."""


def step(method: str, model: torch.nn.Module, sequences: list[Sequence], algo: AlgoConfig) -> None:
    """One microstep's forward + backward over ``sequences``, chunked as the method chunks."""
    packed = METHODS[method]
    max_tokens = algo.max_tokens_per_microstep
    chunks = split_by_tokens(sequences, max_tokens) if packed is None else tree_chunks(sequences, max_tokens)
    for chunk in chunks:
        batch = pack(chunk)
        lp = token_logprobs(model, batch) if packed is None else packed_token_logprobs(model, chunk, **packed)
        loss, _ = gspo_loss(lp, batch, eps_low=algo.eps_low, eps_high=algo.eps_high)
        loss.backward()


# ---------------------------------------------------------------------- FLOPs


def _flops_per(cfg: ModelConfig, vocab: int) -> tuple[float, float, float]:
    """(per token, per head row, per attention pair), forward only."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    per_layer = 2 * (h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size)
    return (
        cfg.num_hidden_layers * per_layer,
        2 * h * vocab,
        cfg.num_hidden_layers * 4 * cfg.num_attention_heads * cfg.head_dim,
    )


def work(method: str, sequences: list[Sequence], max_tokens: int) -> dict[str, int]:
    """Tokens, head rows and attention pairs a method hands to its kernels."""
    tokens = rows = pairs = 0
    if method == "unrolled":
        for chunk in split_by_tokens(sequences, max_tokens):
            lengths = [len(s.tokens) for s in chunk]
            width = max(lengths)
            tokens += width * len(chunk)
            rows += width * len(chunk)
            padded = min(lengths) < width
            pairs += len(chunk) * (width * width if padded else width * (width + 1) // 2)
        return {"tokens": tokens, "head_rows": rows, "attention_pairs": pairs}
    for chunk in tree_chunks(sequences, max_tokens):
        tree = plan(chunk)
        if method == "packed_mask":
            width = int(np.diff(tree.row_starts).max())
            tokens += width * tree.num_rows
            rows += width * tree.num_rows
            pairs += tree.num_rows * width * width
            continue
        tokens += tree.num_tokens
        rows += len(np.unique(tree.src[tree.target if method == "packed" else tree.src >= 0]))
        for run in tree.runs:
            n, a = run.end - run.start, len(run.prefix)
            if a == 0:
                pairs += n * (n + 1) // 2
            else:
                pairs += sum((hi - lo) * (a + hi) for lo, hi in run_blocks(a, n))
    return {"tokens": tokens, "head_rows": rows, "attention_pairs": pairs}


def flops(counts: dict[str, int], cfg: ModelConfig, vocab: int) -> float:
    per_token, per_row, per_pair = _flops_per(cfg, vocab)
    return 3.0 * (counts["tokens"] * per_token + counts["head_rows"] * per_row + counts["attention_pairs"] * per_pair)


# ---------------------------------------------------------------------- main


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--executions", type=int, default=None, help="default 4 (2 with --small)")
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --small)")
    ap.add_argument("--k", type=int, default=5, help="max trajectories per execution")
    ap.add_argument("--billing-header", action="store_true", help="keep system[0] (see bench.fixtures)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-mask", action="store_true", help="skip the dense-mask method")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    num_executions = args.executions or (2 if args.small else 4)
    repeats = args.repeats or (1 if args.small else 3)
    shape = preset(args.small, billing_header=args.billing_header)

    records = executions(num_executions, shape)
    sequences = trajectories_to_sequences(records, max_trajectories=args.k)
    model_cfg = bench_model_config(max(len(s.tokens) for s in sequences))
    model = build_model(model_cfg, VOCAB_SIZE)
    sequences = on_policy(model, sequences)
    algo = algo_config()
    max_tokens = algo.max_tokens_per_microstep
    methods = [m for m in METHODS if not (args.no_mask and m == "packed_mask")]
    print(f"{len(sequences)} sequences from {num_executions} executions; methods {methods}", file=sys.stderr, flush=True)

    times: dict[str, list[float]] = {m: [] for m in methods}
    grads: dict[str, np.ndarray] = {}
    for m in methods:  # warm-up (allocator, kernels), and the gradient each method computes
        model.zero_grad(set_to_none=True)
        step(m, model, sequences, algo)
        grads[m] = flatten_grads(model)
    for r in range(repeats):
        for m in methods[r % len(methods):] + methods[: r % len(methods)]:
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            step(m, model, sequences, algo)
            times[m].append(time.perf_counter() - t0)
            print(f"repeat {r} {m}: {times[m][-1]:.3f} s", file=sys.stderr, flush=True)

    med = {m: median(t) for m, t in times.items()}
    counts = {m: work(m, sequences, max_tokens) for m in methods}
    est = {m: flops(c, model_cfg, VOCAB_SIZE) for m, c in counts.items()}
    base = grads["unrolled"]
    result: dict[str, object] = {
        "speedup": med["unrolled"] / med["packed"],
        "speedup_full_head": med["unrolled"] / med["packed_full_head"],
        "flops_ratio": est["unrolled"] / est["packed"],
        "flops_ratio_full_head": est["unrolled"] / est["packed_full_head"],
        "tokens_unrolled": sum(len(s.tokens) for s in sequences),
        "tokens_packed": sum(plan(c).num_tokens for c in tree_chunks(sequences, max_tokens)),
        "num_targets": sum(sum(s.target_mask) for s in sequences),
        "median_s": med,
        "times_s": times,
        "work": counts,
        "flops_estimate": est,
        "grad_check": {
            m: {"cosine": cosine(g, base), "max_abs_diff": float(np.abs(g - base).max()),
                "max_abs_grad": float(np.abs(base).max())}
            for m, g in grads.items() if m != "unrolled"
        },
        "config": {
            "shape": shape.__dict__, "executions": num_executions, "repeats": repeats, "k": args.k,
            "max_tokens_per_microstep": max_tokens, "model": dataclasses.asdict(model_cfg), "vocab_size": VOCAB_SIZE,
        },
        **run_info(),
    }
    if "packed_mask" in med:
        result["speedup_mask"] = med["unrolled"] / med["packed_mask"]
        result["flops_ratio_mask"] = est["unrolled"] / est["packed_mask"]
    print(json.dumps(result, sort_keys=True), flush=True)
    return result


if __name__ == "__main__":
    main()
