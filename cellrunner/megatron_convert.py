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
  ``ep_rank`` over the expert index. transformers 5 holds a layer's experts fused in memory
  (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, gate rows first, and ``mlp.experts.down_proj``
  ``[E, H, I]``: ``models/qwen3_moe/modeling_qwen3_moe.py``, ``conversion_mapping.py``'s
  ``qwen2_moe`` entry) and a folder saved from its state dict has those names; ``HFFolder``
  reads either layout as per-expert tensors, and ``save_hf_safetensors`` writes either.

Megatron names below carry *global* layer indices; a pipeline stage maps them to its local ones.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from base.wire import TensorSpec

if TYPE_CHECKING:  # cellrunner.model reads HF folders through this module
    from cellrunner.model import FlatWeights

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
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
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
    return dict(iter_hf_to_megatron(hf, layout, tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size,
                                    ep_rank=ep_rank, layers=layers))


def iter_hf_to_megatron(
    hf: Mapping[str, torch.Tensor], layout: Qwen3Layout, *, tp_size: int = 1, tp_rank: int = 0,
    ep_size: int = 1, ep_rank: int = 0, layers: Iterable[int] | None = None,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``hf_to_megatron`` one tensor at a time; ``keep(megatron_name)`` False skips a tensor
    without reading its HF sources (``hf`` may be a lazy ``HFFolder``: only what is kept is read)."""
    if layout.num_kv_heads % tp_size:
        raise ValueError(f"num_key_value_heads {layout.num_kv_heads} is not a multiple of TP {tp_size}")
    if layout.num_experts % ep_size:
        raise ValueError(f"{layout.num_experts} experts do not split over expert parallelism {ep_size}")
    want = set(range(layout.num_layers) if layers is None else layers)
    kept = keep or (lambda _: True)

    def vocab(t: torch.Tensor) -> torch.Tensor:
        return _split(_pad_rows(t, layout.padded_vocab_size), tp_size, tp_rank, 0)

    if kept("embedding.word_embeddings.weight"):
        yield "embedding.word_embeddings.weight", vocab(hf["model.embed_tokens.weight"])
    if not layout.tied_embeddings and kept("output_layer.weight"):
        yield "output_layer.weight", vocab(hf["lm_head.weight"])
    if kept("decoder.final_layernorm.weight"):
        yield "decoder.final_layernorm.weight", hf["model.norm.weight"].clone()
    for i in sorted(want):
        p, m = f"model.layers.{i}", f"decoder.layers.{i}"
        ln_in, ln_mlp = _norm_names(layout, i)
        if kept(ln_in):
            yield ln_in, hf[f"{p}.input_layernorm.weight"].clone()
        if kept(ln_mlp):
            yield ln_mlp, hf[f"{p}.post_attention_layernorm.weight"].clone()
        if kept(f"{m}.self_attention.linear_qkv.weight"):
            qkv = _qkv(layout, hf[f"{p}.self_attn.q_proj.weight"], hf[f"{p}.self_attn.k_proj.weight"],
                       hf[f"{p}.self_attn.v_proj.weight"])
            yield f"{m}.self_attention.linear_qkv.weight", _split(qkv, tp_size, tp_rank, 0)
        if kept(f"{m}.self_attention.q_layernorm.weight"):
            yield f"{m}.self_attention.q_layernorm.weight", hf[f"{p}.self_attn.q_norm.weight"].clone()
        if kept(f"{m}.self_attention.k_layernorm.weight"):
            yield f"{m}.self_attention.k_layernorm.weight", hf[f"{p}.self_attn.k_norm.weight"].clone()
        if kept(f"{m}.self_attention.linear_proj.weight"):
            yield f"{m}.self_attention.linear_proj.weight", _split(hf[f"{p}.self_attn.o_proj.weight"], tp_size, tp_rank, 1)
        if layout.is_moe(i):
            if kept(f"{m}.mlp.router.weight"):
                yield f"{m}.mlp.router.weight", hf[f"{p}.mlp.gate.weight"].clone()
            per_rank = layout.num_experts // ep_size
            for local in range(per_rank):
                x = f"{p}.mlp.experts.{ep_rank * per_rank + local}"
                fc1, fc2 = (f"{m}.mlp.experts.local_experts.{local}.linear_fc{k}.weight" for k in (1, 2))
                if kept(fc1):
                    yield fc1, torch.cat([hf[f"{x}.gate_proj.weight"], hf[f"{x}.up_proj.weight"]], dim=0)
                if kept(fc2):
                    yield fc2, hf[f"{x}.down_proj.weight"].clone()
        else:
            if kept(f"{m}.mlp.linear_fc1.weight"):
                gate = _split(hf[f"{p}.mlp.gate_proj.weight"], tp_size, tp_rank, 0)
                up = _split(hf[f"{p}.mlp.up_proj.weight"], tp_size, tp_rank, 0)
                yield f"{m}.mlp.linear_fc1.weight", torch.cat([gate, up], dim=0)
            if kept(f"{m}.mlp.linear_fc2.weight"):
                yield f"{m}.mlp.linear_fc2.weight", _split(hf[f"{p}.mlp.down_proj.weight"], tp_size, tp_rank, 1)


# ---------------------------------------------------------------- megatron -> HF


_TP_SPLIT = {"embedding.word_embeddings.weight": 0, "output_layer.weight": 0, "self_attention.linear_qkv.weight": 0,
             "self_attention.linear_proj.weight": 1, "mlp.linear_fc1.weight": 0, "mlp.linear_fc2.weight": 1}
_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def tp_split_dim(name: str) -> int | None:
    """The dimension TP splits a megatron tensor on, None when every TP rank holds all of it
    (norms, the router, experts: expert TP is 1)."""
    if name in _TP_SPLIT:
        return _TP_SPLIT[name]
    rest = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    return _TP_SPLIT.get(rest)


def is_expert(name: str) -> bool:
    return ".mlp.experts.local_experts." in name


def global_expert_name(name: str, *, ep_size: int, ep_rank: int, num_experts: int) -> str:
    """A rank's local expert name with the global expert index (what the name is at EP 1)."""
    m = _LOCAL_EXPERT.match(name)
    if m is None:
        return name
    per_rank = num_experts // ep_size
    return f"{m.group(1)}{ep_rank * per_rank + int(m.group(2))}{m.group(3)}"


def hf_from_megatron(name: str, shards: Sequence[torch.Tensor], layout: Qwen3Layout) -> dict[str, torch.Tensor]:
    """The HF tensors of one megatron tensor (global name, global expert index), from its TP
    shards in TP rank order (one shard for a tensor TP does not split)."""
    first = shards[0]

    def cat(dim: int) -> torch.Tensor:
        return first if len(shards) == 1 else torch.cat(list(shards), dim=dim)

    if name == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": cat(0)[: layout.vocab_size]}
    if name == "output_layer.weight":
        return {"lm_head.weight": cat(0)[: layout.vocab_size]}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": first}
    layer, rest = name[len("decoder.layers."):].split(".", 1)
    i = int(layer)
    p = f"model.layers.{i}"
    ln_in, ln_mlp = _norm_names(layout, i)
    if name == ln_in:
        return {f"{p}.input_layernorm.weight": first}
    if name == ln_mlp:
        return {f"{p}.post_attention_layernorm.weight": first}
    g, hpg, hd, h = layout.num_kv_heads, layout.heads_per_group, layout.head_dim, layout.hidden_size
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = torch.split(cat(0).reshape(g, hpg + 2, hd, h), [hpg, 1, 1], dim=1)
        return {f"{p}.self_attn.q_proj.weight": q.reshape(g * hpg * hd, h),
                f"{p}.self_attn.k_proj.weight": k.reshape(g * hd, h),
                f"{p}.self_attn.v_proj.weight": v.reshape(g * hd, h)}
    if rest == "self_attention.linear_proj.weight":
        return {f"{p}.self_attn.o_proj.weight": cat(1)}
    if rest == "self_attention.q_layernorm.weight":
        return {f"{p}.self_attn.q_norm.weight": first}
    if rest == "self_attention.k_layernorm.weight":
        return {f"{p}.self_attn.k_norm.weight": first}
    if rest == "mlp.router.weight":
        return {f"{p}.mlp.gate.weight": first}
    if rest == "mlp.linear_fc1.weight":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]  # each TP rank holds [gate_r; up_r]
        return {f"{p}.mlp.gate_proj.weight": torch.cat([gu[0] for gu in halves], dim=0),
                f"{p}.mlp.up_proj.weight": torch.cat([gu[1] for gu in halves], dim=0)}
    if rest == "mlp.linear_fc2.weight":
        return {f"{p}.mlp.down_proj.weight": cat(1)}
    m = _LOCAL_EXPERT.match(name)
    if m is not None:
        x = f"{p}.mlp.experts.{int(m.group(2))}"
        if m.group(3) == ".linear_fc1.weight":
            gate, up = torch.chunk(first, 2, dim=0)
            return {f"{x}.gate_proj.weight": gate, f"{x}.up_proj.weight": up}
        if m.group(3) == ".linear_fc2.weight":
            return {f"{x}.down_proj.weight": first}
    raise ValueError(f"hf_from_megatron: no HF tensor for megatron tensor {name!r}")


def megatron_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]], layout: Qwen3Layout, *,
    ep_size: int = 1, ep_rank: int = 0, layers: Iterable[int] | None = None,
) -> dict[str, torch.Tensor]:
    """Full HF tensors from the megatron tensors of every TP rank (``shards[r]`` = TP rank r).

    Returns the decoder layers in ``layers`` (default all) and, when present in the shards, the
    embedding, final norm and output layer; with ``ep_size > 1`` only this EP rank's experts.
    """
    if len(shards) < 1:
        raise ValueError("megatron_to_hf: no shards")
    want = set(range(layout.num_layers) if layers is None else layers)
    out: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        if name == "output_layer.weight" and layout.tied_embeddings:
            continue
        if name.startswith("decoder.layers.") and int(name.split(".")[2]) not in want:
            continue
        parts = [s[name] for s in shards] if tp_split_dim(name) is not None else [shards[0][name]]
        glob = global_expert_name(name, ep_size=ep_size, ep_rank=ep_rank, num_experts=layout.num_experts)
        out.update((n, t.clone()) for n, t in hf_from_megatron(glob, parts, layout).items())
    return out


# ---------------------------------------------------------------- HF safetensors on disk


_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up|down)_proj$")


class HFFolder(Mapping[str, torch.Tensor]):
    """An HF checkpoint folder read tensor by tensor, by per-expert names whichever way the folder
    stores experts (per expert, as ``save_pretrained`` and SGLang name them, or fused, as
    transformers 5 holds them in memory: one expert is then a slice of the fused tensor).

    The index (``model.safetensors.index.json``) says which file holds which tensor, so a rank
    opens only the files that hold what it reads; without an index each file's header is read
    (a header only, no tensor data). ``opened`` lists the files whose tensors were read."""

    def __init__(self, directory: str):
        self.directory = directory
        self.opened: list[str] = []
        self._handles: dict[str, Any] = {}
        self._where = self._weight_map()
        self._fused = {n for n in self._where if _FUSED.match(n)}
        self._names = self._per_expert_names()

    def _weight_map(self) -> dict[str, str]:
        from safetensors import safe_open

        index = os.path.join(self.directory, HF_INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{index}: want a 'weight_map' of tensor name -> file name")
            for name in set(weight_map.values()):
                if os.path.basename(name) != name:  # an index must not point outside the folder
                    raise ValueError(f"{index}: file name {name!r} is not a plain file name")
            return dict(weight_map)
        files = sorted(f for f in os.listdir(self.directory) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.directory}: no .safetensors files")
        out: dict[str, str] = {}
        for fname in files:
            with safe_open(os.path.join(self.directory, fname), framework="pt") as f:
                out.update((k, fname) for k in f.keys())
        return out

    def _per_expert_names(self) -> list[str]:
        names = []
        for n in self._where:
            m = _FUSED.match(n)
            if m is None:
                names.append(n)
                continue
            num = self._file(n).get_slice(n).get_shape()[0]
            parts = ("gate", "up") if m.group(2) == "gate_up" else ("down",)
            names += [f"{m.group(1)}.{e}.{x}_proj.weight" for e in range(num) for x in parts]
        return names

    def _file(self, name: str) -> Any:
        from safetensors import safe_open

        fname = self._where[name]
        if fname not in self._handles:
            path = os.path.join(self.directory, fname)
            if not os.path.exists(path):
                raise FileNotFoundError(f"{self.directory}: {fname} (named in the index) is missing")
            self._handles[fname] = safe_open(path, framework="pt")
            self.opened.append(fname)
        return self._handles[fname]

    @property
    def fused_experts(self) -> bool:
        return bool(self._fused)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._where:
            return self._file(name).get_tensor(name)
        m = _PER_EXPERT.match(name)
        if m is not None:
            prefix, e, part = m.group(1), int(m.group(2)), m.group(3)
            fused = f"{prefix}.{'down' if part == 'down' else 'gate_up'}_proj"
            if fused in self._fused:
                t = self._file(fused).get_slice(fused)[e : e + 1][0]  # this expert's rows only
                if part == "down":
                    return t
                gate, up = torch.chunk(t, 2, dim=0)
                return (gate if part == "gate" else up).contiguous()
        raise KeyError(f"{self.directory}: no tensor {name!r}")

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        if name in self._where:
            return True
        m = _PER_EXPERT.match(name) if isinstance(name, str) else None
        return m is not None and f"{m.group(1)}.{'down' if m.group(3) == 'down' else 'gate_up'}_proj" in self._fused

    def close(self) -> None:
        self._handles.clear()


def load_hf_safetensors(directory: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint folder, experts by per-expert name (``HFFolder``)."""
    folder = HFFolder(directory)
    return {n: folder[n] for n in folder}


def fuse_experts(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors as transformers 5 holds them: per layer ``mlp.experts.gate_up_proj``
    ``[E, 2I, H]`` (gate rows first) and ``mlp.experts.down_proj`` ``[E, H, I]``."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        out.setdefault(f"{m.group(1)}.gate_up_proj", None)  # keeps the layer's place in the order
        out.setdefault(f"{m.group(1)}.down_proj", None)
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        if ids != list(range(len(ids))) or any(set(by_expert[e]) != {"gate", "up", "down"} for e in ids):
            raise ValueError(f"fuse_experts: {prefix}: want gate, up and down of experts 0..n-1")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([by_expert[e]["gate"], by_expert[e]["up"]]) for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down"] for e in ids])
    return out


def save_hf_safetensors(tensors: Mapping[str, torch.Tensor], directory: str, *,
                        max_shard_bytes: int = 4 << 30, experts: Literal["per_expert", "fused"] = "per_expert") -> list[str]:
    """Write tensors as HF-style safetensors shards plus the index; returns the file names.
    Experts are written per expert (what SGLang's Qwen3-MoE loader and ``save_pretrained``
    use), or ``fused`` as transformers 5 holds them; ``HFFolder`` reads both."""
    from safetensors.torch import save_file

    if experts == "fused":
        tensors = fuse_experts(tensors)
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


# ---------------------------------------------------------------- flat HF weights


def hf_specs(layout: Qwen3Layout) -> tuple[TensorSpec, ...]:
    specs, offset = [], 0
    for name, shape in hf_shapes(layout).items():
        specs.append(TensorSpec(name=name, shape=list(shape), offset=offset))
        offset += int(np.prod(shape, dtype=np.int64))
    return tuple(specs)


def export_units(layout: Qwen3Layout) -> list[tuple[str, tuple[str, ...]]]:
    """The export's units, the same list on every rank: each megatron tensor (global name, global
    expert index) and the HF tensors it becomes. Found by converting empty ``meta`` tensors."""
    meta = {n: torch.empty(shape, device="meta") for n, shape in hf_shapes(layout).items()}
    return [(name, tuple(hf_from_megatron(name, [t], layout)))
            for name, t in iter_hf_to_megatron(meta, layout)]


def hf_tensors(weights: FlatWeights, layout: Qwen3Layout) -> dict[str, torch.Tensor]:
    """Views of a FlatWeights buffer as HF tensors; the manifest must be this model's."""
    want = {s.name: tuple(s.shape) for s in hf_specs(layout)}
    got = {s.name: tuple(s.shape) for s in weights.specs}
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(n for n in set(want) & set(got) if want[n] != got[n])
        raise ValueError(f"weights: manifest does not match this model (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}, wrong shape {wrong[:3]})")
    src = weights.tensor()
    out = {}
    for s in weights.specs:
        n = int(np.prod(s.shape, dtype=np.int64))
        out[s.name] = src[s.offset : s.offset + n].view(*s.shape)
    return out
