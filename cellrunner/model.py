"""The model every cell starts from, and its flat weights.

Version 0 is a local Hugging Face checkpoint (``model.path``: Qwen3 or Qwen3-MoE, loaded by
``transformers`` from the folder alone) or, without one, a Qwen3-architecture model built from
the config's sizes with a seeded init. Either way every cell builds the same version-0 weights.
Weights cross processes as one contiguous float32 buffer plus a manifest (name, shape, offset),
never as pickled state dicts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, Qwen3Config, Qwen3ForCausalLM

from cellrunner import hf_folder
from cellrunner.config import ModelConfig
from base.wire import TensorSpec, WeightsDtype


def vocab_rows(cfg: ModelConfig) -> int:
    """The model's embedding rows: the checkpoint's (padded past its tokenizer), else the tokenizer's."""
    if cfg.path:
        return hf_folder.vocab_rows(cfg.path)
    from base.tokenizer import get_tokenizer

    return get_tokenizer(cfg.tokenizer, cfg.compact_ranks).vocab_size


def hf_config(cfg: ModelConfig, vocab_size: int) -> PretrainedConfig:
    if cfg.path:
        hf_folder.read_config(cfg.path)  # a clear error for a folder that is not a Qwen3 checkpoint
        loaded = AutoConfig.from_pretrained(cfg.path, local_files_only=True)
        if loaded.vocab_size != vocab_size:
            raise ValueError(f"model.path: the checkpoint has {loaded.vocab_size} vocabulary rows, the cell was given {vocab_size}")
        return loaded
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_dropout=0.0,
        use_cache=True,
    )


def build_model(cfg: ModelConfig, vocab_size: int) -> torch.nn.Module:
    """Version 0 in float32: the checkpoint's weights, or the seeded init."""
    if cfg.path:
        config = hf_config(cfg, vocab_size)
        model = AutoModelForCausalLM.from_pretrained(cfg.path, config=config, torch_dtype=torch.float32,
                                                     local_files_only=True)
        return model.to(torch.float32)
    torch.manual_seed(cfg.init_seed)
    model = Qwen3ForCausalLM(hf_config(cfg, vocab_size))
    model.to(torch.float32)
    return model


def initial_weights(cfg: ModelConfig, vocab_size: int, dtype: WeightsDtype = "float32") -> FlatWeights:
    """Version 0 as a Megatron core exports it (HF names, experts per expert, in
    ``megatron_convert.hf_names`` order), without building a model for a checkpoint: each tensor
    is read from ``model.path`` (either expert layout, ``HFFolder``) straight into one flat
    buffer of ``dtype``. transformers 5 would build a Qwen3-MoE with its experts fused, so a
    satellite that flattened that model would start from other names than the core's export.
    Without a path it is the seeded init (``build_model``), cast."""
    from cellrunner.megatron_convert import HFFolder, hf_shapes, layout_from_hf

    layout = layout_from_hf(hf_config(cfg, vocab_size), pad_to=1, tp_size=1, layer_spec="local")
    specs, offset = [], 0
    for name, shape in hf_shapes(layout).items():
        specs.append(TensorSpec(name=name, shape=list(shape), offset=offset))
        offset += int(np.prod(shape, dtype=np.int64))
    flat = torch.empty(offset, dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    source = HFFolder(cfg.path) if cfg.path else dict(build_model(cfg, vocab_size).named_parameters())
    with torch.no_grad():
        for spec in specs:
            if spec.name not in source:
                raise ValueError(f"model.path: {cfg.path} has no tensor {spec.name}")
            t = source[spec.name]
            if list(t.shape) != spec.shape:
                raise ValueError(f"model.path: {spec.name} has shape {list(t.shape)}, the config says {spec.shape}")
            flat[spec.offset : spec.offset + t.numel()] = t.reshape(-1)
    data = flat.view(torch.int16).numpy().view(np.uint16) if flat.dtype == torch.bfloat16 else flat.numpy()
    return FlatWeights(0, tuple(specs), data)


def max_positions(cfg: ModelConfig) -> int:
    """The longest sequence the model takes: the checkpoint's ``max_position_embeddings``, else the config's."""
    return hf_folder.read_config(cfg.path)["max_position_embeddings"] if cfg.path else cfg.max_position_embeddings


@dataclass(frozen=True)
class FlatWeights:
    """All parameters of one weight version in one float32 array, in `named_parameters` order."""

    version: int
    specs: tuple[TensorSpec, ...]
    data: np.ndarray
    """float32, 1-D; or bfloat16 as its raw bits in a uint16 array (a serving copy, ``to_bf16``);
    a torch CUDA tensor when a Mooncake pull landed in GPU memory."""

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) if isinstance(self.data, np.ndarray) else self.data.numel() * self.data.element_size()

    @property
    def dtype(self) -> WeightsDtype:
        if isinstance(self.data, np.ndarray):
            return "bfloat16" if self.data.dtype == np.uint16 else "float32"
        return "bfloat16" if self.data.dtype == torch.bfloat16 else "float32"

    @property
    def num_elements(self) -> int:
        return int(self.data.size) if isinstance(self.data, np.ndarray) else int(self.data.numel())

    def tensor(self) -> torch.Tensor:
        """The data as a torch tensor, without a copy (CPU for numpy, as it is for a tensor);
        torch.bfloat16 for a serving copy."""
        if not isinstance(self.data, np.ndarray):
            return self.data
        t = torch.from_numpy(self.data)
        return t.view(torch.bfloat16) if self.data.dtype == np.uint16 else t


def to_bf16(weights: FlatWeights) -> FlatWeights:
    """The serving copy: every value rounded to bfloat16 (what an engine serving in bf16 loads
    anyway), half the bytes on the wire."""
    t = weights.tensor().to(torch.bfloat16)
    data = t.view(torch.int16).numpy().view(np.uint16) if t.device.type == "cpu" else t
    return FlatWeights(weights.version, weights.specs, data)


def param_specs(model: torch.nn.Module) -> tuple[TensorSpec, ...]:
    specs, offset = [], 0
    for name, p in model.named_parameters():
        specs.append(TensorSpec(name=name, shape=list(p.shape), offset=offset))
        offset += p.numel()
    return tuple(specs)


def num_elements(specs: tuple[TensorSpec, ...]) -> int:
    last = specs[-1]
    return last.offset + int(np.prod(last.shape, dtype=np.int64))


def flatten_params(model: torch.nn.Module, version: int) -> FlatWeights:
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).to(torch.float32)
    return FlatWeights(version, param_specs(model), flat.numpy().copy())


def weights_digest(weights: FlatWeights) -> str:
    """BLAKE2b-128 over the manifest and the float32 bytes: equal digests, equal version-0 weights."""
    h = hashlib.blake2b(digest_size=16)
    for spec in weights.specs:
        h.update(f"{spec.name}:{spec.shape}:{spec.offset};".encode())
    h.update(weights.dtype.encode())
    data = weights.data if isinstance(weights.data, np.ndarray) else weights.data.detach().cpu().view(torch.int16).numpy()
    h.update(np.ascontiguousarray(data).data)
    return h.hexdigest()


def flatten_grads(model: torch.nn.Module) -> np.ndarray:
    parts = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
        for p in model.parameters()
    ]
    return torch.cat(parts).to(torch.float32).numpy().copy()


def load_flat(model: torch.nn.Module, weights: FlatWeights) -> None:
    """Copy a flat buffer into the model; the manifest must match the model's parameters."""
    own = param_specs(model)
    if [(s.name, s.shape) for s in own] != [(s.name, s.shape) for s in weights.specs]:
        raise ValueError("weights: manifest does not match this model's parameters")
    src = weights.tensor()
    with torch.no_grad():
        for spec, p in zip(own, model.parameters()):
            n = p.numel()
            p.copy_(src[spec.offset : spec.offset + n].view_as(p))
