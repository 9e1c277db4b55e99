"""Bounded sampling (K trajectories per execution) vs no cap: trainer time and gradient direction.

    .venv/bin/python -m bench.trajectory_cap [--small] [--executions 4] [--repeats 3] [--k 5]
                                             [--nocap 1000] [--billing-header] [--subagents 2]
                                             [--threads 1]

What is measured: the same Claude-Code-shaped executions (``bench.fixtures``) go through the
real ``trajectory.processor.Processor`` twice, with ``max_trajectories`` K and with a cap so
large that every trajectory is kept; the shards it emits are run through
``EmbeddedTrainer.microstep`` (forward + backward, gradients accumulated; the unrolled batch, as
the trainer does today) from the same seeded weights, one thread, in alternating order
``--repeats`` times after one untimed warm-up each. Behaviour log-probs are replaced by the
model's own (on-policy, ratio 1, nothing clipped: the first microstep of a step), so every
target contributes gradient.

``fb_time_reduction`` = 1 - t_K / t_nocap (medians of the summed microstep time).
``grad_cosine`` = cosine between the two summed gradients (``take_grads``); both carry the
trainer's fair weighting (``token_weight`` = 1 / the execution's targets, so each execution's
loss is its mean) and would be divided by the same execution count, which a cosine ignores.
``flops_reduction`` is the same ratio on the FLOPs estimate of ``bench.tree_packing`` for the
trainer's own chunking, free of timing noise.

The same comparison is repeated with the trainer's forward swapped for tree packing
(``tree_chunks`` + ``packed_token_logprobs(targets_only=True)``, the call proposed for the
trainer): ``fb_time_reduction_tree_packed``, ``flops_reduction_tree_packed``. It matters because
the unrolled trainer's ``split_by_tokens`` pads a short sequence into a chunk with a long one
when they fit, and a padded chunk runs a masked attention over the full square instead of the
causal triangle: which sequences share a chunk changes with K, so K=5 can do *more* attention
work than no cap on fewer tokens. The tree-packed path has no padding.

Why the two goals (r >= 0.25, c >= 0.99) pull apart: the cap saves exactly the compute of the
trajectories it drops, and dropping them changes the gradient by exactly their targets' share.
K=5 keeps by kind (main, then main-summary, then sub-agents by policy tokens), so what goes is
the sub-agent trajectories with the fewest policy tokens: a retried sub-agent call's abandoned
branch (its whole prompt recomputed for a short output) and the smaller of the sub-agents.
With the default fixture (2 general-purpose sub-agents, a fork, 2 retries, 1 compaction) those
are a modest share of tokens, so r is modest and c stays high; executions with more sub-agents
or retries give a bigger r and a lower c. The JSON reports both, with the token and target
counts that explain them.

Left out: the optimizer step, processor time (see ``bench.processor``), processes and the wire.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
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
)
from bench.tree_packing import flops, work
from cellrunner.config import ModelConfig
from cellrunner.gspo import gspo_loss, pack
from cellrunner.model import flatten_grads
from cellrunner.trainer import EmbeddedTrainer
from cellrunner.tree_pack import packed_size, packed_token_logprobs, tree_chunks
from base.wire import CallRecord, ExecutionSealed, Grade, Shard, ShardReady
from base.algo_config import AlgoConfig
from trajectory.processor import Processor


def shards_for(records: list[list[CallRecord]], rewards: list[float], *, max_trajectories: int) -> list[Shard]:
    """One group's shards out of the processor, capped at ``max_trajectories`` per execution."""
    algo = algo_config(max_trajectories_per_execution=max_trajectories)
    proc = Processor(algo=algo, min_usable=1, max_trajectories=max_trajectories)
    out = []
    for recs in records:
        for r in recs:
            out += proc.on_record(r)
        out += proc.on_sealed(ExecutionSealed(execution_id=recs[0].execution_id, num_calls=len(recs)))
    for recs, reward in zip(records, rewards):
        out += proc.on_grade(Grade(
            execution_id=recs[0].execution_id, group_id="g0", step=0, group_size=len(records),
            outcome="finished", reward=reward, train=True,
        ))
    return [m.shard for m in out if isinstance(m, ShardReady)]


def on_policy_shards(model: torch.nn.Module, shards: list[Shard]) -> list[Shard]:
    return [dataclasses.replace(s, sequences=on_policy(model, list(s.sequences))) for s in shards]


def run_step(trainer: EmbeddedTrainer, shards: list[Shard]) -> tuple[float, np.ndarray]:
    t0 = time.perf_counter()
    for shard in shards:
        trainer.microstep(shard)
    elapsed = time.perf_counter() - t0
    return elapsed, trainer.take_grads()


def run_packed(model: torch.nn.Module, shards: list[Shard], algo: AlgoConfig) -> tuple[float, np.ndarray]:
    """The trainer's microstep loop with the tree-packed forward instead of the unrolled one."""
    t0 = time.perf_counter()
    for shard in shards:
        for chunk in tree_chunks(list(shard.sequences), algo.max_tokens_per_microstep):
            batch = pack(chunk)
            logprobs = packed_token_logprobs(model, chunk, targets_only=True)
            loss, _ = gspo_loss(logprobs, batch, eps_low=algo.eps_low, eps_high=algo.eps_high)
            loss.backward()
    elapsed = time.perf_counter() - t0
    grads = flatten_grads(model)
    model.zero_grad(set_to_none=True)
    return elapsed, grads


def estimated_flops(shards: list[Shard], method: str, model_cfg: ModelConfig, max_tokens: int) -> float:
    return sum(flops(work(method, list(s.sequences), max_tokens), model_cfg, VOCAB_SIZE) for s in shards)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def stats(shards: list[Shard]) -> dict[str, int]:
    seqs = [s for sh in shards for s in sh.sequences]
    return {
        "sequences": len(seqs),
        "tokens": sum(len(s.tokens) for s in seqs),
        "targets": sum(sum(s.target_mask) for s in seqs),
        "tokens_tree_packed": packed_size(seqs),
        "shards": len(shards),
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--executions", type=int, default=None, help="default 4 (2 with --small)")
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --small)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--nocap", type=int, default=1000, help="the 'no cap' K")
    ap.add_argument("--billing-header", action="store_true", help="keep system[0] (see bench.fixtures)")
    ap.add_argument("--subagents", type=int, default=2, help="sub-agents per execution (fixture knob)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    num_executions = args.executions or (2 if args.small else 4)
    repeats = args.repeats or (1 if args.small else 3)
    shape = preset(args.small, billing_header=args.billing_header, subagents=args.subagents)

    records = executions(num_executions, shape)
    rewards = [float(i % 2) + 0.25 * i for i in range(num_executions)]  # spread: nonzero advantages
    caps = {"k": args.k, "nocap": args.nocap}
    shards = {name: shards_for(records, rewards, max_trajectories=k) for name, k in caps.items()}
    longest = max(len(s.tokens) for sh in shards["nocap"] for s in sh.sequences)
    model_cfg = bench_model_config(longest)
    algo = algo_config()
    trainer = EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB_SIZE, is_core=False)
    trainer.start(None)
    assert trainer.model is not None
    shards = {name: on_policy_shards(trainer.model, sh) for name, sh in shards.items()}
    counts = {name: stats(sh) for name, sh in shards.items()}
    print(f"{num_executions} executions: {counts}", file=sys.stderr, flush=True)

    model = trainer.model
    runs = {
        "trainer": lambda sh: run_step(trainer, sh),
        "tree_packed": lambda sh: run_packed(model, sh, algo),
    }
    grads = {(how, name): run(sh)[1] for how, run in runs.items() for name, sh in shards.items()}  # + warm-up
    times: dict[str, list[float]] = {f"{how}/{name}": [] for how in runs for name in caps}
    for r in range(repeats):
        for how, run in runs.items():
            for name in (["k", "nocap"] if r % 2 == 0 else ["nocap", "k"]):
                elapsed, _ = run(shards[name])
                times[f"{how}/{name}"].append(elapsed)
                print(f"repeat {r} {how}/{name}: {elapsed:.3f} s", file=sys.stderr, flush=True)

    med = {key: median(v) for key, v in times.items()}
    max_tokens = algo.max_tokens_per_microstep
    est = {
        f"{how}/{name}": estimated_flops(shards[name], method, model_cfg, max_tokens)
        for how, method in (("trainer", "unrolled"), ("tree_packed", "packed")) for name in caps
    }
    result: dict[str, object] = {
        "fb_time_reduction": 1.0 - med["trainer/k"] / med["trainer/nocap"],
        "grad_cosine": cosine(grads["trainer", "k"], grads["trainer", "nocap"]),
        "flops_reduction": 1.0 - est["trainer/k"] / est["trainer/nocap"],
        "fb_time_reduction_tree_packed": 1.0 - med["tree_packed/k"] / med["tree_packed/nocap"],
        "flops_reduction_tree_packed": 1.0 - est["tree_packed/k"] / est["tree_packed/nocap"],
        "grad_cosine_tree_packed": cosine(grads["tree_packed", "k"], grads["tree_packed", "nocap"]),
        "tokens_k5": counts["k"]["tokens"],
        "tokens_nocap": counts["nocap"]["tokens"],
        "token_reduction": 1.0 - counts["k"]["tokens"] / counts["nocap"]["tokens"],
        "target_share_kept": counts["k"]["targets"] / counts["nocap"]["targets"],
        "counts": counts,
        "median_s": med,
        "times_s": times,
        "flops_estimate": est,
        "config": {
            "shape": shape.__dict__, "executions": num_executions, "rewards": rewards, "repeats": repeats,
            "k": args.k, "nocap": args.nocap, "max_tokens_per_microstep": algo.max_tokens_per_microstep,
            "model": dataclasses.asdict(model_cfg), "vocab_size": VOCAB_SIZE,
        },
        **run_info(),
    }
    print(json.dumps(result, sort_keys=True), flush=True)
    return result


if __name__ == "__main__":
    # The processor warns once per sequence over max_tokens_per_microstep; expected here.
    logging.getLogger("trajectory.samples").setLevel(logging.ERROR)
    main()
