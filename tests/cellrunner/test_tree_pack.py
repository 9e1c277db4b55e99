"""Tree packing computes what the unrolled batch computes: log-probs, GSPO loss and gradients."""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import yaml

from bench.fixtures import SMALL, execution, on_policy
from cellrunner.config import ModelConfig
from cellrunner.gspo import gspo_loss, pack, token_logprobs
from cellrunner.model import build_model, flatten_grads
from cellrunner.tree_pack import (
    ATTN_IMPLEMENTATION,
    BLOCK_ROWS,
    ancestor_mask,
    packed_size,
    packed_token_logprobs,
    plan,
    tree_chunks,
)
from base import wire
from base.typed_config import build
from tests.trajectory.test_claude_code_shapes import claude_code_run, tree_of
from trajectory.samples import build_sequences
from trajectory.sampling import select
from trajectory.tree import TokenTree

VOCAB = 1000  # above the trajectory tests' ids (< 800); the bench fixture's ids are folded into it
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: one thread is fastest, and spares a shared machine's other cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    cfg = build(ModelConfig, {**yaml.safe_load(open("conf/model/tiny.yaml")), "max_position_embeddings": 4096})
    return build_model(cfg, VOCAB)


def seq(execution_id: str, tokens: list[int], mask: list[int], *, advantage: float = 1.0) -> wire.Sequence:
    return wire.Sequence(
        execution_id=execution_id, tokens=tokens, target_mask=mask,
        behaviour_logprobs=[-0.5 * m for m in mask], advantage=advantage, token_weight=1.0 / max(1, sum(mask)),
    )


def random_executions(rng: random.Random, *, num_executions: int, vocab: int = 50) -> list[wire.Sequence]:
    """Chains grown as a random tree: each new chain copies a random prefix of an earlier one."""
    out = []
    for e in range(num_executions):
        chains: list[list[int]] = []
        for _ in range(rng.randint(1, 6)):
            if chains and rng.random() < 0.8:
                base = rng.choice(chains)
                stem = base[: rng.randint(1, len(base))]
            else:
                stem = [rng.randrange(vocab)]
            chain = stem + [rng.randrange(vocab) for _ in range(rng.randint(1, 25))]
            chains.append(chain)
        for chain in chains:
            mask = [0] + [int(rng.random() < 0.4) for _ in chain[1:]]
            mask[-1] = 1
            out.append(seq(f"x{e}", chain, mask, advantage=rng.gauss(0, 1)))
    rng.shuffle(out)
    return out


@functools.cache
def cc_sequences(k: int) -> list[wire.Sequence]:
    """The trajectory tests' Claude Code run and one small bench execution, K trajectories each."""
    out = []
    for eid, tree in [("cc", tree_of(claude_code_run())), ("bench", _bench_tree())]:
        out += build_sequences(eid, select(tree.trajectories(), max_trajectories=k), advantage=1.0 if eid == "cc" else -0.5)
    return out


def _bench_tree() -> TokenTree:
    tree = TokenTree("bench")
    for r in execution(0, SMALL):
        fold = [t % VOCAB for t in r.prompt_ids], [t % VOCAB for t in r.output_ids]
        tree.insert(dataclasses.replace(r, prompt_ids=fold[0], output_ids=fold[1]))
    return tree


def assert_same_logprobs(model: torch.nn.Module, sequences: list[wire.Sequence], **kw: object) -> None:
    batch = pack(sequences)
    with torch.no_grad():
        want = token_logprobs(model, batch)
        got = packed_token_logprobs(model, sequences, **kw)
    assert got.shape == want.shape
    valid = batch.attention_mask[:, 1:].bool()
    if kw.get("targets_only"):
        valid = batch.target_mask.bool()
        assert torch.all(got[~valid] == 0)
    torch.testing.assert_close(got[valid], want[valid], atol=ATOL, rtol=0)
    assert torch.all(got[~batch.attention_mask[:, 1:].bool()] == 0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("attention", ["segments", "mask"])
def test_random_trees_match_unrolled(model: torch.nn.Module, seed: int, attention: str) -> None:
    sequences = random_executions(random.Random(seed), num_executions=3)
    assert_same_logprobs(model, sequences, attention=attention)


@pytest.mark.parametrize("k", [1, 5, 100])
@pytest.mark.parametrize("attention", ["segments", "mask"])
def test_claude_code_shapes_match_unrolled(model: torch.nn.Module, k: int, attention: str) -> None:
    assert_same_logprobs(model, cc_sequences(k), attention=attention)


def test_long_runs_after_a_prefix_are_split_into_blocks(model: torch.nn.Module) -> None:
    rng = random.Random(5)
    trunk = [rng.randrange(VOCAB) for _ in range(700)]
    chains = [
        trunk,
        trunk[:3] + [rng.randrange(VOCAB) for _ in range(600)],    # short prefix, 3 blocks
        trunk[:400] + [rng.randrange(VOCAB) for _ in range(300)],  # long prefix, 2 blocks
    ]
    sequences = [seq("long", c, [0] + [int(rng.random() < 0.3) for _ in c[1:]]) for c in chains]
    assert max(r.end - r.start for r in plan(sequences).runs if len(r.prefix)) > BLOCK_ROWS
    assert_same_logprobs(model, sequences)


@pytest.mark.parametrize("attention", ["segments", "mask"])
def test_targets_only_matches_at_targets(model: torch.nn.Module, attention: str) -> None:
    assert_same_logprobs(model, cc_sequences(5), attention=attention, targets_only=True)


def test_eager_attention_takes_the_float_mask() -> None:
    cfg = build(ModelConfig, yaml.safe_load(open("conf/model/tiny.yaml")))
    model = build_model(cfg, VOCAB)
    model.config._attn_implementation = "eager"
    assert_same_logprobs(model, random_executions(random.Random(7), num_executions=2), attention="mask")
    assert model.config._attn_implementation == "eager"


def gradients(model: torch.nn.Module, sequences: list[wire.Sequence], packed: dict | None) -> np.ndarray:
    model.zero_grad(set_to_none=True)
    batch = pack(sequences)
    lp = token_logprobs(model, batch) if packed is None else packed_token_logprobs(model, sequences, **packed)
    loss, _ = gspo_loss(lp, batch, eps_low=3e-4, eps_high=4e-4)
    loss.backward()
    return flatten_grads(model)


@pytest.fixture(scope="module")
def on_policy_data(model: torch.nn.Module) -> dict[str, list[wire.Sequence]]:
    """Behaviour log-probs from the model itself: ratio 1, nothing clipped, every target has gradient."""
    return {
        "random": on_policy(model, random_executions(random.Random(3), num_executions=3)),
        "claude_code": on_policy(model, cc_sequences(100)),
    }


@pytest.mark.parametrize(
    "packed", [{}, {"attention": "mask"}, {"targets_only": True}], ids=["segments", "mask", "targets_only"]
)
@pytest.mark.parametrize("source", ["random", "claude_code"])
def test_gspo_gradients_match_unrolled(
    model: torch.nn.Module, on_policy_data: dict[str, list[wire.Sequence]], packed: dict, source: str
) -> None:
    sequences = on_policy_data[source]
    want = gradients(model, sequences, None)
    got = gradients(model, sequences, packed)
    assert np.abs(want).max() > 1e-4  # a real gradient, not all clipped away
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=1e-3)


def test_shared_prefixes_are_packed_once() -> None:
    sequences = cc_sequences(100)
    tree = plan(sequences)
    assert tree.num_tokens == packed_size(sequences) < sum(len(s.tokens) for s in sequences)
    # Per execution, the packed size is the number of distinct prefixes of its chains.
    for eid in {s.execution_id for s in sequences}:
        chains = [s.tokens for s in sequences if s.execution_id == eid]
        distinct = {tuple(c[: i + 1]) for c in chains for i in range(len(c))}
        assert packed_size([s for s in sequences if s.execution_id == eid]) == len(distinct)


def test_no_sharing_between_executions_or_disjoint_chains() -> None:
    a = seq("a", [1, 2, 3, 4], [0, 0, 1, 1])
    b = seq("b", [1, 2, 3, 5], [0, 0, 1, 1])  # same prefix, other execution: not shared
    c = seq("a", [9, 8, 7], [0, 1, 1])        # another root in execution a
    tree = plan([a, b, c])
    assert tree.num_tokens == 11
    assert tree.num_rows == 2


def test_layout_is_depth_first_with_depth_positions() -> None:
    chains = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7], [1, 2, 3, 4]]  # a duplicate chain too
    sequences = [seq("e", c, [0] + [1] * (len(c) - 1)) for c in chains]
    tree = plan(sequences)
    # Sorted chains: [1 2 3 4] [1 2 3 4] [1 2 3 6 7] [1 2 5] -> preorder 1 2 3 4 | 6 7 | 5.
    assert tree.tokens.tolist() == [1, 2, 3, 4, 6, 7, 5]
    assert tree.depth.tolist() == [0, 1, 2, 3, 3, 4, 2]
    assert tree.src[1].tolist() == [0, 1, -1, -1]  # chain [1 2 5]: 1, 2 predict from nodes 0, 1
    assert tree.src[2].tolist() == [0, 1, 2, 4]    # chain [1 2 3 6 7]: 6 is node 4
    want = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0],
        [1, 1, 1, 0, 1, 1, 0],
        [1, 1, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(ancestor_mask(tree, 0, tree.num_tokens), want)


def test_model_keeps_its_attention_and_plain_calls_still_work(model: torch.nn.Module) -> None:
    before = model.config._attn_implementation
    packed_token_logprobs(model, cc_sequences(5))
    assert model.config._attn_implementation == before != ATTN_IMPLEMENTATION
    batch = pack(cc_sequences(5))
    with torch.no_grad():
        assert torch.isfinite(token_logprobs(model, batch)).all()


def test_tree_chunks_keep_executions_whole() -> None:
    sequences = random_executions(random.Random(11), num_executions=6)
    chunks = tree_chunks(sequences, max_tokens=60)
    assert sorted(id(s) for c in chunks for s in c) == sorted(id(s) for s in sequences)
    owner = {}
    for i, chunk in enumerate(chunks):
        for s in chunk:
            assert owner.setdefault(s.execution_id, i) == i
        if len({s.execution_id for s in chunk}) > 1:
            assert packed_size(chunk) <= 60
    assert len(tree_chunks(sequences, max_tokens=10**6)) == 1


def test_rejects_unknown_attention(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="attention"):
        packed_token_logprobs(model, cc_sequences(1), attention="flash")  # type: ignore[arg-type]
