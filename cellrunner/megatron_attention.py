"""Core attention for ``layer_spec: local``: torch's fused scaled-dot-product attention.

megatron-core 0.16.1's local spec builds ``DotProductAttention`` (``transformer/
dot_product_attention.py``): a ``baddbmm`` into a ``[b*heads, s, s]`` score buffer, a softmax, a
``bmm``, with the key/value heads copied out to every query head. That is quadratic in the
sequence (a 32k-token sequence with 32 heads holds 128 GiB of float32 scores per layer), so the
harness's 20k-100k-token sequences do not fit. Its ``attention_backend`` setting only steers
Transformer Engine (NVTE_* variables, ``language_module.py``), and the one non-TE alternative it
names, Kitchen's ``sdpa``, needs NVIDIA's Kitchen package. So the local spec gets this module in
the same slot: the same constructor and ``forward`` contract as ``DotProductAttention``, computed
by ``torch.nn.functional.scaled_dot_product_attention``, which picks FlashAttention or the
memory-efficient kernel on CUDA (no score matrix is kept) and a fused math path on the CPU.
Grouped key/value heads go in as they are (``enable_gqa``), not repeated.

What it does not take, it refuses: an explicit attention mask or bias, packed (THD) sequences,
dropout, sliding windows and softmax variants. Gyre's batches are right-padded and causal (the
trainer passes no mask), Qwen3 has none of the others.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


class SDPAttention(MegatronModule):
    """``DotProductAttention``'s contract: query ``[sq, b, heads/tp, d]``, key and value
    ``[sk, b, groups/tp, d]``, output ``[sq, b, heads/tp * d]``."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention: context parallelism needs Transformer Engine (layer_spec=transformer_engine)")
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) != 0.0:
            raise ValueError("SDPAttention: attention dropout is not supported (Qwen3 has none)")
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise ValueError("SDPAttention: sliding windows and softmax variants are not supported")
        if config.apply_query_key_layer_scaling:
            raise ValueError("SDPAttention: apply_query_key_layer_scaling is not supported")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention: causal attention only, not {attn_mask_type}")
        tp = config.tensor_model_parallel_size
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention: causal only; no attention mask, bias or packed sequences")
        sq, b = query.shape[0], query.shape[1]
        # [s, b, h, d] -> [b, h, s, d], the layout SDPA takes
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             enable_gqa=self.heads != self.groups)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)
