"""What a local Hugging Face checkpoint folder must hold for ``model.path``, checked without torch.

The controller checks the folder before it starts a cell, so a typo in ``model.path`` or a
checkpoint of another architecture is one clear line at submit time, not a traceback on 48 nodes.
Standard library only: the controller and the proxy import it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


class CheckpointError(ValueError):
    pass


def read_config(path: str) -> dict[str, Any]:
    """The folder's config.json, refused unless it is a Qwen3 or Qwen3-MoE causal LM."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"model.path: {path!r} is not a folder (a local Hugging Face checkpoint; nothing is downloaded)")
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"model.path: {path}/config.json: {exc}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"model.path: {path}/config.json: want an object")
    kind = cfg.get("model_type")
    if kind not in ARCHITECTURES:
        raise CheckpointError(f"model.path: {path} is a {kind!r} model; Gyre runs {sorted(ARCHITECTURES)}")
    for key in ("vocab_size", "max_position_embeddings"):
        if type(cfg.get(key)) is not int or cfg[key] < 1:
            raise CheckpointError(f"model.path: {path}/config.json: want a positive int {key}, got {cfg.get(key)!r}")
    return cfg


def vocab_rows(path: str) -> int:
    """Embedding rows as the checkpoint pads them (Qwen3: 151,936 for a 151,669-id tokenizer)."""
    return int(read_config(path)["vocab_size"])


def check_folder(path: str, *, want_tokenizer: bool) -> dict[str, Any]:
    """config.json, safetensors weights and (if the run tokenizes with it) tokenizer.json."""
    cfg = read_config(path)
    folder = Path(path)
    if not any(folder.glob("*.safetensors")):
        raise CheckpointError(f"model.path: {path} holds no *.safetensors weights")
    if want_tokenizer and not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"model.path: {path} has no tokenizer.json (model.tokenizer=hf reads it)")
    return cfg
