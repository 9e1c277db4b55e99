"""Tree packing: compute each shared prefix of an execution's training sequences once.

The sequences of one execution are root-to-leaf chains of its trajectory tree, so they share
prefixes (a retried call, a fork sub-agent, the system prompt and tools after compaction). The
unrolled batch (``gspo.pack`` + ``gspo.token_logprobs``) runs the model over every chain in full;
here the chains' union prefix trie is run instead:

- **Packed order.** An execution's chains are sorted by their token ids; the trie's nodes are
  laid out in that order, which is depth-first preorder: chain k's *run* (its positions past
  the longest prefix it shares with chain k-1, the most it shares with any earlier chain) follows
  every earlier run, and a node always comes after its ancestors. Executions are laid out back to
  back; shared prefixes are found only within an execution.
- **Positions** are depths in the tree (the chain position), so rotary embeddings see what the
  unrolled chain sees.
- **Attention** is tree-shaped: packed token i attends to j iff j is an ancestor of i or i itself.
  Two ways to run it, same numbers:

  ``"segments"`` (default): one flat row for all executions. An attention function registered
  with transformers (``AttentionInterface``) attends each chain's run to its shared prefix plus
  the run itself (causal): a run without a prefix is one causal call, a run after a prefix is
  split into blocks of ``BLOCK_ROWS`` queries, each a masked call over the prefix and the run up
  to the block's end. It computes the pairs the tree mask allows plus half a block per query
  row of such runs, never a sibling's. The runs reach it through the ``attention_mask`` mapping
  transformers passes to every layer untouched.

  ``"mask"``: one row per execution, right-padded, with the dense 4-D mask ``[R, 1, L, L]`` the
  model's own attention takes (a bool mask for ``sdpa``, an additive float mask for ``eager``;
  transformers 5 returns a 4-D mask as is). Simple, but dense: every pair of a row is computed,
  siblings included, so it can cost *more* attention than the unrolled batch; it is the check
  that the segment path computes the tree mask.

``packed_token_logprobs(model, sequences)`` returns what ``token_logprobs(model, pack(sequences))``
returns — ``[B, L-1]``, entry ``(b, t)`` = log pi(token t+1 of chain b | its tokens 0..t), read
at the packed index of chain b's token t — differentiable, so ``gspo_loss`` runs unchanged on
the unrolled ``pack(sequences)``. Entries past a chain's end are 0 (the unrolled batch has the
log-prob of a pad token there; ``target_mask`` is 0 at both). With ``targets_only=True`` the LM
head runs only where some chain's next token is a target and other entries are 0: the loss and
its gradient are the same. ``tree_chunks`` splits a shard into microstep chunks that keep each
execution whole, which sharing needs.

The segment path switches ``model.config._attn_implementation`` for the length of the forward
and back (the backward needs no switch), so one model must not run two forwards at once from
two threads; the embedded trainer runs one.

What this leaves to others: which sequences are trained (``trajectory``), whether the trainer
packs (``bench/tree_packing.py`` measures it). Megatron would do the same with its own
attention kernels; nothing here is needed there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from base.wire import Sequence

Attention = Literal["segments", "mask"]

ATTN_IMPLEMENTATION = "gyre_tree"
"""The name the segment attention is registered under; it runs plain ``sdpa`` for other masks."""


@dataclass(frozen=True)
class Run:
    """Packed positions ``[start, end)`` whose keys are ``prefix`` (packed indices) plus the run."""

    start: int
    end: int
    prefix: np.ndarray  # int64, ancestors of the run's first token, root first


@dataclass(frozen=True)
class TreePlan:
    """Where every chain position lives in the packed layout; numpy only, no model needed.

    ``src[b, t]`` is the packed index of chain b's token t (the logits there predict its token
    t+1), -1 past the chain's end; ``next_tokens[b, t]`` is chain b's token t+1 (0 past the end)
    and ``target[b, t]`` its ``target_mask``.
    ``row_starts[r]:row_starts[r+1]`` is execution r's trie.
    """

    tokens: np.ndarray       # [N] int64, all executions' tries back to back
    depth: np.ndarray        # [N] int64, position id = depth in the tree
    runs: tuple[Run, ...]    # in packed order, covering [0, N)
    row_starts: np.ndarray   # [R + 1] int64
    src: np.ndarray          # [B, Lmax - 1] int64
    next_tokens: np.ndarray  # [B, Lmax - 1] int64
    target: np.ndarray       # [B, Lmax - 1] bool, chain b's token t+1 is a target

    @property
    def num_tokens(self) -> int:
        """Packed positions (each shared prefix once)."""
        return len(self.tokens)

    @property
    def num_rows(self) -> int:
        return len(self.row_starts) - 1


def by_execution(sequences: list[Sequence]) -> dict[str, list[int]]:
    """Sequence indices per execution id, executions in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(sequences):
        groups.setdefault(s.execution_id, []).append(i)
    return groups


def plan(sequences: list[Sequence]) -> TreePlan:
    """The packed layout of ``sequences`` (any order; several executions allowed)."""
    if not sequences:
        raise ValueError("sequences: want at least one")
    chains = [np.asarray(s.tokens, dtype=np.int64) for s in sequences]
    width = max(len(c) for c in chains) - 1
    src = np.full((len(chains), width), -1, dtype=np.int64)
    next_tokens = np.zeros((len(chains), width), dtype=np.int64)
    target = np.zeros((len(chains), width), dtype=bool)
    tokens: list[np.ndarray] = []
    depth: list[np.ndarray] = []
    runs: list[Run] = []
    row_starts = [0]
    size = 0
    for members in by_execution(sequences).values():
        order = sorted(members, key=lambda i: sequences[i].tokens)  # lexicographic = DFS preorder
        prev_nodes = np.empty(0, np.int64)
        prev_chain = np.empty(0, np.int64)
        for i in order:
            chain = chains[i]
            shared = _common_prefix(prev_chain, chain)
            n_new = len(chain) - shared
            nodes = np.concatenate([prev_nodes[:shared], np.arange(size, size + n_new, dtype=np.int64)])
            if n_new:
                runs.append(Run(start=size, end=size + n_new, prefix=prev_nodes[:shared].copy()))
                tokens.append(chain[shared:])
                depth.append(np.arange(shared, len(chain), dtype=np.int64))
                size += n_new
            src[i, : len(chain) - 1] = nodes[:-1]
            next_tokens[i, : len(chain) - 1] = chain[1:]
            target[i, : len(chain) - 1] = np.asarray(sequences[i].target_mask[1:], dtype=bool)
            prev_nodes, prev_chain = nodes, chain
        row_starts.append(size)
    return TreePlan(
        tokens=np.concatenate(tokens),
        depth=np.concatenate(depth),
        runs=tuple(runs),
        row_starts=np.asarray(row_starts, dtype=np.int64),
        src=src,
        next_tokens=next_tokens,
        target=target,
    )


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    size = min(len(a), len(b))
    differ = np.flatnonzero(a[:size] != b[:size])
    return int(differ[0]) if len(differ) else size


def ancestor_mask(tree: TreePlan, start: int, end: int) -> torch.Tensor:
    """Dense bool ``[end - start, end - start]`` mask of packed positions ``[start, end)`` (one
    execution): entry (i, j) is True iff j is an ancestor of i or i itself."""
    n = end - start
    mask = torch.zeros(n, n, dtype=torch.bool)
    for run in tree.runs:
        if run.start < start or run.end > end:
            continue
        a, b = run.start - start, run.end - start
        if len(run.prefix):
            mask[a:b, torch.from_numpy(run.prefix - start)] = True
        mask[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    return mask


# ---------------------------------------------------------------------- the model call


def packed_token_logprobs(
    model: torch.nn.Module,
    sequences: list[Sequence],
    *,
    attention: Attention = "segments",
    targets_only: bool = False,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``token_logprobs(model, pack(sequences), temperature)`` computed over the prefix trie; ``[B, L-1]``.

    ``targets_only`` runs the LM head and log-softmax only at positions whose next token is a
    target (``target_mask`` 1) in some chain and leaves every other entry 0: ``gspo_loss`` and its
    gradient are unchanged (it multiplies those entries by ``target_mask``), and the head over
    the ~4k-row vocabulary is most of the per-token work of a small model.
    """
    tree = plan(sequences)
    if attention == "segments":
        hidden = _segments_hidden(model, tree)                      # [N, H]
        src = tree.src
    elif attention == "mask":
        hidden, src = _mask_hidden(model, tree)                     # [R * width, H]
    else:
        raise ValueError(f"attention: want 'segments' or 'mask', got {attention!r}")
    wanted = tree.target if targets_only else src >= 0
    rows, where = np.unique(src[wanted], return_inverse=True)       # positions the head runs on
    logits = model.get_output_embeddings()(hidden[torch.from_numpy(rows)]).float() / temperature
    picked = logits[torch.from_numpy(where), torch.from_numpy(tree.next_tokens[wanted])]
    picked = picked - torch.logsumexp(logits, dim=-1)[torch.from_numpy(where)]
    out = torch.zeros(src.shape, dtype=picked.dtype)
    return out.index_put((torch.from_numpy(wanted),), picked)


BLOCK_ROWS = 256
"""Query rows per attention call inside a run that has a shared prefix (see ``run_blocks``)."""


@dataclass(frozen=True)
class _RunAttention:
    """One run's attention: a causal call when it has no prefix (``keys`` None), else blocks of
    query rows ``[lo, hi)`` (run-relative), each against the first ``a + hi`` of ``keys``."""

    start: int
    end: int
    keys: torch.Tensor | None                                 # prefix + run, packed indices
    blocks: tuple[tuple[int, int, torch.Tensor], ...] = ()    # (lo, hi, bool mask [hi - lo, a + hi])


@dataclass(frozen=True)
class TreeAttention:
    """What the registered attention function receives as its ``attention_mask``."""

    runs: tuple[_RunAttention, ...]


def run_blocks(num_prefix: int, num_run: int, block_rows: int = BLOCK_ROWS) -> list[tuple[int, int]]:
    """Query blocks of a run after a shared prefix. A masked attention call computes every pair
    it is given, so one call over the whole run would pay the full ``num_run**2`` square for its
    causal triangle; blocks of ``block_rows`` leave ``num_run * block_rows / 2`` of waste."""
    del num_prefix  # the prefix is attended in full by every block: no waste to cut there
    return [(lo, min(lo + block_rows, num_run)) for lo in range(0, num_run, block_rows)]


def _segments_hidden(model: torch.nn.Module, tree: TreePlan) -> torch.Tensor:
    runs = []
    for run in tree.runs:
        n, a = run.end - run.start, len(run.prefix)
        if not a:
            runs.append(_RunAttention(run.start, run.end, None))
            continue
        keys = torch.from_numpy(np.concatenate([run.prefix, np.arange(run.start, run.end)]))
        blocks = []
        for lo, hi in run_blocks(a, n):
            mask = torch.ones(hi - lo, a + hi, dtype=torch.bool)
            mask[:, a + lo :] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
            blocks.append((lo, hi, mask))
        runs.append(_RunAttention(run.start, run.end, keys, tuple(blocks)))
    attn = TreeAttention(tuple(runs))
    layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    with _attention_implementation(model, ATTN_IMPLEMENTATION):
        out = model.get_decoder()(
            input_ids=torch.from_numpy(tree.tokens)[None],
            position_ids=torch.from_numpy(tree.depth)[None],
            attention_mask={kind: attn for kind in layer_types},
            use_cache=False,
        )
    return out.last_hidden_state[0]


def _mask_hidden(model: torch.nn.Module, tree: TreePlan) -> tuple[torch.Tensor, np.ndarray]:
    """One row per execution, right-padded; a pad position attends to itself only. Returns the
    flattened hidden states and ``src`` re-indexed into them."""
    starts = tree.row_starts.tolist()
    sizes = [b - a for a, b in zip(starts, starts[1:])]
    num_rows, width = len(sizes), max(sizes)
    ids = torch.zeros(num_rows, width, dtype=torch.long)
    pos = torch.zeros(num_rows, width, dtype=torch.long)
    allowed = torch.eye(width, dtype=torch.bool).repeat(num_rows, 1, 1)
    flat_index = np.empty(tree.num_tokens, dtype=np.int64)  # packed index -> row * width + column
    for r, (a, b) in enumerate(zip(starts, starts[1:])):
        ids[r, : b - a] = torch.from_numpy(tree.tokens[a:b])
        pos[r, : b - a] = torch.from_numpy(tree.depth[a:b])
        allowed[r, : b - a, : b - a] = ancestor_mask(tree, a, b)
        flat_index[a:b] = r * width + np.arange(b - a)
    if model.config._attn_implementation == "eager":
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    else:
        mask = allowed
    hidden = model.get_decoder()(
        input_ids=ids, position_ids=pos, attention_mask=mask[:, None], use_cache=False
    ).last_hidden_state
    src = np.where(tree.src >= 0, flat_index[tree.src.clip(min=0)], -1)
    return hidden.reshape(num_rows * width, -1), src


@contextlib.contextmanager
def _attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Switch the model's attention function for one forward (the backward needs no switch)."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def _tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: object,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention over the runs of a ``TreeAttention``; anything else goes to transformers' sdpa."""
    if not isinstance(attention_mask, TreeAttention):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for run in attention_mask.runs:
        if run.keys is None:
            q, k, v = (x[:, :, run.start : run.end] for x in (query, key, value))
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa))
            continue
        k, v = key.index_select(2, run.keys), value.index_select(2, run.keys)
        a = len(run.keys) - (run.end - run.start)
        for lo, hi, mask in run.blocks:
            q = query[:, :, run.start + lo : run.start + hi]
            outs.append(F.scaled_dot_product_attention(
                q, k[:, :, : a + hi], v[:, :, : a + hi], attn_mask=mask, scale=scaling, enable_gqa=gqa
            ))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, _tree_attention)


# ---------------------------------------------------------------------- microstep chunks


def tree_chunks(sequences: list[Sequence], max_tokens: int) -> list[list[Sequence]]:
    """Chunks of whole executions whose packed tokens stay within ``max_tokens`` (one execution
    at least, however big). Executions keep their order of first appearance."""
    chunks: list[list[Sequence]] = []
    current: list[Sequence] = []
    current_tokens = 0
    for members in by_execution(sequences).values():
        execution = [sequences[i] for i in members]
        size = packed_size(execution)
        if current and current_tokens + size > max_tokens:
            chunks.append(current)
            current, current_tokens = [], 0
        current.extend(execution)
        current_tokens += size
    if current:
        chunks.append(current)
    return chunks


def packed_size(sequences: list[Sequence]) -> int:
    """Positions of the prefix tries of ``sequences`` (per execution), without building them."""
    total = 0
    for members in by_execution(sequences).values():
        chains = sorted(sequences[i].tokens for i in members)
        prev: list[int] = []
        for chain in chains:
            a, b = np.asarray(prev, dtype=np.int64), np.asarray(chain, dtype=np.int64)
            total += len(chain) - _common_prefix(a, b)
            prev = chain
    return total
