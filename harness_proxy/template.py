"""Qwen3 chat template: messages -> token ids, and the model's output ids -> message parts.

Rendering (the Qwen3 ChatML layout)::

    <|im_start|>system\n{system}<|im_end|>\n
    <|im_start|>user\n{text}<|im_end|>\n
    <|im_start|>assistant\n{text}<|im_end|>\n
    ...
    <|im_start|>assistant\n            <- generation prompt

An assistant turn's own ids (the policy's output, ending in ``<|im_end|>``) are followed by the
context token ``\n``; the proxy splices the engine's exact ids in for echoed assistant turns.
"""

from __future__ import annotations

from typing import Any

from harness_proxy.tokenizer import QwenTokenizer


def render_turn(tok: QwenTokenizer, role: str, text: str) -> list[int]:
    """One complete non-assistant-output turn: <|im_start|>{role}\\n{text}<|im_end|>\\n."""
    return [tok.im_start, *tok.encode(f"{role}\n{text}"), tok.im_end, *tok.encode("\n")]


def generation_prompt(tok: QwenTokenizer) -> list[int]:
    return [tok.im_start, *tok.encode("assistant\n")]


def render_messages(tok: QwenTokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
    """Plain-text messages (role + string content) to ids, re-tokenising every turn."""
    ids: list[int] = []
    for m in messages:
        ids += render_turn(tok, m["role"], m["content"])
    if add_generation_prompt:
        ids += generation_prompt(tok)
    return ids


def split_output(tok: QwenTokenizer, output_ids: list[int]) -> tuple[str, bool]:
    """The assistant text of an output and whether it ended with <|im_end|>."""
    ended = bool(output_ids) and output_ids[-1] == tok.im_end
    body = output_ids[:-1] if ended else output_ids
    return tok.decode([t for t in body if not tok.is_special(t)]), ended
