"""Synthetic Claude Code executions for the benchmarks: lists of CallRecords shaped like real runs.

Shape and proportions follow ``/work/shared/notes/harness-claude-code.md`` (2.1.332, ``-p``):

- **Main calls** start with a fixed prefix of about 12.3k tokens (§7): identity line, main
  system prompt (7,058 chars), 12 tools (31,245 chars), then ``msg0`` (580-char attribution
  reminder + the task) and ``msg1``, a ``role:system`` listing (9,709 chars). Each call appends
  the previous output and its tool result (append-only, §8).
- **Two sub-agents** (``subagents``; general-purpose, §5) spawned by one main turn, with their own prompt
  (3,096 chars), tools (20,583 chars) and listing (7,573 chars); the same system and tools for
  both, their own Agent prompt. Their reports come back to main as tool results.
- **A fork sub-agent** (§5): the parent's history up to its last assistant turn, that turn copied
  without its text block (tool_use only), then a "Fork started" tool result + fork directive.
- **Retried calls**: one main call and one sub-agent call were answered twice with the same
  prompt (a stream the harness rejected and re-sent non-streaming, §3); the first output was
  never seen by the harness, the second continues the run. Both are CallRecords.
- **Compaction** (§5, §6): at the end of the pre-compaction phase a summary call appends the
  6,361-char instruction to the last user message (``main-summary``); then a new root: the same
  system and tools, a "session continued" message with the summary, a date message, the last
  assistant turn and its tool result verbatim, the listing re-sent; then more main turns.
- **A title side call** is not made (``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1``).

Sizes are in real tokens (chars / 4) divided by ``ShapeConfig.divisor``. Policy outputs (thinking
+ tool_use) and tool results are log-normal around medians of 200 and 600 real tokens (tool
results capped where the harness persists big output, §8). Template wrapper tokens
(``<|im_start|>user`` ...) are a few ids each and are not scaled.

One assumption the notes leave open: system block [0] (``x-anthropic-billing-header``, with a
hash of the first user message and ``cc_is_subagent`` on sub-agents) is billing metadata, and we
assume the proxy drops it when rendering, so the main prompt after compaction and the fork share
the system prompt and tools with the first main calls. ``billing_header=True`` keeps it as the
first ids of the system turn: then every root differs after a few ids and little is shared.

Everything is deterministic in ``(seed, execution index)``. The executions of one call to
``executions`` are a group on one task: same fixed prefix and task text, different runs.
The bottom of the module has what the benchmarks share besides the data: the widened tiny
model, the processor's path from records to training sequences, on-policy behaviour
log-probs, and what every benchmark's JSON carries about the run (host, versions).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
from dataclasses import dataclass

from pathlib import Path

import numpy as np
import torch
import yaml

from cellrunner.config import ModelConfig
from cellrunner.gspo import pack, token_logprobs
from base.typed_config import build
from base.wire import CallRecord, Lineage, Sequence
from base.tokenizer import QWEN3_SPECIALS
from base.advantages import group_advantages
from base.algo_config import AlgoConfig
from trajectory.samples import build_sequences
from trajectory.sampling import select
from trajectory.tree import TokenTree

CONF = Path(__file__).resolve().parent.parent / "conf"

COMPACT_RANKS = 4096
VOCAB_SIZE = COMPACT_RANKS + len(QWEN3_SPECIALS)
"""The compact Qwen vocabulary of conf/model/tiny.yaml: text ids below 4096, specials above."""

IM_START, IM_END, TOOL_OPEN, TOOL_CLOSE = (COMPACT_RANKS + i for i in range(4))
ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT = 100, 101, 102  # "system\n" / "user\n" / "assistant\n"

# Real sizes in tokens (notes §7, chars / 4).
IDENTITY = 16
MAIN_SYSTEM = 1_765
MAIN_TOOLS = 7_811
ATTRIBUTION = 145
TASK = 150
MAIN_LISTING = 2_427
SUB_SYSTEM = 774
SUB_TOOLS = 5_146
SUB_LISTING = 1_893
AGENT_PROMPT = 200
BILLING = 19
COMPACT_ASK = 1_590
SUMMARY = 2_000
CONTINUED = 300
DATE = 20
FORK_DIRECTIVE = 300
OUTPUT_MEDIAN = 200
TOOL_MEDIAN = 600
TOOL_CAP = 2_500
REPORT = 400


@dataclass(frozen=True, kw_only=True)
class ShapeConfig:
    divisor: int
    """Real token counts are divided by this (12.3k-token prefix / 25 = 492)."""
    main_turns_before: int
    """Main calls before compaction. With `CLAUDE_CODE_AUTO_COMPACT_WINDOW=100000` (the minimum, §6)
    it fires near 67k tokens of context: about 42 turns at these sizes (the summary call sees 62-68k)."""
    main_turns_after: int
    subagent_turns: int
    fork_turns: int
    subagents: int = 2
    """General-purpose sub-agents spawned together by one main turn (the first one's 2nd call is retried)."""
    billing_header: bool = False
    seed: int = 0


REALISTIC = ShapeConfig(divisor=25, main_turns_before=42, main_turns_after=20, subagent_turns=12, fork_turns=4)
SMALL = ShapeConfig(divisor=200, main_turns_before=8, main_turns_after=3, subagent_turns=3, fork_turns=2)


def preset(small: bool, *, billing_header: bool = False, subagents: int = 2) -> ShapeConfig:
    return dataclasses.replace(SMALL if small else REALISTIC, billing_header=billing_header, subagents=subagents)


class _Text:
    """Deterministic token ids for text; a named block is the same wherever it is used."""

    def __init__(self, cfg: ShapeConfig, stream: int) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng([cfg.seed, stream])

    def size(self, real_tokens: float) -> int:
        return max(1, round(real_tokens / self.cfg.divisor))

    def block(self, name: str, real_tokens: int) -> list[int]:
        rng = np.random.default_rng([self.cfg.seed, 1_000_003, *name.encode()])
        return rng.integers(0, COMPACT_RANKS, self.size(real_tokens)).tolist()

    def fresh(self, real_tokens: float) -> list[int]:
        return self.rng.integers(0, COMPACT_RANKS, self.size(real_tokens)).tolist()

    def lognormal(self, median: int, sigma: float, cap: int) -> list[int]:
        return self.fresh(min(cap, median * float(np.exp(sigma * self.rng.standard_normal()))))


def _turn(role: int, body: list[int]) -> list[int]:
    return [IM_START, role, *body, IM_END]


GEN = [IM_START, ROLE_ASSISTANT]


class _Recorder:
    def __init__(self, execution_id: str, text: _Text) -> None:
        self.execution_id = execution_id
        self.text = text
        self.records: list[CallRecord] = []

    def call(self, prompt: list[int], output: list[int], *, lineage: Lineage = "main", agent_id: str = "") -> list[int]:
        """Record one call; returns prompt + output (what the next prompt extends)."""
        i = len(self.records)
        lps = (-self.text.rng.exponential(0.7, len(output))).tolist()
        self.records.append(CallRecord(
            execution_id=self.execution_id, call_id=f"{self.execution_id}/c{i}", call_index=i,
            prompt_ids=list(prompt), output_ids=list(output), output_logprobs=lps,
            weight_version=0, cell_id=0, finish_reason="stop", lineage=lineage, agent_id=agent_id,
            started_at=float(i), finished_at=float(i) + 0.5,
        ))
        return list(prompt) + list(output)


def _system(t: _Text, *, sub: bool, first_user: str, fork: bool = False) -> list[int]:
    """The system turn; the billing block (when kept) names the agent kind and hashes ``first_user``."""
    kind = "sub" if sub or fork else "main"
    billing = t.block(f"billing/{kind}/{first_user}", BILLING) if t.cfg.billing_header else []
    body = billing + t.block("identity", IDENTITY)
    if sub:
        return _turn(ROLE_SYSTEM, body + t.block("sub/system", SUB_SYSTEM) + t.block("sub/tools", SUB_TOOLS))
    return _turn(ROLE_SYSTEM, body + t.block("main/system", MAIN_SYSTEM) + t.block("main/tools", MAIN_TOOLS))


def _output(t: _Text) -> list[int]:
    return t.lognormal(OUTPUT_MEDIAN, 0.6, 4 * OUTPUT_MEDIAN) + [IM_END]


def _tool_result(t: _Text, body: list[int] | None = None) -> list[int]:
    if body is None:
        body = t.lognormal(TOOL_MEDIAN, 1.0, TOOL_CAP)
    return _turn(ROLE_USER, [TOOL_OPEN, *body, TOOL_CLOSE])


def _subagent(rec: _Recorder, name: str, prompt_text: list[int], *, retry_at: int | None) -> list[int]:
    """A general-purpose sub-agent's calls; returns its final report (context for the parent)."""
    t = rec.text
    ctx = _system(t, sub=True, first_user=name)
    ctx += _turn(ROLE_USER, t.block("attribution", ATTRIBUTION) + prompt_text)
    ctx += _turn(ROLE_SYSTEM, t.block("sub/listing", SUB_LISTING))
    for turn in range(t.cfg.subagent_turns):
        prompt = ctx + GEN
        if turn == retry_at:
            rec.call(prompt, _output(t), lineage="sub-agent", agent_id=name)
        last = turn == t.cfg.subagent_turns - 1
        output = (t.fresh(REPORT) + [IM_END]) if last else _output(t)
        ctx = rec.call(prompt, output, lineage="sub-agent", agent_id=name)
        if not last:
            ctx += _tool_result(t)
    return output[:-1]


def execution(index: int, cfg: ShapeConfig) -> list[CallRecord]:
    """One Claude Code execution's CallRecords, in arrival order (see the module docstring)."""
    t = _Text(cfg, stream=index)
    rec = _Recorder(f"cc{cfg.seed}-{index}", t)
    task = t.block("task", TASK)
    header = _turn(ROLE_USER, t.block("attribution", ATTRIBUTION) + task)
    listing = _turn(ROLE_SYSTEM, t.block("main/listing", MAIN_LISTING))
    system = _system(t, sub=False, first_user="task")
    ctx = system + header + listing
    n = cfg.main_turns_before
    spawn_at, fork_at, retry_at = n // 4, n // 2, (3 * n) // 4
    turn_start = len(ctx)
    for turn in range(n):
        turn_start = len(ctx)
        prompt = ctx + GEN
        if turn == retry_at:
            rec.call(prompt, _output(t))  # the answer the harness never saw
        if turn == fork_at:
            text, tool_use = t.lognormal(OUTPUT_MEDIAN // 2, 0.5, OUTPUT_MEDIAN), t.fresh(40)
            ctx = rec.call(prompt, text + tool_use + [IM_END])
            fork = _system(t, sub=False, first_user="task", fork=True) + prompt[len(system):]
            fork += tool_use + [IM_END]  # the parent's turn without its text block
            fork += _tool_result(t, t.block("fork/started", 15))
            fork += _turn(ROLE_USER, t.block("fork/directive", FORK_DIRECTIVE))
            report = _fork(rec, fork)
            ctx += _tool_result(t, report)
            continue
        ctx = rec.call(prompt, _output(t))
        if turn == spawn_at:
            reports = [
                _subagent(rec, f"a{k}", t.fresh(AGENT_PROMPT), retry_at=1 if k == 0 else None)
                for k in range(cfg.subagents)
            ]
            ctx += _turn(ROLE_USER, [tok for r in reports for tok in (TOOL_OPEN, *r, TOOL_CLOSE)])
        else:
            ctx += _tool_result(t)
    last_turn = ctx[turn_start:]  # the last assistant turn and its tool result, kept verbatim
    summary = t.fresh(SUMMARY)
    ask = ctx[:-1] + t.block("compact/ask", COMPACT_ASK) + [IM_END] + GEN  # appended to the last user message
    rec.call(ask, summary + [IM_END], lineage="main-summary")
    ctx = _system(t, sub=False, first_user="continued")
    ctx += _turn(ROLE_USER, t.block("continued", CONTINUED) + summary[len(summary) // 3 :])
    ctx += _turn(ROLE_SYSTEM, t.block("date", DATE))
    ctx += last_turn + listing
    for _ in range(cfg.main_turns_after):
        ctx = rec.call(ctx + GEN, _output(t)) + _tool_result(t)
    return rec.records


def _fork(rec: _Recorder, ctx: list[int]) -> list[int]:
    t = rec.text
    for turn in range(t.cfg.fork_turns):
        last = turn == t.cfg.fork_turns - 1
        output = (t.fresh(REPORT) + [IM_END]) if last else _output(t)
        ctx = rec.call(ctx + GEN, output, lineage="sub-agent", agent_id="fork")
        if not last:
            ctx += _tool_result(t)
    return output[:-1]


def executions(num: int, cfg: ShapeConfig) -> list[list[CallRecord]]:
    return [execution(i, cfg) for i in range(num)]


# ---------------------------------------------------------------------- model and on-policy data


def bench_model_config(max_len: int) -> ModelConfig:
    """conf/model/tiny.yaml with ``max_position_embeddings`` widened to ``max_len`` (rounded up)."""
    data = yaml.safe_load((CONF / "model" / "tiny.yaml").read_text())
    data["max_position_embeddings"] = max(data["max_position_embeddings"], 1024 * -(-max_len // 1024))
    return build(ModelConfig, data)


def algo_config(**overrides: object) -> AlgoConfig:
    return build(AlgoConfig, {**yaml.safe_load((CONF / "algo" / "gspo.yaml").read_text()), **overrides})


def trajectories_to_sequences(
    records: list[list[CallRecord]], *, max_trajectories: int, rewards: list[float] | None = None
) -> list[Sequence]:
    """Each execution through the processor's path (tree, bounded sampling, dedup, fair weights),
    with group-normalised advantages of ``rewards`` (default: evenly spread)."""
    if rewards is None:
        rewards = [i / max(1, len(records) - 1) for i in range(len(records))]
    advantages = group_advantages(rewards, adv_eps=1e-6)
    out: list[Sequence] = []
    for recs, advantage in zip(records, advantages):
        tree = TokenTree(recs[0].execution_id)
        for r in recs:
            tree.insert(r)
        kept = select(tree.trajectories(), max_trajectories=max_trajectories)
        out += build_sequences(tree.execution_id, kept, advantage=advantage)
    return out


def on_policy(model: torch.nn.Module, sequences: list[Sequence]) -> list[Sequence]:
    """The same sequences with behaviour log-probs from ``model`` (one no-grad pass each), so the
    GSPO ratio is 1: the first microstep of a step, nothing clipped, every target has gradient.
    Identical token prefixes get identical values, as the tree's first-call-wins rule gives."""
    out = []
    with torch.no_grad():
        for s in sequences:
            lp = token_logprobs(model, pack([s]))[0].tolist()
            blp = [0.0] + [x if m else 0.0 for x, m in zip(lp, s.target_mask[1:])]
            out.append(dataclasses.replace(s, behaviour_logprobs=blp))
    return out


def median(values: list[float]) -> float:
    return float(np.median(values))


# ---------------------------------------------------------------------- run info for the JSON


def run_info() -> dict[str, object]:
    """Host and versions, for every benchmark's JSON line."""
    import transformers

    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "host": {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "system": f"{platform.system()} {platform.release()}",
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_1m_at_end": round(load[0], 2),
        },
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "numpy": np.__version__,
        },
    }
