"""Typed mirror of conf/model/*.yaml."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str
    tokenizer: Literal["qwen", "qwen_compact"]
    """`qwen`: the full Qwen vocabulary; `qwen_compact`: its first `compact_ranks` BPE ranks + Qwen3 specials."""
    compact_ranks: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool
    init_seed: int
    """Seed of the random init: every cell builds bit-identical version-0 weights from it."""

    def check(self) -> None:
        if not 256 <= self.compact_ranks <= 151643:
            raise ValueError(f"compact_ranks: want 256..151643, got {self.compact_ranks}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads: want a multiple of num_key_value_heads")
