"""trainer=megatron on CPU: megatron-core 0.16.1's GPTModel, DDP and optimizer, through gloo.

- HF <-> Megatron conversion is exact both ways (dense TP 1/2, untied, the TE spec's names, MoE
  over 2 expert-parallel ranks).
- On the same weights and shard, the Megatron trainer's per-token log-probs, GSPO loss and
  gradient equal the embedded trainer's (the layouts are right, the loss is gspo.py's).
- World size 1 in this process: the loss goes down under Megatron's optimizer, core + satellite
  equals one replica, the checkpoint reloads exactly, and the plain-AdamW trap is real.
- World size 2 in two real processes (TP=2 and DP=2, gloo on a free port): both ranks agree, the
  TP-gathered weights are the HF ones, the gradient equals the embedded one, and it trains.

megatron-core needs the CPU shims of ``megatron_cpu_shims`` (test support, never production).
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # when run as a worker script
    sys.path.insert(0, str(ROOT))

import megatron.core  # noqa: E402,F401  (the [test] extra: missing is a failure, never a skip)

from tests.cellrunner import megatron_cpu_shims
from tests.cellrunner.rank_workers import leave, run_ranks

megatron_cpu_shims.install()

from cellrunner.config import ModelConfig
from cellrunner.gspo import gspo_loss, pack, token_logprobs
from cellrunner.megatron_convert import (
    hf_names, hf_shapes, hf_to_megatron, layout_from_hf, megatron_names, megatron_to_hf,
)
from cellrunner.config import MegatronConfig
from cellrunner.megatron_trainer import MegatronTrainer
from cellrunner.model import hf_config
from cellrunner.trainer import EmbeddedTrainer
from base import wire
from base.checkpoints import Checkpoint, latest_checkpoint
from base.typed_config import build
from base.algo_config import AlgoConfig

VOCAB = 300  # not a multiple of 128 x TP: the padded rows are exercised


def model_cfg(**over) -> ModelConfig:
    return build(ModelConfig, {**yaml.safe_load(open(ROOT / "conf/model/tiny.yaml")), "num_hidden_layers": 2, **over})


def algo_cfg(**over) -> AlgoConfig:
    return build(AlgoConfig, {**yaml.safe_load(open(ROOT / "conf/algo/gspo.yaml")), "max_tokens_per_microstep": 64, **over})


def megatron_cfg(tp: int = 1) -> MegatronConfig:
    return MegatronConfig(kind="megatron", tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                          expert_model_parallel_size=1, params_dtype="float32", layer_spec="local", pad_vocab_to=128,
                          offload_when_serving=False, moe_aux_loss_coeff=0.0, command_timeout_s=3600.0,
                          local_attention="sdpa", recompute_granularity="none", recompute_method="uniform",
                          recompute_num_layers=1, logprob_chunk_tokens=16)


def make_shard(seed: int, *, step: int = 0, num_seqs: int = 4, on_policy_from: EmbeddedTrainer | None = None) -> wire.Shard:
    """Random sequences; behaviour log-probs random, or the given model's own (ratio 1)."""
    rng = random.Random(seed)
    seqs = []
    for e in range(num_seqs):
        n = rng.randint(8, 24)
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        mask = [0] * 3 + [rng.randint(0, 1) for _ in range(n - 4)] + [1]
        # near the untrained model's log(1/VOCAB) = -5.7, so ratios stay inside a wide clip
        lps = [(-5.7 + 0.4 * (rng.random() - 0.5) if m else 0.0) for m in mask]
        seqs.append(wire.Sequence(execution_id=f"x{seed}-{e}", tokens=tokens, target_mask=mask, behaviour_logprobs=lps,
                                  advantage=(1.0 if e % 2 else -1.0) * (0.5 + rng.random()),
                                  token_weight=1.0 / sum(mask)))
    if on_policy_from is not None:
        batch = pack(seqs)
        with torch.no_grad():
            lp = token_logprobs(on_policy_from.model, batch)
        seqs = [wire.Sequence(**{**wire.to_plain(s), "behaviour_logprobs": [0.0, *[
            float(lp[i, t - 1]) if s.target_mask[t] else 0.0 for t in range(1, len(s.tokens))]]})
            for i, s in enumerate(seqs)]
    return wire.Shard(step=step, shard_id=f"s{seed}", num_executions=num_seqs, sequences=seqs)


def both_logprobs(meg: MegatronTrainer, emb: EmbeddedTrainer, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's and the embedded trainer's token log-probs of ``batch``, and the mask of real positions."""
    with torch.no_grad():
        want = token_logprobs(emb.model, batch)
        logits = meg.model(batch.input_ids, torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids), None)
        got = meg.token_logprobs(logits, batch.targets)
    return got, want, batch.attention_mask[:, 1:].bool()


def megatron_grads_as_hf(trainer: MegatronTrainer) -> dict[str, torch.Tensor]:
    """The accumulated gradient in HF names (the same mapping and export as the weights)."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    finalize_model_grads([trainer.model])
    flat = trainer._export(lambda p: p.main_grad.detach(), dtype=torch.float32, everywhere=True)
    return {s.name: flat[s.offset : s.offset + int(np.prod(s.shape))].view(*s.shape) for s in trainer.specs}


# ---------------------------------------------------------------- conversion


def hf_state(layout, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in hf_shapes(layout).items()}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("spec", ["local", "transformer_engine"])
def test_hf_megatron_hf_round_trip_is_exact(tp, tied, spec):
    cfg = model_cfg(tie_word_embeddings=tied)
    layout = layout_from_hf(hf_config(cfg, VOCAB), pad_to=128, tp_size=tp, layer_spec=spec)
    assert layout.padded_vocab_size == {1: 384, 2: 512}[tp]  # 300 rows padded to a multiple of 128 x TP
    hf = hf_state(layout, seed=tp)
    shards = [hf_to_megatron(hf, layout, tp_size=tp, tp_rank=r) for r in range(tp)]
    for shard in shards:
        assert set(shard) == set(megatron_names(layout))
        assert shard["embedding.word_embeddings.weight"].shape[0] == layout.padded_vocab_size // tp
    back = megatron_to_hf(shards, layout)
    assert set(back) == set(hf_names(layout))
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    # The SwiGLU fc1 shard of rank r is [gate_r; up_r] (partition stride 2), not a slice of [gate; up].
    if tp == 2:
        gate = hf["model.layers.0.mlp.gate_proj.weight"]
        fc1_r1 = shards[1]["decoder.layers.0.mlp.linear_fc1.weight"]
        assert torch.equal(fc1_r1[: gate.shape[0] // 2], gate[gate.shape[0] // 2 :])


def test_moe_round_trip_over_two_expert_ranks():
    from transformers import Qwen3MoeConfig

    hf_cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_local_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], tie_word_embeddings=False)
    layout = layout_from_hf(hf_cfg, pad_to=64, tp_size=1, layer_spec="local")
    assert layout.num_experts == 4 and layout.moe_layers == (1,)
    hf = hf_state(layout, seed=7)
    back: dict[str, torch.Tensor] = {}
    for ep_rank in range(2):
        shard = hf_to_megatron(hf, layout, ep_size=2, ep_rank=ep_rank)
        assert set(shard) == set(megatron_names(layout, ep_size=2, ep_rank=ep_rank))
        back.update(megatron_to_hf([shard], layout, ep_size=2, ep_rank=ep_rank))
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


# ---------------------------------------------------------------- world size 1, in this process


def test_moe_from_an_hf_checkpoint_matches_transformers(tmp_path):
    """MoE is config: a Qwen3-MoE folder (per-expert safetensors, one dense layer) loads, gives
    transformers' log-probs, exports back to the same tensors, and takes a step."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from cellrunner.megatron_convert import load_hf_safetensors, save_hf_safetensors

    hf_cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_local_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True,
                            tie_word_embeddings=False, max_position_embeddings=256)
    torch.manual_seed(0)
    hf_model = Qwen3MoeForCausalLM(hf_cfg).float()
    hf_model.save_pretrained(tmp_path / "hf")
    on_disk = load_hf_safetensors(str(tmp_path / "hf"))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in on_disk  # per-expert names, as SGLang loads them
    from_folder = build(ModelConfig, {**yaml.safe_load(open(ROOT / "conf/model/qwen3_hf.yaml")),
                                      "path": str(tmp_path / "hf"), "tokenizer": "qwen_compact"})
    meg = MegatronTrainer(model_cfg=from_folder, algo=algo_cfg(eps_low=0.2, eps_high=10.0), vocab_size=VOCAB,
                          is_core=True, megatron=megatron_cfg())
    meg.start(None)
    assert meg.layout.moe_layers == (1,) and meg.version == 0
    exported = meg.weights()
    assert {s.name for s in exported.specs} == set(on_disk)
    for s in exported.specs:
        n = int(np.prod(s.shape))
        assert torch.equal(torch.from_numpy(exported.data[s.offset : s.offset + n]).view(*s.shape), on_disk[s.name])
    save_hf_safetensors({s.name: on_disk[s.name] for s in exported.specs}, str(tmp_path / "out"), max_shard_bytes=100_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()  # sharded, with its index
    assert all(torch.equal(t, on_disk[n]) for n, t in load_hf_safetensors(str(tmp_path / "out")).items())

    shard = make_shard(8)
    batch = pack(list(shard.sequences))
    with torch.no_grad():
        want = token_logprobs(hf_model, batch)
        logits = meg.model(batch.input_ids, torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids), None)
        got = meg.token_logprobs(logits, batch.targets)
    real = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=2e-5)
    meg.microstep(shard)
    w1, norm = meg.apply([], num_executions=shard.num_executions)
    assert w1.version == 1 and norm > 0 and not np.array_equal(w1.data, exported.data)


def test_logprobs_loss_and_gradient_equal_the_embedded_trainers():
    cfg, algo = model_cfg(), algo_cfg(eps_low=0.2, eps_high=10.0)  # wide clip: most sequences carry gradient
    shard = make_shard(0)
    emb = EmbeddedTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True)
    emb.start(None)
    meg = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True, megatron=megatron_cfg())
    meg.start(None)
    w_meg, w_emb = meg.weights(), emb.weights()
    assert w_meg.specs == w_emb.specs and np.array_equal(w_meg.data, w_emb.data)  # version 0 everywhere

    batch = pack(list(shard.sequences))
    got, want, real = both_logprobs(meg, emb, batch)
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=2e-5)
    loss_e, _ = gspo_loss(want, batch, eps_low=algo.eps_low, eps_high=algo.eps_high)
    loss_m, _ = gspo_loss(got, batch, eps_low=algo.eps_low, eps_high=algo.eps_high)
    assert loss_m.item() == pytest.approx(loss_e.item(), rel=1e-5, abs=1e-6)

    r_emb, r_meg = emb.microstep(shard), meg.microstep(shard)
    assert r_meg.num_tokens == r_emb.num_tokens and r_meg.loss == pytest.approx(r_emb.loss, rel=1e-5)
    assert r_meg.mean_ratio == pytest.approx(r_emb.mean_ratio, rel=1e-5)
    g_emb = emb.take_grads()
    g_meg = megatron_grads_as_hf(meg)
    flat = np.concatenate([g_meg[s.name].reshape(-1).numpy() for s in w_emb.specs])
    scale = float(np.abs(g_emb).max())
    assert scale > 0
    np.testing.assert_allclose(flat, g_emb, rtol=0, atol=1e-5 * scale)


def test_logprobs_are_taken_at_the_rollout_temperature():
    """algo.rollout.temperature 0.5: Megatron's log-probs are the embedded trainer's at T = 0.5,
    and not the T = 1 ones (what an engine sampling at 0.5 scored its tokens under)."""
    raw = yaml.safe_load(open(ROOT / "conf/algo/gspo.yaml"))
    algo = algo_cfg(rollout={**raw["rollout"], "temperature": 0.5})
    cfg = model_cfg()
    emb = EmbeddedTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True)
    emb.start(None)
    meg = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True, megatron=megatron_cfg())
    meg.start(None)
    batch = pack(list(make_shard(3).sequences))
    with torch.no_grad():
        want = token_logprobs(emb.model, batch, 0.5)
        at_one = token_logprobs(emb.model, batch, 1.0)
        logits = meg.model(batch.input_ids, torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids), None)
        got = meg.token_logprobs(logits, batch.targets)
    real = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=2e-5)
    assert float((got[real] - at_one[real]).abs().max()) > 1e-3


def test_trains_with_megatron_optimizer_and_norm_matches_embedded():
    cfg = model_cfg()
    algo = algo_cfg(eps_low=0.2, eps_high=10.0, lr=3e-3)  # wide clip: the ratio may move, so the loss can fall
    emb = EmbeddedTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True)
    emb.start(None)
    meg = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True, megatron=megatron_cfg())
    meg.start(None)
    from megatron.core.optimizer import MegatronOptimizer

    assert isinstance(meg.optimizer, MegatronOptimizer)
    assert all(g["lr"] == pytest.approx(algo.lr) for o in meg.optimizer.chained_optimizers for g in o.optimizer.param_groups)
    shard = make_shard(1, on_policy_from=emb)
    losses = []
    for step in range(4):
        res = meg.microstep(shard)
        weights, norm = meg.apply([], num_executions=shard.num_executions)
        if step == 0:
            emb.microstep(shard)
            _, emb_norm = emb.apply([], num_executions=shard.num_executions)
            assert norm == pytest.approx(emb_norm, rel=1e-4)  # same combined gradient, same norm
        losses.append(res.loss)
        assert weights.version == step + 1
    assert losses[-1] < losses[0] - 0.05 * abs(losses[0]), losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_core_plus_satellite_is_one_replica():
    cfg, algo = model_cfg(), algo_cfg()
    a, b = make_shard(2), make_shard(3)
    single = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=False, megatron=megatron_cfg())
    single.start(None)
    single.microstep(a)
    single.microstep(b)
    want = single.take_grads()
    core = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True, megatron=megatron_cfg())
    core.start(None)
    sat = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=False, megatron=megatron_cfg())
    sat.start(core.weights())
    assert sat.version == 0
    core.microstep(a)
    sat.microstep(b)
    sat_grads = sat.take_grads()
    assert sat.num_microsteps == 0 and not np.any(sat.take_grads())  # taken means zeroed
    core_own = torch.cat([b.reshape(-1) for b in core._grad_buffers()]).numpy().copy()  # one rank: nothing to reduce
    np.testing.assert_allclose(core_own + sat_grads, want, rtol=0, atol=1e-6 * float(np.abs(want).max()))
    before = core.weights()
    w1, norm = core.apply([sat_grads], num_executions=8)
    assert w1.version == 1 and norm > 0 and not np.array_equal(w1.data, before.data)
    with pytest.raises(ValueError, match="elements"):
        core.microstep(a)
        core.apply([sat_grads[:-1]], num_executions=8)
    sat.stop()
    assert sat.model is None and sat.version == -1


def test_the_core_trains_the_same_after_offloading_for_serving(monkeypatch):
    # stop() offloads only on CUDA; here the same path runs on the host (no device change, which is
    # what broke DDP's hooks on the H200: cellrunner/param_offload.py): parameters, gradient
    # buffers and Adam's moments go and come back, and the next step is the one it would have taken.
    cfg, algo = model_cfg(), algo_cfg(lr=1e-4, eps_low=0.5, eps_high=10.0)  # wide clip: the second step has a gradient
    shard = make_shard(4)
    stay = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True, megatron=megatron_cfg())
    away = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True, megatron=megatron_cfg())
    for t in (stay, away):
        t.start(None)
        t.microstep(shard)
        t.apply([], num_executions=shard.num_executions)  # Adam has moments now
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)  # Megatron's grad-buffer offload calls it
    away._offload()
    assert away._offloaded and all(p.untyped_storage().nbytes() == 0 for p in away.model.module.parameters())
    away._restore()
    away._ready()
    for t in (stay, away):
        t.microstep(shard)
    assert not [n for n, p in away.model.module.named_parameters() if p.grad is not None]
    np.testing.assert_array_equal(torch.cat([b.reshape(-1) for b in away._grad_buffers()]).numpy(),
                                  torch.cat([b.reshape(-1) for b in stay._grad_buffers()]).numpy())
    (w_stay, n_stay), (w_away, n_away) = (t.apply([], num_executions=shard.num_executions) for t in (stay, away))
    assert n_away == n_stay > 0
    np.testing.assert_array_equal(w_away.data, w_stay.data)


def test_checkpoint_round_trip_is_exact(tmp_path):
    cfg, algo = model_cfg(), algo_cfg(eps_low=0.2, eps_high=10.0)
    first = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True, megatron=megatron_cfg())
    first.start(None)
    first.microstep(make_shard(4))
    first.apply([], num_executions=4)
    path = first.save_checkpoint(str(tmp_path))
    assert path == str(tmp_path / "v1") and latest_checkpoint(tmp_path) == Checkpoint(1, tmp_path / "v1")
    files = sorted(os.listdir(path))
    assert files == ["checkpoint.json", "gyre_megatron.json", "tp00_pp00_ep00.safetensors"]  # no pickle anywhere
    assert sorted(os.listdir(tmp_path)) == ["v1"]  # the temporary folder was renamed into place
    second = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True, megatron=megatron_cfg())
    second.restore(latest_checkpoint(tmp_path))  # what a resumed core does
    assert second.version == first.version == 1
    assert np.array_equal(second.weights().data, first.weights().data)
    # The Adam state came back too: the next step lands on the same weights, bit for bit.
    shard = make_shard(5, step=1)
    for t in (first, second):
        t.microstep(shard)
    w_a, _ = first.apply([], num_executions=4)
    w_b, _ = second.apply([], num_executions=4)
    assert np.array_equal(w_a.data, w_b.data)
    manifest = json.loads((tmp_path / "v1" / "gyre_megatron.json").read_text())
    manifest["layout"]["tp"] = 2
    (tmp_path / "v1" / "gyre_megatron.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="layout"):
        second.load_checkpoint(path)
    with pytest.raises(ValueError, match="not a Megatron checkpoint"):
        second.load_checkpoint(str(tmp_path))


def test_plain_adamw_on_megatron_ddp_does_not_train():
    """The trap the notes warn about, kept visible: DDP writes main_grad, plain AdamW reads grad."""
    cfg, algo = model_cfg(), algo_cfg(eps_low=0.2, eps_high=10.0)
    meg = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=False, megatron=megatron_cfg())
    meg.start(None)
    plain = torch.optim.AdamW(meg.model.parameters(), lr=1e-2)
    before = meg.weights().data
    meg.microstep(make_shard(6))
    plain.step()
    assert np.array_equal(meg.weights().data, before)
    assert any(float(p.main_grad.abs().sum()) > 0 for p in meg.model.parameters())


# ---------------------------------------------------------------- world size 2, two processes


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_two_ranks_agree_and_train(tp):
    results = run_ranks(__file__, ["--worker", str(tp)])
    r0, r1 = results
    for r in results:
        assert r["weights_equal_hf_init"], r
        assert r["logprob_maxdiff"] < 2e-5, r
        assert r["grad_maxdiff"] < 1e-5 * r["grad_scale"], r
        assert r["losses"][-1] < r["losses"][0] - 0.05 * abs(r["losses"][0]), r
    assert r0["losses"] == pytest.approx(r1["losses"], rel=1e-6)  # the reported loss is the cell's, on each rank
    assert r0["final_weights_crc"] == r1["final_weights_crc"]  # replicas / TP shards gather to one model
    assert (r0["rank"], r0["leader_export"], r1["leader_export"]) == (0, True, None)  # no full copy on rank 1
    assert r0["num_tokens"] == r1["num_tokens"] == r0["want_tokens"]


def worker(tp: int) -> None:
    """One rank of a two-rank cell: TP=2 (tp=2) or DP=2 (tp=1)."""
    import zlib

    torch.set_num_threads(1)
    cfg = model_cfg()
    algo = algo_cfg(eps_low=0.2, eps_high=10.0, lr=3e-3)
    meg = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True, megatron=megatron_cfg(tp))
    meg.start(None)
    emb = EmbeddedTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True)
    emb.start(None)
    init = meg.weights()
    out: dict = {"weights_equal_hf_init": bool(np.array_equal(init.data, emb.weights().data))}
    lead = meg.weights(everywhere=False)  # only the cell's rank 0 assembles the full model
    out["rank"] = torch.distributed.get_rank()
    out["leader_export"] = None if lead is None else bool(np.array_equal(lead.data, init.data))
    shard = make_shard(11, num_seqs=6, on_policy_from=emb)
    batch = pack(list(shard.sequences))
    got, want, real = both_logprobs(meg, emb, batch)
    out["logprob_maxdiff"] = float((got[real] - want[real]).abs().max())
    res = meg.microstep(shard)
    emb_res = emb.microstep(shard)
    out["num_tokens"], out["want_tokens"] = res.num_tokens, emb_res.num_tokens
    g_emb = emb.take_grads()
    g_meg = megatron_grads_as_hf(meg)  # reduces over the cell: must happen once per step
    flat = np.concatenate([g_meg[s.name].reshape(-1).numpy() for s in init.specs])
    out["grad_maxdiff"], out["grad_scale"] = float(np.abs(flat - g_emb).max()), float(np.abs(g_emb).max())
    meg.model.zero_grad_buffer()
    losses = []
    for _ in range(4):
        losses.append(meg.microstep(shard).loss)
        exported, _ = meg.apply([], num_executions=shard.num_executions)
        assert (exported is None) == (out["rank"] != 0)
    out["losses"] = losses
    out["final_weights_crc"] = zlib.crc32(meg.weights().data.tobytes())
    print(json.dumps(out), flush=True)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    worker(int(sys.argv[2]))
    leave()
