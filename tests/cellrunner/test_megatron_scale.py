"""trainer=megatron at scale, on CPU (megatron-core 0.16.1 through gloo, the shims of
``megatron_cpu_shims``): what a 20k-100k-token, many-expert run needs, checked on tiny models.

- Expert parallelism: with EP 2 over two real processes, ``weights()`` gathers the experts from
  the rank that holds them; the export equals the EP 1 export of the same start weights, and a
  replica started from it (EP 2 or EP 1) exports the same again; a satellite's version 0 read from
  the folder equals it too.
- Expert names: a Qwen3-MoE folder with per-expert names (``save_pretrained``, SGLang's) and one
  with transformers 5's fused names read as the same tensors, start the same replica, and
  ``save_hf_safetensors`` writes either.
- Shard by shard: each rank opens only the safetensors files that hold its own tensors; a bf16
  export holds no float32 tensor bigger than one HF tensor, and nothing the size of the model but
  its one bf16 result.
- Attention and recompute: torch SDPA gives megatron's unfused attention's log-probs and
  gradient; full and selective recompute give the step without recompute.
- Log-probs, a chunk at a time, equal the old whole-block ``vocab_parallel_cross_entropy`` ones
  and their gradient, and no full-vocabulary float32 block of the whole sequence is ever made.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
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

from torch.utils._python_dispatch import TorchDispatchMode

from cellrunner.config import ModelConfig
from cellrunner.gspo import pack
from cellrunner.megatron_convert import HFFolder, load_hf_safetensors, save_hf_safetensors
from cellrunner.megatron_logprobs import chunked_token_logprobs
from cellrunner.megatron_trainer import MegatronTrainer
from cellrunner.model import initial_weights
from base.typed_config import build
from tests.cellrunner.test_megatron_trainer import VOCAB, algo_cfg, make_shard, megatron_cfg, model_cfg


def moe_hf_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_local_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True,
                          tie_word_embeddings=False, max_position_embeddings=256)


def moe_folders(root: Path) -> dict[str, Path]:
    """One seeded tiny Qwen3-MoE in three folders: ``per_expert`` (``save_pretrained``), ``fused``
    (the model's own state dict: transformers 5's in-memory names) and ``split`` (per expert,
    one tensor per safetensors file, with the index)."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(moe_hf_config()).float()
    out = {k: root / k for k in ("per_expert", "fused", "split")}
    model.save_pretrained(out["per_expert"])
    out["fused"].mkdir()
    shutil.copy(out["per_expert"] / "config.json", out["fused"] / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state  # transformers 5 holds experts fused
    save_file(state, str(out["fused"] / "model.safetensors"), metadata={"format": "pt"})
    save_hf_safetensors(load_hf_safetensors(str(out["per_expert"])), str(out["split"]), max_shard_bytes=1)
    shutil.copy(out["per_expert"] / "config.json", out["split"] / "config.json")
    return out


def moe_model_cfg(path: Path) -> ModelConfig:
    return build(ModelConfig, {**yaml.safe_load(open(ROOT / "conf/model/qwen3_hf.yaml")), "path": str(path),
                               "tokenizer": "qwen_compact"})


def as_tensors(w) -> dict[str, torch.Tensor]:
    t = w.tensor()
    return {s.name: t[s.offset : s.offset + int(np.prod(s.shape))].view(*s.shape) for s in w.specs}


# ---------------------------------------------------------------- expert names


def test_fused_and_per_expert_folders_read_and_start_the_same(tmp_path):
    folders = moe_folders(tmp_path)
    per_expert, fused = HFFolder(str(folders["per_expert"])), HFFolder(str(folders["fused"]))
    assert fused.fused_experts and not per_expert.fused_experts
    assert set(per_expert) == set(fused) and "model.layers.1.mlp.experts.3.up_proj.weight" in fused
    for name in per_expert:
        assert torch.equal(per_expert[name], fused[name]), name
    # The writer writes either layout; both read back as the same per-expert tensors.
    tensors = load_hf_safetensors(str(folders["per_expert"]))
    save_hf_safetensors(tensors, str(tmp_path / "w_fused"), experts="fused")
    written = HFFolder(str(tmp_path / "w_fused"))
    assert written.fused_experts and "model.layers.1.mlp.experts.gate_up_proj" in written._where
    assert all(torch.equal(written[n], t) for n, t in tensors.items())
    # A replica started from each folder exports the same; a satellite's version 0, read from
    # either folder, is that export (the names and bytes the controller's digest compares).
    exports = []
    for key in ("per_expert", "fused"):
        meg = MegatronTrainer(model_cfg=moe_model_cfg(folders[key]), algo=algo_cfg(), vocab_size=VOCAB,
                              is_core=True, megatron=megatron_cfg())
        meg.start(None)
        exports.append(meg.weights())
    assert exports[0].specs == exports[1].specs and np.array_equal(exports[0].data, exports[1].data)
    for key in ("per_expert", "fused"):
        sat = initial_weights(moe_model_cfg(folders[key]), VOCAB)
        assert sat.specs == exports[0].specs and np.array_equal(sat.data, exports[0].data), key


# ---------------------------------------------------------------- expert parallelism, two processes


def test_expert_parallel_export_equals_ep1_and_restarts_equal(tmp_path):
    folders = moe_folders(tmp_path)
    r0, r1 = run_ranks(__file__, ["--worker-ep", str(folders["split"]), str(tmp_path)])
    for r in (r0, r1):
        assert r["export_equals_disk"] and r["restart_equal"], r
    assert r0["leader_export_equal"] is True and r1["leader_export_equal"] is None  # only rank 0 assembles
    # Each rank opened only the files of its own tensors: its experts, not the other rank's.
    index = json.loads((folders["split"] / "model.safetensors.index.json").read_text())["weight_map"]
    files_of = lambda rank: {index[f"model.layers.1.mlp.experts.{e}.{x}_proj.weight"]  # noqa: E731
                             for e in (2 * rank, 2 * rank + 1) for x in ("gate", "up", "down")}
    for rank, r in enumerate((r0, r1)):
        opened = set(r["opened"])
        assert files_of(rank) <= opened and not files_of(1 - rank) & opened, (rank, sorted(opened))
        assert len(opened) == len(set(index.values())) - 6  # everything but the other rank's 6 expert tensors
    # The EP 2 export is the EP 1 export of the same start weights, and an EP 1 replica started
    # from it exports it again (another layout, the same model).
    ep2 = np.load(tmp_path / "ep2.npy")
    meg = MegatronTrainer(model_cfg=moe_model_cfg(folders["split"]), algo=algo_cfg(), vocab_size=VOCAB,
                          is_core=True, megatron=megatron_cfg())
    meg.start(None)
    ep1 = meg.weights()
    assert np.array_equal(ep1.data, ep2)
    other = MegatronTrainer(model_cfg=moe_model_cfg(folders["split"]), algo=algo_cfg(), vocab_size=VOCAB,
                            is_core=False, megatron=megatron_cfg())
    other.start(dataclasses.replace(ep1, data=ep2.copy()))
    assert np.array_equal(other.weights().data, ep2)
    assert np.array_equal(initial_weights(moe_model_cfg(folders["split"]), VOCAB).data, ep2)  # a satellite's start


def test_the_layout_check_no_longer_reports_ep_export_as_missing(capsys):
    from controller import layout

    stack = ["engine=sglang", "trainer=megatron", "transfer=mooncake", "cluster.ranks_per_node=8",
             "engine.weight_dir=/shared/w"]  # the sbatch recipes' GPU stack
    layout.main(["qwen3_235b_a22b", "--nodes-per-cell", "48", "--gpus-per-node", "8", *stack])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ok"] and out["trainer"]["ep"] > 1, out["why"]
    assert not [n for n in out["not_built"] if n.startswith("weights:")], out["not_built"]


def test_expert_parallel_ranks_run_the_same_number_of_microbatches():
    """With EP > 1 each MoE layer's all-to-all is a collective: a DP rank with one microbatch fewer
    would leave its peers waiting. The short ranks get an idle batch (every target masked out),
    which adds nothing to the loss or the gradient."""
    from cellrunner.gspo import gspo_loss
    from cellrunner.megatron_trainer import microbatches

    chunks = [[s] for s in make_shard(5, num_seqs=5).sequences]
    uneven = [microbatches(chunks, r, 2, even=False) for r in range(2)]
    assert [len(b) for b in uneven] == [3, 2]  # what hung an EP cell
    even = [microbatches(chunks, r, 2, even=True) for r in range(2)]
    assert [len(b) for b in even] == [3, 3]
    idle = even[1][-1]
    assert idle.num_targets == 0 and not idle.target_mask.any()
    logprobs = torch.full(idle.targets.shape, -5.0, requires_grad=True)
    loss, stats = gspo_loss(logprobs, idle, eps_low=0.2, eps_high=0.2)
    loss.backward()
    assert float(loss) == 0.0 and stats.num_targets == 0 and not logprobs.grad.any()
    assert microbatches([], 0, 2, even=True) == []


def worker_ep(folder: str, out_dir: str) -> None:
    """One of two ranks: EP 2 (DP 2 for the dense part) on a Qwen3-MoE folder."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(megatron_cfg(), expert_model_parallel_size=2)
    mcfg = moe_model_cfg(Path(folder))
    meg = MegatronTrainer(model_cfg=mcfg, algo=algo_cfg(), vocab_size=VOCAB, is_core=True, megatron=cfg)
    meg.start(None)
    rank = torch.distributed.get_rank()
    out: dict = {"rank": rank, "opened": list(meg.last_folder.opened)}
    w = meg.weights()
    disk = load_hf_safetensors(folder)
    out["export_equals_disk"] = set(disk) == {s.name for s in w.specs} and all(
        torch.equal(t, disk[n]) for n, t in as_tensors(w).items())
    lead = meg.weights(everywhere=False)
    out["leader_export_equal"] = None if lead is None else bool(np.array_equal(lead.data, w.data))
    again = MegatronTrainer(model_cfg=mcfg, algo=algo_cfg(), vocab_size=VOCAB, is_core=False, megatron=cfg)
    again.start(w)  # each EP rank converts its own experts out of the whole export
    out["restart_equal"] = bool(np.array_equal(again.weights().data, w.data))
    if rank == 0:
        np.save(Path(out_dir) / "ep2.npy", w.data)
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------- shard by shard, bf16


class LargestTensors(TorchDispatchMode):
    """Every tensor an op creates, by bytes and dtype (views share storage: counted by storage)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor) and a.device.type != "meta"}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().data_ptr() not in given:
                self.sizes.append((t.untyped_storage().nbytes(), t.dtype))  # new memory, not a view
        return out

    def largest(self, dtype: torch.dtype) -> int:
        return max((n for n, d in self.sizes if d == dtype), default=0)


def test_a_bf16_export_streams_without_a_float32_model_copy():
    cfg = model_cfg(num_hidden_layers=4)
    # A satellite's replica: megatron's bf16 optimizer (the core's) checks for CUDA tensor types.
    meg = MegatronTrainer(model_cfg=cfg, algo=algo_cfg(), vocab_size=VOCAB, is_core=False,
                          megatron=dataclasses.replace(megatron_cfg(), params_dtype="bfloat16"))
    meg.start(None)
    model_elems = sum(int(np.prod(s.shape)) for s in meg.specs)
    biggest_hf = max(int(np.prod(s.shape)) for s in meg.specs)
    assert model_elems > 8 * biggest_hf  # many tensors: a whole-model copy would stand out
    with LargestTensors() as seen:
        w = meg.weights(dtype=meg.params_weights_dtype)
    assert w.dtype == "bfloat16" and w.nbytes == 2 * model_elems
    assert seen.largest(torch.float32) <= 4 * biggest_hf, seen.largest(torch.float32)  # one tensor at a time
    assert seen.largest(torch.bfloat16) == 2 * model_elems  # the result itself, once
    assert sum(1 for n, _ in seen.sizes if n >= 2 * model_elems) == 1
    # The bf16 export is the float32 one rounded (exactly: the parameters are bf16).
    w32 = meg.weights()
    assert np.array_equal(w.tensor().float().numpy(), w32.data)


# ---------------------------------------------------------------- attention and recompute


def step_of(mcfg, shard) -> tuple[float, np.ndarray, torch.Tensor, str]:
    meg = MegatronTrainer(model_cfg=model_cfg(), algo=algo_cfg(eps_low=0.2, eps_high=10.0), vocab_size=VOCAB,
                          is_core=False, megatron=mcfg)
    meg.start(None)
    batch = pack(list(shard.sequences))
    with torch.no_grad():
        logits = meg.model(batch.input_ids, torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids), None)
        lp = meg.token_logprobs(logits, batch.targets)
    res = meg.microstep(shard)
    return res.loss, meg.take_grads(), lp, meg.attention_backend


def test_sdpa_attention_and_recompute_give_the_same_step():
    shard = make_shard(21)
    base = megatron_cfg()
    runs = {
        "unfused": dataclasses.replace(base, local_attention="unfused"),
        "sdpa": base,
        "sdpa+full": dataclasses.replace(base, recompute_granularity="full", recompute_method="uniform",
                                         recompute_num_layers=1),
        "sdpa+selective": dataclasses.replace(base, recompute_granularity="selective"),
        "unfused+block": dataclasses.replace(base, local_attention="unfused", recompute_granularity="full",
                                             recompute_method="block", recompute_num_layers=2),
    }
    out = {k: step_of(c, shard) for k, c in runs.items()}
    assert out["sdpa"][3] == "torch_sdpa" and out["unfused"][3] == "megatron_unfused"
    loss0, g0, lp0, _ = out["unfused"]
    scale = float(np.abs(g0).max())
    assert scale > 0
    for key, (loss, g, lp, _) in out.items():
        assert loss == pytest.approx(loss0, rel=1e-5), key
        torch.testing.assert_close(lp, lp0, rtol=0, atol=2e-5)
        np.testing.assert_allclose(g, g0, rtol=0, atol=1e-5 * scale, err_msg=key)


def test_the_model_runs_sdpa_and_recompute_as_configured():
    from cellrunner.megatron_attention import SDPAttention

    mcfg = dataclasses.replace(megatron_cfg(), recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=1)
    meg = MegatronTrainer(model_cfg=model_cfg(), algo=algo_cfg(), vocab_size=VOCAB, is_core=False, megatron=mcfg)
    meg.start(None)
    cores = [layer.self_attention.core_attention for layer in meg.model.module.decoder.layers]
    assert cores and all(isinstance(c, SDPAttention) for c in cores)
    assert meg.tconfig.recompute_granularity == "full" and meg.tconfig.recompute_num_layers == 1
    conf = yaml.safe_load(open(ROOT / "conf/trainer/megatron.yaml"))
    assert conf["local_attention"] == "sdpa" and conf["recompute_granularity"] == "full"


# ---------------------------------------------------------------- log-probs, chunked


def old_token_logprobs(logits, targets, temperature, pad_cols):
    """The trainer's log-probs before chunking: megatron's cross entropy on the whole block."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from cellrunner.megatron_setup import ensure_process_groups

    ensure_process_groups(megatron_cfg(), seed=0)  # one rank: megatron's TP group of one
    lg = logits[:, :-1].float() / temperature
    if pad_cols is not None:
        lg = lg.masked_fill(pad_cols, float("-inf"))
    ce = vocab_parallel_cross_entropy(lg.transpose(0, 1).contiguous(), targets.transpose(0, 1).contiguous())
    return -ce.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_equal_the_whole_block_and_hold_one_chunk(dtype):
    g = torch.Generator().manual_seed(3)
    b, length, vocab, real = 2, 96, 512, 500
    logits = (torch.randn(b, length, vocab, generator=g) * 3).to(dtype).requires_grad_(True)
    targets = torch.randint(0, real, (b, length - 1), generator=g)
    pad = torch.arange(vocab) >= real
    weights = torch.randn(b, length - 1, generator=g)
    want = old_token_logprobs(logits, targets, 0.7, pad)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), logits)
    with LargestTensors() as seen:
        got = chunked_token_logprobs(logits, targets, temperature=0.7, pad_cols=pad, chunk_tokens=16)
        (got_grad,) = torch.autograd.grad((got * weights).sum(), logits)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=0, atol=tol)
    # At most one chunk's full-vocabulary float32 block at a time (the logits' gradient, in the
    # logits' dtype, is the one whole-sequence tensor; in float32 only when the logits are).
    chunk_bytes = 16 * vocab * 4
    floats = sorted((n for n, d in seen.sizes if d == torch.float32), reverse=True)
    if dtype == torch.bfloat16:
        assert floats[0] <= chunk_bytes, floats[:3]
    else:
        assert floats[0] == b * length * vocab * 4 and floats[1] <= chunk_bytes, floats[:3]  # the gradient, then chunks
    with LargestTensors() as old:
        lp = old_token_logprobs(logits, targets, 0.7, pad)
        torch.autograd.grad((lp * weights).sum(), logits)
    whole = b * (length - 1) * vocab * 4
    assert sum(1 for n, d in old.sizes if d == torch.float32 and n >= whole) >= 3  # what the chunks avoid


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker-ep":
    worker_ep(sys.argv[2], sys.argv[3])
    leave()
