"""Run release: executions trained as they are graded, on any cells, in any order, give the update
a whole-group shard with advantages gives, inside the clip band and outside it."""

import dataclasses
import random

import numpy as np
import pytest
import torch

from cellrunner.gspo import pack, token_logprobs
from cellrunner.model import build_model
from cellrunner.trainer import EmbeddedTrainer
from base import wire
from tests.cellrunner.test_trainer import VOCAB, assert_same_gradient, cfgs
from base.advantages import group_advantages, group_stats

# Each execution's sequences get behaviour log-probs shifted so that s = exp(shift) lands in the
# clip band (0), above it or below it (GSPO's band is [1 - 3e-4, 1 + 4e-4]).
SHIFTS = {"in": 0.0, "high": 0.02, "low": -0.02}


def group(rng: random.Random, rewards: list[float], kinds: list[list[str]], group_id: str = "g0"):
    """Per execution: its id, its reward, its sequences (advantage 0) at the seeded init's weights."""
    model_cfg, _ = cfgs()
    model = build_model(model_cfg, VOCAB)  # the seeded init every trainer starts from
    out = []
    for e, (reward, seq_kinds) in enumerate(zip(rewards, kinds)):
        eid = f"{group_id}-e{e}"
        seqs = []
        for kind in seq_kinds:
            n = rng.randint(6, 16)
            tokens = [rng.randrange(VOCAB) for _ in range(n)]
            mask = [0] * 3 + [1] * (n - 3)
            draft = wire.Sequence(execution_id=eid, tokens=tokens, target_mask=mask,
                                  behaviour_logprobs=[0.0] * n, advantage=0.0, token_weight=1.0)
            with torch.no_grad():
                lp = token_logprobs(model, pack([draft]))[0].tolist()
            behaviour = [0.0] + [v - SHIFTS[kind] for v in lp]
            seqs.append(wire.Sequence(execution_id=eid, tokens=tokens, target_mask=mask,
                                      behaviour_logprobs=behaviour, advantage=0.0,
                                      token_weight=1.0 / (len(seq_kinds) * (n - 3))))
        out.append((eid, reward, seqs))
    return out


def trainer(band: float | None = None) -> EmbeddedTrainer:
    model_cfg, algo = cfgs()
    if band is not None:
        algo = dataclasses.replace(algo, eps_low=band, eps_high=band)
    t = EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=False)
    t.start(None)
    return t


def group_release_grads(execs, group_id="g0", band: float | None = None) -> np.ndarray:
    advantages = group_advantages([r for _, r, _ in execs], adv_eps=cfgs()[1].adv_eps)
    seqs = [wire.Sequence(**{**{f: getattr(s, f) for f in s.__slots__}, "advantage": a})
            for (_, _, ss), a in zip(execs, advantages) for s in ss]
    t = trainer(band)
    t.microstep(wire.Shard(step=0, shard_id=group_id, num_executions=len(execs), sequences=seqs))
    return t.take_grads()


def run_release_grads(rng, execs, stats: list[wire.GroupStats], cells: int = 2) -> np.ndarray:
    """Each execution as its own run-released shard, in a random order, on ``cells`` replicas."""
    replicas = [trainer() for _ in range(cells)]
    order = list(execs)
    rng.shuffle(order)
    for i, (eid, reward, seqs) in enumerate(order):
        shard = wire.Shard(step=0, shard_id=f"{stats[0].group_id}/{eid}", num_executions=1, sequences=seqs,
                           group_id=stats[0].group_id, reward=reward)
        shard = wire.decode(wire.encode(shard))  # as it crosses the wire, validated
        replicas[rng.randrange(cells) if i else 0].microstep(shard)
    total = None
    for r in replicas:
        r.fold_groups(stats)
        g = r.take_grads()
        total = g if total is None else total + g
    return total


def stats_of(execs, group_id="g0", dropped=False) -> wire.GroupStats:
    mean, divisor = group_stats([r for _, r, _ in execs], adv_eps=cfgs()[1].adv_eps)
    return wire.GroupStats(group_id=group_id, mean_reward=mean, adv_divisor=divisor, dropped=dropped)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_run_release_gives_the_group_release_gradient_inside_and_outside_the_band(seed):
    rng = random.Random(seed)
    kinds = [["in", "high"], ["low"], ["high", "low", "in"], ["in"], ["high"], ["low", "in"]]
    rewards = [1.0, 0.2, 0.7, 0.0, 0.9, 0.4]
    execs = group(rng, rewards, kinds)
    want = group_release_grads(execs)
    got = run_release_grads(rng, execs, [stats_of(execs)])
    assert_same_gradient(got, want)


def test_the_clip_band_matters_in_that_test():
    """Without the clip (a band wide enough to hold every ratio) the gradient is another one, so
    the equality above would fail if run release mishandled the sequences outside the band."""
    rng = random.Random(0)
    kinds = [["in", "high"], ["low"], ["high", "low", "in"], ["in"], ["high"], ["low", "in"]]
    execs = group(rng, [1.0, 0.2, 0.7, 0.0, 0.9, 0.4], kinds)
    want = group_release_grads(execs)
    unclipped = group_release_grads(execs, band=0.5)
    assert np.abs(unclipped - want).max() > 1e-2 * np.abs(want).max()


def test_equal_rewards_and_dropped_groups_add_nothing():
    rng = random.Random(3)
    execs = group(rng, [0.5, 0.5, 0.5], [["in"], ["high"], ["low"]])
    assert stats_of(execs).adv_divisor == 0.0
    assert not run_release_grads(rng, execs, [stats_of(execs)]).any()
    spread = group(rng, [0.1, 0.9, 0.5], [["in"], ["high"], ["low"]])
    assert not run_release_grads(rng, spread, [stats_of(spread, dropped=True)]).any()


def test_a_group_without_its_stats_is_refused_and_nothing_is_lost():
    rng = random.Random(4)
    execs = group(rng, [0.1, 0.9], [["in"], ["high", "in"]])
    t = trainer()
    for eid, reward, seqs in execs:
        t.microstep(wire.Shard(step=0, shard_id=eid, num_executions=1, sequences=seqs, group_id="g0", reward=reward))
    with pytest.raises(RuntimeError, match="folded"):
        t.take_grads()
    with pytest.raises(ValueError, match="g0"):
        t.fold_groups([wire.GroupStats(group_id="other", mean_reward=0.0, adv_divisor=1.0)])
    t.fold_groups([stats_of(execs)])  # the kept gradients survived the refusal
    assert_same_gradient(t.take_grads(), group_release_grads(execs))


def test_run_released_shards_are_validated_on_the_wire():
    seq = wire.Sequence(execution_id="e", tokens=[1, 2], target_mask=[0, 1], behaviour_logprobs=[0.0, -1.0],
                        advantage=0.5, token_weight=1.0)
    for bad in (
        dict(group_id="g", reward=1.0, sequences=[seq]),  # an advantage before the group closed
        dict(group_id="", reward=1.0, sequences=[wire.Sequence(**{**{f: getattr(seq, f) for f in seq.__slots__}, "advantage": 0.0})]),
    ):
        shard = wire.Shard(step=0, shard_id="s", num_executions=1, **bad)
        with pytest.raises(wire.ProtocolError):
            wire.decode(wire.encode(shard))
