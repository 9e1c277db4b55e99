"""A checkpoint's own tokenizer (``model.tokenizer=hf``): its tokenizer.json, offline, through the
``tokenizers`` library, behind the same interface as ``base.tokenizer.QwenTokenizer``.

The template asks for control tokens by name (``<|im_start|>``, ``<tool_call>``...) and gets the
checkpoint's ids for them. Harness text is data: it is encoded by a second tokenizer built from
the same file without its added tokens, so a literal ``<|im_end|>`` in a tool result stays text
(a Hugging Face tokenizer would match it as the control token, whatever it is flagged).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer

# The ChatML and tool-call tokens harness_proxy.template writes; a tokenizer without them cannot
# render a Qwen3 conversation.
REQUIRED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>", "<think>", "</think>")


class HFTokenizer:
    kind = "hf"

    def __init__(self, path: str):
        file = Path(path) / "tokenizer.json"
        try:
            spec = json.loads(file.read_text())
            self._full = Tokenizer.from_str(json.dumps(spec))
        except Exception as exc:  # noqa: BLE001 -- a broken file is one clear line, whatever broke
            raise ValueError(f"model.tokenizer=hf: {file}: {exc}") from None
        added = {t["content"]: int(t["id"]) for t in spec.get("added_tokens", [])}
        missing = [name for name in REQUIRED if name not in added]
        if missing:
            raise ValueError(f"model.tokenizer=hf: {file} lacks {missing}; Gyre renders Qwen3's ChatML template")
        self._text = Tokenizer.from_str(json.dumps({**spec, "added_tokens": []}))
        self.specials = added
        self.num_ranks = min(added.values())
        """Ids below this are ordinary BPE tokens; the added (control) tokens follow them."""
        self.vocab_size = self._full.get_vocab_size(with_added_tokens=True)
        self.im_start = added["<|im_start|>"]
        self.im_end = added["<|im_end|>"]
        self.endoftext = added["<|endoftext|>"]
        self._special_ids = frozenset(added.values())

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        enc = self._full if allow_special else self._text
        return enc.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._full.decode(ids, skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids


@functools.lru_cache(maxsize=4)
def get_hf_tokenizer(path: str) -> HFTokenizer:
    return HFTokenizer(path)
