"""Learnability probe: the full system's training signal in one process, to choose hyperparameters.

    .venv/bin/python -m bench.learnability [--steps 60 --lr 3e-3 --group-size 8 ...]
    .venv/bin/python -m bench.learnability --vocab-bench

What it reproduces: the tiny model from ``conf/model``, tasks from ``workloads.tasksets.wordmap``, prompts
rendered with ``harness_proxy.template`` exactly as the bundled harness + proxy produce them
(system + user; later turns splice the policy's own output ids, then ``wrote N bytes to NAME``),
temperature sampling with a KV-cached loop recording behaviour log-probs, rewards from
``workloads.graders.wordmap.similarity`` on what the harness would have left in the file,
group-normalised advantages, ``base.wire.Sequence`` objects (one trajectory per execution,
``token_weight`` = 1 / its policy tokens, targets = every generated id incl. ``<|im_end|>``), and
``cellrunner.gspo`` (pack, token_logprobs, gspo_loss), summed and divided by the step's
executions, grad clip, one AdamW step per GSPO step. Every few steps it decodes the held-out eval
tasks greedily and scores them, as the controller's eval does.

What it leaves out: HTTP, processes, cells, the trajectory processor (one execution is one
straight trajectory here, so its tree is a single chain), and wall time the real system spends
on those. ``--staleness 1`` samples with the weights of the previous step, as a serving cell one
version behind would; the GSPO clip then decides which sequences still give gradient.

Output: progress lines, then one JSON line (steps, wall_s, eval_reward_start, eval_reward_end,
config, the eval curve and timings). ``--vocab-bench`` instead times fwd+bwd+AdamW on the same
batch with the full Qwen vocabulary and the compact ones and prints the ratios. Threads default to
1, as each cell gets one thread in the embedded system.

Measured on 2 cores, 1 thread (2026-11-30); what chose the defaults in ``conf/``:

- Over 4,000 rows of vocabulary, ~2,000 samples (60 steps of 4 x 8) do not find a target word:
  the compact vocabulary of 1,024 ranks (1,050 rows) does (4,096: mean gain 0.28 vs 0.54).
- The greedy policy of a random tied-embedding model echoes its last input token, ``\n`` after
  ``assistant``: the reply is empty, the start reward 0.0. Untied embeddings start at ~0.2.
- Reward shape: prefix agreement + difflib ratio beats either alone (pure ratio rewards letters
  anywhere and collapses onto junk such as "target target"; pure prefix is too sparse to start).
- Targets "return <word>": the shared word is found by step ~30, the policy then stops after it
  (eval ~0.56); the topic word is not found before the policy's entropy collapses (still absent
  after 300 steps). Every gain inside 60 steps is the shared word and a clean ending.
- Defaults (1 layer, h128, lr 5e-3, 3 new tokens, 1 turn), 9 runs (3 init x 3 sampling seeds):
  gain at 60 steps mean 0.54, min 0.46, each >= 0.39 by step 30 (the default seeds: 0.27 at
  step 30, 0.48 from step 35).
  150 steps, 6 runs: lr 5e-3 mean 0.58 (min 0.51); lr 1e-2 mean 0.45 with one run at 0.0 (its
  greedy reply collapsed to empty). With ``--staleness 1`` (150 steps, 6 runs) lr 1e-2 does
  better (0.60, min 0.56; the clip damps it) than 5e-3 (0.58, min 0.46): 5e-3 is the default
  that never failed in either regime (colocate is on-policy, elastic/async one version behind).
- Other choices at 60 steps (mean gain, 6-9 runs): 2 layers 0.53 (min 0.39); 2 layers h192 0.51;
  2 turns 0.45 (min 0.27); 2 new tokens 0.49; lr 3e-3 0.49; staleness 1 0.50 (min 0.40: the
  clip zeroes 45-75% of the sequences one AdamW step later).
- One step here: 0.06 s sampling + 0.18 s fwd+bwd+AdamW for 32 executions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from cellrunner.config import ModelConfig
from cellrunner.gspo import gspo_loss, pack, token_logprobs
from cellrunner.model import build_model
from base.typed_config import build
from base.wire import Sequence
from harness_proxy.template import generation_prompt, render_messages, render_turn, split_output
from base.tokenizer import QwenTokenizer, get_tokenizer
from base.algo_config import AlgoConfig
from workloads.config import WorkloadConfig
from workloads.graders.wordmap import similarity
from workloads.harness import SYSTEM_PROMPT, wrote_message
from workloads.tasksets.wordmap import TOPICS, Task, Topic, make_tasks

CONF = Path(__file__).resolve().parent.parent / "conf"


def load_configs() -> tuple[WorkloadConfig, ModelConfig, AlgoConfig]:
    def read(path: str) -> dict:
        return yaml.safe_load((CONF / path).read_text())

    return (
        build(WorkloadConfig, read("workload/wordmap.yaml")),
        build(ModelConfig, read("model/tiny.yaml")),
        build(AlgoConfig, read("algo/gspo.yaml")),
    )


# ---------------------------------------------------------------- sampling


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    greedy: bool,
    stop_id: int,
    gen: torch.Generator,
) -> list[tuple[list[int], list[float]]]:
    """Left-padded, KV-cached decoding: per prompt (output ids, their log-probs), ending at ``stop_id``
    (included) or after ``max_new_tokens``."""
    model.eval()
    b, length = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, length, dtype=torch.long)
    attn = torch.zeros(b, length, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, length - len(p):] = torch.tensor(p)
        attn[i, length - len(p):] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
    cache, logits = out.cache, out.logits[:, -1]
    outs: list[list[int]] = [[] for _ in prompts]
    lps: list[list[float]] = [[] for _ in prompts]
    done = torch.zeros(b, dtype=torch.bool)
    for t in range(max_new_tokens):
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        tok = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
        tok_lp = logp.gather(1, tok[:, None]).squeeze(-1)
        for i in range(b):
            if not done[i]:
                outs[i].append(int(tok[i]))
                lps[i].append(float(tok_lp[i]))
        done |= tok == stop_id
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        attn = torch.cat([attn, torch.ones(b, 1, dtype=torch.long)], dim=1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos, cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1]
    return list(zip(outs, lps))


@dataclass
class Execution:
    """One simulated harness run: its single trajectory and what it left in the file."""

    task: Task
    tokens: list[int]
    target_mask: list[int]
    logprobs: list[float]
    context: list[int]
    """The next call's prompt ids (as the proxy would build them)."""
    file_text: str | None = None
    active: bool = True


def first_prompt(tok: QwenTokenizer, task: Task) -> list[int]:
    return render_messages(tok, [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.prompt}])


def run_executions(
    model: torch.nn.Module, tok: QwenTokenizer, tasks: list[Task], *, max_turns: int,
    max_new_tokens: int, temperature: float, greedy: bool, gen: torch.Generator,
) -> list[Execution]:
    """What the bundled harness does, through the template the proxy uses, for each task."""
    execs = []
    for task in tasks:
        p = first_prompt(tok, task)
        execs.append(Execution(task=task, tokens=list(p), target_mask=[0] * len(p), logprobs=[0.0] * len(p), context=p))
    for turn in range(max_turns):
        live = [e for e in execs if e.active]
        if not live:
            break
        results = sample(model, [e.context for e in live], max_new_tokens=max_new_tokens, temperature=temperature,
                         greedy=greedy, stop_id=tok.im_end, gen=gen)
        for e, (out, lp) in zip(live, results):
            e.tokens += out
            e.target_mask += [1] * len(out)
            e.logprobs += lp
            reply, ended = split_output(tok, out)
            text = reply.strip()
            if not text:
                e.active = False
                continue
            e.file_text = text
            if turn == max_turns - 1:
                e.active = False
                continue
            # The proxy splices the engine's ids for the echoed turn; a cut-off turn still closes.
            ctx = ([] if ended else [tok.im_end]) + tok.encode("\n")
            ctx += render_turn(tok, "user", wrote_message(len(text.encode("utf-8")), e.task.file_name))
            ctx += generation_prompt(tok)
            e.tokens += ctx
            e.target_mask += [0] * len(ctx)
            e.logprobs += [0.0] * len(ctx)
            e.context = e.tokens[:]
    return execs


def reward(e: Execution) -> float:
    return 0.0 if e.file_text is None else similarity(e.file_text, e.task.target)


# ---------------------------------------------------------------- training


def to_sequences(execs: list[Execution], rewards: list[float], group_size: int, adv_eps: float, step: int) -> list[Sequence]:
    seqs = []
    for g in range(0, len(execs), group_size):
        r = np.asarray(rewards[g:g + group_size], dtype=np.float64)
        adv = (r - r.mean()) / (r.std() + adv_eps)
        for k, e in enumerate(execs[g:g + group_size]):
            n_policy = sum(e.target_mask)
            seq = Sequence(
                execution_id=f"s{step}-g{g // group_size}-e{k}",
                tokens=e.tokens, target_mask=e.target_mask, behaviour_logprobs=e.logprobs,
                advantage=float(adv[k]), token_weight=1.0 / n_policy,
            )
            seq.check()
            seqs.append(seq)
    return seqs


def train_step(model, optimizer, seqs: list[Sequence], algo: AlgoConfig) -> dict:
    model.train()
    batch = pack(seqs)
    logprobs = token_logprobs(model, batch)
    loss, stats = gspo_loss(logprobs, batch, eps_low=algo.eps_low, eps_high=algo.eps_high)
    (loss / len(seqs)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), algo.grad_clip if algo.grad_clip > 0 else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": float(norm), "mean_ratio": stats.mean_ratio, "clip_fraction": stats.clip_fraction,
            "num_tokens": int(batch.attention_mask.sum()), "num_targets": stats.num_targets}


def evaluate(model, tok, tasks: list[Task], wl: WorkloadConfig, gen) -> tuple[float, list[str]]:
    execs = run_executions(model, tok, tasks, max_turns=wl.max_turns, max_new_tokens=wl.max_new_tokens,
                           temperature=1.0, greedy=True, gen=gen)
    return float(np.mean([reward(e) for e in execs])), [e.file_text or "" for e in execs]


def parse_topics(spec: str) -> tuple[Topic, ...]:
    pairs = [item.split("=", 1) for item in spec.split(";") if item.strip()]
    return tuple(Topic(name.strip(), target.strip()) for name, target in pairs)


def learn(args: argparse.Namespace, wl: WorkloadConfig, mc: ModelConfig, algo: AlgoConfig) -> dict:
    tok = get_tokenizer(mc.tokenizer, mc.compact_ranks)
    model = build_model(mc, tok.vocab_size)
    behaviour = build_model(mc, tok.vocab_size) if args.staleness else model
    b1, b2 = algo.betas
    optimizer = torch.optim.AdamW(model.parameters(), lr=algo.lr, betas=(b1, b2), weight_decay=algo.weight_decay)
    topics = parse_topics(args.topics) if args.topics else TOPICS
    topics = topics[: args.num_topics] if args.num_topics else topics
    train, held_out = make_tasks(wl, topics=topics)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"params {num_params:,}  vocab {tok.vocab_size}  train {len(train)}  eval {len(held_out)}  "
          f"topics {[t.target for t in topics]}", flush=True)

    t_start = time.perf_counter()
    curve, history = [], []
    sample_s = train_s = 0.0
    lag: list[dict] = []
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            ev, texts = evaluate(model, tok, held_out, wl, gen)
            curve.append({"step": step, "eval_reward": round(ev, 4), "wall_s": round(time.perf_counter() - t_start, 1)})
            print(f"step {step:3d}  eval {ev:.3f}  wall {time.perf_counter() - t_start:6.1f}s  greedy {[t[:24] for t in texts[:4]]}", flush=True)
        if step == args.steps:
            break
        t0 = time.perf_counter()
        tasks = [t for t in rng.sample(train, wl.groups_per_step) for _ in range(wl.group_size)]
        execs = run_executions(behaviour, tok, tasks, max_turns=wl.max_turns, max_new_tokens=wl.max_new_tokens,
                               temperature=algo.rollout.temperature, greedy=False, gen=gen)
        rewards = [reward(e) for e in execs]
        t1 = time.perf_counter()
        seqs = to_sequences(execs, rewards, wl.group_size, algo.adv_eps, step)
        if args.staleness:  # the serving weights trail the trainer by `staleness` versions
            lag.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        stats = train_step(model, optimizer, seqs, algo)
        if args.staleness:
            if len(lag) >= args.staleness:
                behaviour.load_state_dict(lag.pop(0))
        t2 = time.perf_counter()
        sample_s += t1 - t0
        train_s += t2 - t1
        history.append({"reward": float(np.mean(rewards)), "exact": float(np.mean([r >= 1.0 for r in rewards])),
                        "out_tokens": float(np.mean([sum(e.target_mask) for e in execs])), **stats})
        if step % args.eval_every == args.eval_every - 1:
            h = history[-args.eval_every:]
            print(f"  steps {step - len(h) + 1}-{step}: sampled reward {np.mean([x['reward'] for x in h]):.3f}  "
                  f"exact {np.mean([x['exact'] for x in h]):.2f}  policy tokens/exec {np.mean([x['out_tokens'] for x in h]):.1f}  "
                  f"ratio {np.mean([x['mean_ratio'] for x in h]):.5f}  clipped {np.mean([x['clip_fraction'] for x in h]):.2f}  "
                  f"sample {sample_s / (step + 1):.2f}s/step  train {train_s / (step + 1):.2f}s/step", flush=True)
    wall = time.perf_counter() - t_start
    return {
        "steps": args.steps,
        "wall_s": round(wall, 1),
        "eval_reward_start": curve[0]["eval_reward"],
        "eval_reward_end": curve[-1]["eval_reward"],
        "gain": round(curve[-1]["eval_reward"] - curve[0]["eval_reward"], 4),
        "curve": curve,
        "sampled_reward_first5": round(float(np.mean([x["reward"] for x in history[:5]])), 4),
        "sampled_reward_last5": round(float(np.mean([x["reward"] for x in history[-5:]])), 4),
        "sample_s_per_step": round(sample_s / max(args.steps, 1), 3),
        "train_s_per_step": round(train_s / max(args.steps, 1), 3),
        "num_params": num_params,
        "config": {
            "workload": dataclasses.asdict(wl), "model": dataclasses.asdict(mc), "algo": dataclasses.asdict(algo),
            "topics": {t.name: t.target for t in topics}, "staleness": args.staleness, "seed": args.seed,
            "threads": torch.get_num_threads(),
        },
    }


# ---------------------------------------------------------------- vocabulary timing


def vocab_batch(tok: QwenTokenizer, tasks: list[Task], group_size: int, adv_eps: float) -> list[Sequence]:
    """One step's sequences, the same text in any vocabulary: each prompt + its target + <|im_end|>."""
    seqs = []
    for i, task in enumerate(tasks):
        prompt, out = first_prompt(tok, task), [*tok.encode(task.target), tok.im_end]
        seqs.append(Sequence(
            execution_id=f"v{i}", tokens=prompt + out, target_mask=[0] * len(prompt) + [1] * len(out),
            behaviour_logprobs=[0.0] * len(prompt) + [-1.0] * len(out),
            advantage=float((i % group_size) - (group_size - 1) / 2), token_weight=1.0 / len(out),
        ))
    return seqs


def vocab_bench(args: argparse.Namespace, wl: WorkloadConfig, mc: ModelConfig, algo: AlgoConfig) -> dict:
    """fwd+bwd+AdamW on one step's batch (groups_per_step x group_size executions) per vocabulary.

    The batch is the same text in every vocabulary (prompts rendered by each tokenizer, the target
    as the completion), so tokens/s compares like with like; the model is ``mc`` with only the
    vocabulary (embedding and LM head rows) changed.
    """
    train, _ = make_tasks(wl)
    tasks = [t for t in train[: wl.groups_per_step] for _ in range(wl.group_size)]
    vocabs = [("qwen_full", get_tokenizer("qwen"))]
    for ranks in sorted({4096, mc.compact_ranks}, reverse=True):
        vocabs.append((f"qwen_compact_{ranks}", get_tokenizer("qwen_compact", ranks)))
    result: dict[str, dict] = {}
    for name, tok in vocabs:
        model = build_model(mc, tok.vocab_size)
        seqs = vocab_batch(tok, tasks, wl.group_size, algo.adv_eps)
        b1, b2 = algo.betas
        optimizer = torch.optim.AdamW(model.parameters(), lr=algo.lr, betas=(b1, b2))
        train_step(model, optimizer, seqs, algo)  # warm-up: allocator, optimizer state
        times = []
        for _ in range(args.vocab_reps):
            t0 = time.perf_counter()
            stats = train_step(model, optimizer, seqs, algo)
            times.append(time.perf_counter() - t0)
        step_s = float(np.median(times))
        result[name] = {
            "vocab_size": tok.vocab_size, "num_params": sum(p.numel() for p in model.parameters()),
            "num_sequences": len(seqs), "num_tokens": stats["num_tokens"], "step_s": round(step_s, 4),
            "tokens_per_s": round(stats["num_tokens"] / step_s, 1),
        }
        print(f"{name}: {result[name]}", flush=True)
        del model, optimizer
    full = result["qwen_full"]["step_s"]
    return {
        "bench": "vocab_fwd_bwd_adamw", "config": {"model": dataclasses.asdict(mc), "reps": args.vocab_reps,
                                                   "batch": f"{wl.groups_per_step}x{wl.group_size}"},
        "vocabs": result,
        "speedup_vs_full": {k: round(full / v["step_s"], 2) for k, v in result.items() if k != "qwen_full"},
    }


# ---------------------------------------------------------------- entrypoint


def run_info() -> dict[str, object]:
    """Host and versions, as every benchmark's JSON line carries them."""
    import transformers

    return {
        "host": {
            "machine": platform.machine(), "processor": platform.processor(),
            "system": f"{platform.system()} {platform.release()}", "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else 0.0,
        },
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "numpy": np.__version__},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0, help="task draws and sampling")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--staleness", type=int, default=0, help="sample with weights this many steps old")
    p.add_argument("--num-topics", type=int, default=0, help="first N of workloads.tasksets.wordmap.TOPICS (0: all)")
    p.add_argument("--topics", help="try other topics: 'name=target phrase;name=target phrase;...'")
    # Overrides of conf/ values, so a sweep needs no YAML edits.
    p.add_argument("--lr", type=float)
    p.add_argument("--betas", type=float, nargs=2)
    p.add_argument("--eps", type=float, nargs=2, metavar=("LOW", "HIGH"), help="GSPO ratio clip")
    p.add_argument("--group-size", type=int)
    p.add_argument("--groups-per-step", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--max-turns", type=int)
    p.add_argument("--hidden", type=int, help="hidden_size; intermediate = 4x, head_dim = hidden / heads")
    p.add_argument("--layers", type=int)
    p.add_argument("--compact-ranks", type=int)
    p.add_argument("--tie", type=int, choices=(0, 1), help="tie_word_embeddings")
    p.add_argument("--init-seed", type=int)
    p.add_argument("--task-seed", type=int)
    p.add_argument("--vocab-bench", action="store_true")
    p.add_argument("--vocab-reps", type=int, default=5)
    return p.parse_args(argv)


def apply_overrides(args, wl: WorkloadConfig, mc: ModelConfig, algo: AlgoConfig):
    def pick(**kv):
        return {k: v for k, v in kv.items() if v is not None}

    wl = dataclasses.replace(wl, **pick(group_size=args.group_size, groups_per_step=args.groups_per_step,
                                        max_new_tokens=args.max_new_tokens, max_turns=args.max_turns,
                                        task_seed=args.task_seed))
    # The probe never drops a group (no grader fails here); keep the config valid for small groups.
    wl = dataclasses.replace(wl, min_usable_per_group=min(wl.min_usable_per_group, wl.group_size))
    m = pick(compact_ranks=args.compact_ranks, init_seed=args.init_seed, num_hidden_layers=args.layers,
             tie_word_embeddings=None if args.tie is None else bool(args.tie))
    if args.hidden is not None:
        m.update(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                 head_dim=args.hidden // mc.num_attention_heads)
    mc = dataclasses.replace(mc, **m)
    algo = dataclasses.replace(algo, **pick(lr=args.lr, betas=tuple(args.betas) if args.betas else None,
                                            eps_low=args.eps[0] if args.eps else None,
                                            eps_high=args.eps[1] if args.eps else None))
    wl.check()
    mc.check()
    algo.check()
    return wl, mc, algo


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.small:
        args.steps, args.eval_every, args.vocab_reps = 2, 1, 1
        args.group_size, args.groups_per_step = args.group_size or 2, args.groups_per_step or 1
    torch.set_num_threads(args.threads)
    wl, mc, algo = apply_overrides(args, *load_configs())
    out = vocab_bench(args, wl, mc, algo) if args.vocab_bench else learn(args, wl, mc, algo)
    out.update(run_info())
    print(json.dumps(out, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
