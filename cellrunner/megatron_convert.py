"""Qwen3 weights between Hugging Face names and megatron-core GPTModel names, per TP rank.

Pure tensor bookkeeping (no megatron import, no process group), so it is tested exactly and
reused for anything laid out like the parameters: weights, gradients, Adam moments.

The layouts (megatron-core 0.16 ``SelfAttention``/``MLP``, HF ``Qwen3ForCausalLM``):

- ``linear_qkv.weight`` is ``[q_0..q_{hpg-1}, k, v]`` per query group, groups stacked:
  ``[groups, hpg + 2, head_dim, hidden]``. HF keeps ``q_proj`` / ``k_proj`` / ``v_proj`` apart,
  query head ``h`` in group ``h // hpg`` (the order ``repeat_kv`` uses). TP splits groups.
- ``linear_fc1.weight`` is ``[gate; up]`` *per TP rank* (megatron's ``partition_stride=2``): rank
  ``r`` holds ``[gate_r; up_r]``, so shards are not slices of one full ``[gate; up]``.
- ``linear_proj`` / ``linear_fc2`` are row-parallel (split on dim 1); norms are replicated.
- The vocabulary is padded to a multiple of ``pad_to x tp`` rows (VocabParallelEmbedding needs
  an even split); padded rows are zero here and masked out of the log-softmax by the trainer.
- Tied embeddings: megatron's ``output_layer`` does not exist on a one-stage model and is a copy
  of the embedding on the last stage; HF has no ``lm_head.weight`` then.
- The "local" layer spec names its norms ``input_layernorm`` / ``pre_mlp_layernorm``; the
  Transformer Engine spec fuses them into ``linear_qkv.layer_norm_weight`` /
  ``linear_fc1.layer_norm_weight`` (dense MLP only; a MoE layer keeps ``pre_mlp_layernorm``).
- MoE (Qwen3-MoE checkpoints, per-expert names as on disk and as SGLang loads them):
  ``mlp.router.weight`` <-> ``mlp.gate.weight``; expert ``e`` of SequentialMLP
  ``mlp.experts.local_experts.{e}.linear_fc1/2`` <-> ``mlp.experts.{e}.gate_proj/up_proj/down_proj``.
  Experts are not split by TP here (expert TP = 1); expert parallelism is ``ep_size`` x
  ``ep_rank`` over the expert index.

Megatron names below carry *global* layer indices; a pipeline stage maps them to its local ones.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

LayerSpec = Literal["local", "transformer_engine"]
HF_INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True, kw_only=True)
class Qwen3Layout:
    """What the conversion needs to know about one Qwen3 (dense or MoE) model."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tied_embeddings: bool
    num_experts: int = 0
    """0 for a dense model."""
    moe_ffn_hidden_size: int = 0
    moe_layers: tuple[int, ...] = ()
    """Layers whose MLP is a MoE (Qwen3-MoE's ``decoder_sparse_step`` / ``mlp_only_layers``)."""
    layer_spec: LayerSpec = "local"

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers


def padded_vocab_size(vocab_size: int, *, pad_to: int, tp_size: int) -> int:
    multiple = pad_to * tp_size
    return -(-vocab_size // multiple) * multiple


def layout_from_hf(hf: Any, *, pad_to: int, tp_size: int, layer_spec: LayerSpec) -> Qwen3Layout:
    """From a transformers ``Qwen3Config`` or ``Qwen3MoeConfig`` (or anything with its fields)."""
    num_experts = int(getattr(hf, "num_local_experts", 0) or getattr(hf, "num_experts", 0) or 0)
    moe_layers: tuple[int, ...] = ()
    if num_experts:
        step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
        dense_only = set(getattr(hf, "mlp_only_layers", None) or ())
        moe_layers = tuple(i for i in range(hf.num_hidden_layers) if i not in dense_only and (i + 1) % step == 0)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return Qwen3Layout(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=head_dim,
        ffn_hidden_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        padded_vocab_size=padded_vocab_size(hf.vocab_size, pad_to=pad_to, tp_size=tp_size),
        tied_embeddings=bool(hf.tie_word_embeddings),
        num_experts=num_experts,
        moe_ffn_hidden_size=int(getattr(hf, "moe_intermediate_size", 0) or 0) if num_experts else 0,
        moe_layers=moe_layers,
        layer_spec=layer_spec,
    )


# ---------------------------------------------------------------- names


def hf_names(layout: Qwen3Layout) -> list[str]:
    """Every HF tensor name, in ``Qwen3ForCausalLM.named_parameters()`` order for dense models
    (so a FlatWeights manifest built from these equals ``cellrunner.model.param_specs``)."""
    names = ["model.embed_tokens.weight"]
    for i in range(layout.num_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        if layout.is_moe(i):
            names.append(f"{p}.mlp.gate.weight")
            for e in range(layout.num_experts):
                names += [f"{p}.mlp.experts.{e}.{x}_proj.weight" for x in ("gate", "up", "down")]
        else:
            names += [f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not layout.tied_embeddings:
        names.append("lm_head.weight")
    return names


def hf_shapes(layout: Qwen3Layout) -> dict[str, tuple[int, ...]]:
    h, hd = layout.hidden_size, layout.head_dim
    out: dict[str, tuple[int, ...]] = {}
    for name in hf_names(layout):
        leaf = name.rsplit(".", 2)[-2]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            shape: tuple[int, ...] = (layout.vocab_size, h)
        elif leaf == "q_proj":
            shape = (layout.num_heads * hd, h)
        elif leaf in ("k_proj", "v_proj"):
            shape = (layout.num_kv_heads * hd, h)
        elif leaf == "o_proj":
            shape = (h, layout.num_heads * hd)
        elif leaf in ("q_norm", "k_norm"):
            shape = (hd,)
        elif leaf == "gate" and ".mlp.gate." in name:
            shape = (layout.num_experts, h)
        elif leaf in ("gate_proj", "up_proj"):
            shape = (layout.moe_ffn_hidden_size if ".experts." in name else layout.ffn_hidden_size, h)
        elif leaf == "down_proj":
            shape = (h, layout.moe_ffn_hidden_size if ".experts." in name else layout.ffn_hidden_size)
        else:  # norms
            shape = (h,)
        out[name] = shape
    return out


def _norm_names(layout: Qwen3Layout, layer: int) -> tuple[str, str]:
    p = f"decoder.layers.{layer}"
    if layout.layer_spec == "transformer_engine":
        pre_mlp = f"{p}.pre_mlp_layernorm.weight" if layout.is_moe(layer) else f"{p}.mlp.linear_fc1.layer_norm_weight"
        return f"{p}.self_attention.linear_qkv.layer_norm_weight", pre_mlp
    return f"{p}.input_layernorm.weight", f"{p}.pre_mlp_layernorm.weight"


def megatron_names(layout: Qwen3Layout, *, ep_size: int = 1, ep_rank: int = 0) -> list[str]:
    """The megatron tensors of one TP rank (global layer indices; this EP rank's experts)."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(layout.num_layers):
        p = f"decoder.layers.{i}"
        ln_in, ln_mlp = _norm_names(layout, i)
        names += [ln_in, f"{p}.self_attention.linear_qkv.weight", f"{p}.self_attention.q_layernorm.weight",
                  f"{p}.self_attention.k_layernorm.weight", f"{p}.self_attention.linear_proj.weight", ln_mlp]
        if layout.is_moe(i):
            names.append(f"{p}.mlp.router.weight")
            for e in range(layout.num_experts // ep_size):
                names += [f"{p}.mlp.experts.local_experts.{e}.linear_fc{k}.weight" for k in (1, 2)]
        else:
            names += [f"{p}.mlp.linear_fc1.weight", f"{p}.mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    if not layout.tied_embeddings:
        names.append("output_layer.weight")
    return names


# ---------------------------------------------------------------- HF -> megatron


def _split(t: torch.Tensor, parts: int, index: int, dim: int) -> torch.Tensor:
    if t.shape[dim] % parts:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} does not split into {parts} tensor-parallel parts")
    return torch.chunk(t, parts, dim=dim)[index].clone()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def _qkv(layout: Qwen3Layout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, hpg, hd, h = layout.num_kv_heads, layout.heads_per_group, layout.head_dim, layout.hidden_size
    fused = torch.cat([q.reshape(g, hpg, hd, h), k.reshape(g, 1, hd, h), v.reshape(g, 1, hd, h)], dim=1)
    return fused.reshape(g * (hpg + 2) * hd, h)


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], layout: Qwen3Layout, *, tp_size: int = 1, tp_rank: int = 0,
    ep_size: int = 1, ep_rank: int = 0, layers: Iterable[int] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's megatron tensors from full HF tensors. ``layers`` limits the decoder layers
    (a pipeline stage's); embeddings and final norm are always returned, the caller keeps what
    its stage owns."""
    if layout.num_kv_heads % tp_size:
        raise ValueError(f"num_key_value_heads {layout.num_kv_heads} is not a multiple of TP {tp_size}")
    if layout.num_experts % ep_size:
        raise ValueError(f"{layout.num_experts} experts do not split over expert parallelism {ep_size}")
    want = set(range(layout.num_layers) if layers is None else layers)
    out: dict[str, torch.Tensor] = {}

    def vocab(t: torch.Tensor) -> torch.Tensor:
        return _split(_pad_rows(t, layout.padded_vocab_size), tp_size, tp_rank, 0)

    out["embedding.word_embeddings.weight"] = vocab(hf["model.embed_tokens.weight"])
    if not layout.tied_embeddings:
        out["output_layer.weight"] = vocab(hf["lm_head.weight"])
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
    for i in sorted(want):
        p, m = f"model.layers.{i}", f"decoder.layers.{i}"
        ln_in, ln_mlp = _norm_names(layout, i)
        out[ln_in] = hf[f"{p}.input_layernorm.weight"].clone()
        out[ln_mlp] = hf[f"{p}.post_attention_layernorm.weight"].clone()
        qkv = _qkv(layout, hf[f"{p}.self_attn.q_proj.weight"], hf[f"{p}.self_attn.k_proj.weight"],
                   hf[f"{p}.self_attn.v_proj.weight"])
        out[f"{m}.self_attention.linear_qkv.weight"] = _split(qkv, tp_size, tp_rank, 0)
        out[f"{m}.self_attention.q_layernorm.weight"] = hf[f"{p}.self_attn.q_norm.weight"].clone()
        out[f"{m}.self_attention.k_layernorm.weight"] = hf[f"{p}.self_attn.k_norm.weight"].clone()
        out[f"{m}.self_attention.linear_proj.weight"] = _split(hf[f"{p}.self_attn.o_proj.weight"], tp_size, tp_rank, 1)
        if layout.is_moe(i):
            out[f"{m}.mlp.router.weight"] = hf[f"{p}.mlp.gate.weight"].clone()
            per_rank = layout.num_experts // ep_size
            for local in range(per_rank):
                e = ep_rank * per_rank + local
                x = f"{p}.mlp.experts.{e}"
                out[f"{m}.mlp.experts.local_experts.{local}.linear_fc1.weight"] = torch.cat(
                    [hf[f"{x}.gate_proj.weight"], hf[f"{x}.up_proj.weight"]], dim=0)
                out[f"{m}.mlp.experts.local_experts.{local}.linear_fc2.weight"] = hf[f"{x}.down_proj.weight"].clone()
        else:
            gate = _split(hf[f"{p}.mlp.gate_proj.weight"], tp_size, tp_rank, 0)
            up = _split(hf[f"{p}.mlp.up_proj.weight"], tp_size, tp_rank, 0)
            out[f"{m}.mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
            out[f"{m}.mlp.linear_fc2.weight"] = _split(hf[f"{p}.mlp.down_proj.weight"], tp_size, tp_rank, 1)
    return out


# ---------------------------------------------------------------- megatron -> HF


def megatron_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]], layout: Qwen3Layout, *,
    ep_size: int = 1, ep_rank: int = 0, layers: Iterable[int] | None = None,
) -> dict[str, torch.Tensor]:
    """Full HF tensors from the megatron tensors of every TP rank (``shards[r]`` = TP rank r).

    Returns the decoder layers in ``layers`` (default all) and, when present in the shards, the
    embedding, final norm and output layer; with ``ep_size > 1`` only this EP rank's experts.
    """
    tp = len(shards)
    if tp < 1:
        raise ValueError("megatron_to_hf: no shards")
    want = set(range(layout.num_layers) if layers is None else layers)
    first = shards[0]
    out: dict[str, torch.Tensor] = {}

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    if "embedding.word_embeddings.weight" in first:
        out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)[: layout.vocab_size].clone()
    if not layout.tied_embeddings and "output_layer.weight" in first:
        out["lm_head.weight"] = cat("output_layer.weight", 0)[: layout.vocab_size].clone()
    if "decoder.final_layernorm.weight" in first:
        out["model.norm.weight"] = first["decoder.final_layernorm.weight"].clone()
    g, hpg, hd, h = layout.num_kv_heads, layout.heads_per_group, layout.head_dim, layout.hidden_size
    for i in sorted(want):
        p, m = f"model.layers.{i}", f"decoder.layers.{i}"
        ln_in, ln_mlp = _norm_names(layout, i)
        qkv = cat(f"{m}.self_attention.linear_qkv.weight", 0).reshape(g, hpg + 2, hd, h)
        q, k, v = torch.split(qkv, [hpg, 1, 1], dim=1)
        out[f"{p}.self_attn.q_proj.weight"] = q.reshape(g * hpg * hd, h).clone()
        out[f"{p}.self_attn.k_proj.weight"] = k.reshape(g * hd, h).clone()
        out[f"{p}.self_attn.v_proj.weight"] = v.reshape(g * hd, h).clone()
        out[f"{p}.self_attn.o_proj.weight"] = cat(f"{m}.self_attention.linear_proj.weight", 1)
        out[f"{p}.self_attn.q_norm.weight"] = first[f"{m}.self_attention.q_layernorm.weight"].clone()
        out[f"{p}.self_attn.k_norm.weight"] = first[f"{m}.self_attention.k_layernorm.weight"].clone()
        if layout.is_moe(i):
            out[f"{p}.mlp.gate.weight"] = first[f"{m}.mlp.router.weight"].clone()
            per_rank = layout.num_experts // ep_size
            for local in range(per_rank):
                x = f"{p}.mlp.experts.{ep_rank * per_rank + local}"
                fc1 = first[f"{m}.mlp.experts.local_experts.{local}.linear_fc1.weight"]
                gate, up = torch.chunk(fc1, 2, dim=0)
                out[f"{x}.gate_proj.weight"], out[f"{x}.up_proj.weight"] = gate.clone(), up.clone()
                out[f"{x}.down_proj.weight"] = first[f"{m}.mlp.experts.local_experts.{local}.linear_fc2.weight"].clone()
        else:
            halves = [torch.chunk(s[f"{m}.mlp.linear_fc1.weight"], 2, dim=0) for s in shards]
            out[f"{p}.mlp.gate_proj.weight"] = torch.cat([gu[0] for gu in halves], dim=0)
            out[f"{p}.mlp.up_proj.weight"] = torch.cat([gu[1] for gu in halves], dim=0)
            out[f"{p}.mlp.down_proj.weight"] = cat(f"{m}.mlp.linear_fc2.weight", 1)
        out[f"{p}.input_layernorm.weight"] = first[ln_in].clone()
        out[f"{p}.post_attention_layernorm.weight"] = first[ln_mlp].clone()
    return out


# ---------------------------------------------------------------- HF safetensors on disk


def load_hf_safetensors(directory: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint folder: ``model.safetensors`` or the shards its index names."""
    from safetensors.torch import load_file

    index = os.path.join(directory, HF_INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: want a 'weight_map' of tensor name -> file name")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no .safetensors files")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        if os.path.basename(name) != name:  # an index must not point outside the folder
            raise ValueError(f"{index}: file name {name!r} is not a plain file name")
        out.update(load_file(os.path.join(directory, name)))
    return out


def save_hf_safetensors(tensors: Mapping[str, torch.Tensor], directory: str, *,
                        max_shard_bytes: int = 4 << 30) -> list[str]:
    """Write tensors as HF-style safetensors shards plus the index; returns the file names."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().contiguous().cpu()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, HF_INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return files
