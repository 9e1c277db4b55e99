"""Core + satellites: however the shards of a step are spread over replicas, the update is the
one a single replica computes on all of them."""

import random
import time

import numpy as np
import pytest
import yaml
import zmq
import torch

from cellrunner.config import EmbeddedTrainerConfig, ModelConfig
from cellrunner.gspo import gspo_loss, pack, token_logprobs
from cellrunner.model import build_model, flatten_grads, flatten_params, load_flat
from cellrunner.trainer import EmbeddedTrainer, split_by_tokens
from cellrunner.transfer import TransferError, WeightServer, pull_weights, recv_grads, send_grads
from base import wire
from base.typed_config import build
from base.algo_config import AlgoConfig

VOCAB = 300


def cfgs():
    model = build(ModelConfig, yaml.safe_load(open("conf/model/tiny.yaml")))
    algo = build(AlgoConfig, {**yaml.safe_load(open("conf/algo/gspo.yaml")), "max_tokens_per_microstep": 64})
    return model, algo


def make_shards(rng: random.Random, num_shards: int) -> list[wire.Shard]:
    shards = []
    for s in range(num_shards):
        seqs = []
        for e in range(3):
            n = rng.randint(6, 20)
            tokens = [rng.randrange(VOCAB) for _ in range(n)]
            mask = [0] * 3 + [rng.randint(0, 1) for _ in range(n - 3)]
            lps = [(-rng.random() * 3 if m else 0.0) for m in mask]
            seqs.append(wire.Sequence(execution_id=f"x{s}-{e}", tokens=tokens, target_mask=mask,
                                      behaviour_logprobs=lps, advantage=rng.gauss(0, 1),
                                      token_weight=1.0 / max(1, sum(mask))))
        shards.append(wire.Shard(step=0, shard_id=f"g{s}", num_executions=3, sequences=seqs))
    return shards


def assert_same_gradient(got: np.ndarray, want: np.ndarray) -> None:
    # Equal up to float32 summation order. (Weights after AdamW are not compared element-wise:
    # its first step is ~lr * sign(g), so a gradient entry of ~1e-12 may flip either way.)
    scale = float(np.abs(want).max())
    assert scale > 0
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)


def one_replica_grads(shards: list[wire.Shard]) -> np.ndarray:
    """The summed gradient one core computes on all of ``shards`` (what any split must equal)."""
    model_cfg, algo = cfgs()
    single = EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=True)
    single.start(None)
    for sh in shards:
        single.microstep(sh)
    return single.take_grads()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_update_is_the_same_whoever_computes_it(seed):
    model_cfg, algo = cfgs()
    rng = random.Random(seed)
    shards = make_shards(rng, 6)
    want = one_replica_grads(shards)

    core = EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=True)
    core.start(None)
    v0 = core.weights()
    sats = [EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=False) for _ in range(2)]
    owners = [rng.randrange(3) for _ in shards]  # satellites join at random points of the step
    for sh, owner in zip(shards, owners):
        trainer = core if owner == 0 else sats[owner - 1]
        if trainer.model is None:
            trainer.start(v0)
        trainer.microstep(sh)
    grads = [s.take_grads() for s in sats if s.model is not None]
    assert_same_gradient(flatten_grads(core.model) + sum(grads, np.zeros_like(want)), want)
    w_split, norm = core.apply(grads, num_executions=18)
    assert w_split.version == 1 and norm > 0
    assert not np.allclose(w_split.data, v0.data)  # the step really moved the weights


def test_gspo_clip_and_sign():
    model_cfg, algo = cfgs()
    model = build_model(model_cfg, VOCAB)
    seq = wire.Sequence(execution_id="e", tokens=[1, 2, 3, 4], target_mask=[0, 0, 1, 1],
                        behaviour_logprobs=[0, 0, 0, 0], advantage=1.0, token_weight=0.5)
    batch = pack([seq])
    lp = token_logprobs(model, batch).detach()
    # On-policy: ratio 1, loss = -A * (tokens * weight) = -1.
    on = pack([wire.Sequence(**{**wire.to_plain(seq), "behaviour_logprobs": [0, 0, *lp[0, 1:].tolist()]})])
    loss, stats = gspo_loss(lp, on, eps_low=3e-4, eps_high=4e-4)
    assert stats.mean_ratio == pytest.approx(1.0, abs=1e-6) and loss.item() == pytest.approx(-1.0, abs=1e-5)
    # Far off-policy with A > 0 and ratio > 1 + eps_high: clipped, so no gradient flows.
    off = pack([wire.Sequence(**{**wire.to_plain(seq), "behaviour_logprobs": [0, 0, -50.0, -50.0]})])
    lp2 = token_logprobs(model, off)
    loss2, stats2 = gspo_loss(lp2, off, eps_low=3e-4, eps_high=4e-4)
    loss2.backward()
    assert stats2.clip_fraction == 1.0
    assert all(p.grad is None or float(p.grad.abs().sum()) == 0.0 for p in model.parameters())


def test_kl_to_behaviour_is_zero_on_policy_and_the_k3_mean_off_it():
    model_cfg, _ = cfgs()
    model = build_model(model_cfg, VOCAB)
    seq = wire.Sequence(execution_id="e", tokens=[1, 2, 3, 4], target_mask=[0, 0, 1, 1],
                        behaviour_logprobs=[0, 0, 0, 0], advantage=1.0, token_weight=0.5)
    lp = token_logprobs(model, pack([seq])).detach()
    on = pack([wire.Sequence(**{**wire.to_plain(seq), "behaviour_logprobs": [0, 0, *lp[0, 1:].tolist()]})])
    assert gspo_loss(lp, on, eps_low=0.2, eps_high=0.2)[1].kl == pytest.approx(0.0, abs=1e-7)
    old = [float(lp[0, 1]) - 0.3, float(lp[0, 2]) + 0.1]  # the behaviour policy was 0.3 lower, then 0.1 higher
    off = pack([wire.Sequence(**{**wire.to_plain(seq), "behaviour_logprobs": [0, 0, *old]})])
    want = sum(np.exp(d) - 1 - d for d in (0.3, -0.1)) / 2
    assert gspo_loss(lp, off, eps_low=0.2, eps_high=0.2)[1].kl == pytest.approx(want, rel=1e-4)


def test_split_by_tokens_keeps_every_sequence():
    rng = random.Random(3)
    seqs = [s for sh in make_shards(rng, 3) for s in sh.sequences]
    chunks = split_by_tokens(seqs, 40)
    assert sorted(id(s) for c in chunks for s in c) == sorted(id(s) for s in seqs)
    assert all(len(c) == 1 or max(len(s.tokens) for s in c) * len(c) <= 40 for c in chunks)


def test_weights_and_grads_over_zmq():
    model_cfg, _ = cfgs()
    ctx = zmq.Context.instance()
    server = WeightServer(ctx, "tcp://127.0.0.1:0")
    weights = flatten_params(build_model(model_cfg, VOCAB), 4)
    server.publish(weights)
    server.start()
    try:
        got = pull_weights(ctx, server.addr, 4, timeout_s=10)
        assert got.version == 4 and np.array_equal(got.data, weights.data) and got.specs == weights.specs
        with pytest.raises(TransferError, match="asked for >= 5"):
            pull_weights(ctx, server.addr, 5, timeout_s=10)
        # A serving cell's pull: the bf16 copy, half the bytes, what the float32 rounds to.
        served = pull_weights(ctx, server.addr, 4, timeout_s=10, dtype="bfloat16")
        assert served.dtype == "bfloat16" and served.nbytes * 2 == weights.nbytes and served.specs == weights.specs
        assert torch.equal(served.tensor(), torch.from_numpy(weights.data).to(torch.bfloat16))
        model = build_model(model_cfg, VOCAB)
        load_flat(model, served)  # the embedded engine's load takes it too (into float32 parameters)
        assert torch.equal(next(model.parameters()).data, served.tensor()[: next(model.parameters()).numel()]
                           .float().view_as(next(model.parameters())))
    finally:
        server.close()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    g = np.arange(10, dtype=np.float32)
    send_grads(push, cell_id=2, step=7, grads=g)
    header, got_g = recv_grads(pull.recv_multipart())
    assert (header.cell_id, header.step) == (2, 7) and np.array_equal(got_g, g)
    with pytest.raises(wire.ProtocolError, match="payload"):
        recv_grads([wire.encode(wire.GradsHeader(cell_id=1, step=1, num_elements=3)), b"\0" * 8])
    push.close(0)
    pull.close(0)


def test_tree_packing_gives_the_same_update():
    """Compute dedup (one pass over each execution's prefix trie) changes the cost, not the step."""
    import dataclasses

    model_cfg, algo = cfgs()
    rng = random.Random(7)
    shards = []
    for s in range(3):
        seqs = []
        for e in range(2):
            prefix = [rng.randrange(VOCAB) for _ in range(12)]
            for branch in range(3):  # three chains of one execution share its first 12 tokens
                tail = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 8))]
                mask = [0] * 12 + [1] * len(tail)
                seqs.append(wire.Sequence(
                    execution_id=f"x{s}-{e}", tokens=prefix + tail, target_mask=mask,
                    behaviour_logprobs=[(-rng.random() if m else 0.0) for m in mask],
                    advantage=rng.gauss(0, 1), token_weight=1.0 / 20))
        shards.append(wire.Shard(step=0, shard_id=f"g{s}", num_executions=2, sequences=seqs))
    grads = []
    for packed in (False, True):
        trainer = EmbeddedTrainer(model_cfg=model_cfg, algo=dataclasses.replace(algo, tree_packing=packed),
                                  vocab_size=VOCAB, is_core=True)
        trainer.start(None)
        for sh in shards:
            trainer.microstep(sh)
        grads.append(trainer.take_grads())
    assert_same_gradient(grads[1], grads[0])


def test_device_pacing_sets_a_floor_on_time_and_changes_nothing_else():
    """trainer.device_s_per_token emulates a cell's own accelerator: a microstep lasts at least
    tokens x pace (sleeping, not computing), and the gradient is the unpaced one."""
    model_cfg, algo = cfgs()
    shard = make_shards(random.Random(0), 1)[0]
    tokens = sum(len(s.tokens) for s in shard.sequences)
    plain = EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=True)
    # A floor well above the compute even on a loaded machine (19 tokens: ~1 s against ~0.3 s).
    paced = EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=True, device_s_per_token=0.05)
    for t in (plain, paced):
        t.start(None)
    cpu0 = time.process_time()
    res = paced.microstep(shard)
    cpu_s = time.process_time() - cpu0
    assert res.fb_s >= 0.05 * tokens
    assert cpu_s < 0.5 * res.fb_s  # the floor was slept, not computed
    plain.microstep(shard)
    assert_same_gradient(paced.take_grads(), plain.take_grads())


def test_pacing_is_validated():
    with pytest.raises(ValueError, match="device_s_per_token"):
        build(EmbeddedTrainerConfig, {"kind": "embedded", "device_s_per_token": -1})
    assert build(EmbeddedTrainerConfig, yaml.safe_load(open("conf/trainer/embedded.yaml"))).device_s_per_token == 0
