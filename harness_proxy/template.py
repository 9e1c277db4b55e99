"""Qwen3 chat template: messages -> token ids, and the model's output ids -> message parts.

Rendering follows Qwen3's ``chat_template`` (ChatML)::

    <|im_start|>system\n{system}\n\n# Tools\n...<tools>\n{tool json}\n</tools>...<|im_end|>\n
    <|im_start|>user\n{text}<|im_end|>\n
    <|im_start|>assistant\n{text}\n<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n{result}\n</tool_response>\n<tool_response>...<|im_end|>\n
    <|im_start|>assistant\n            <- generation prompt

Ids are built the way a Hugging Face tokenizer encodes the template's output: the template's
control tokens (``<|im_start|>``, ``<tool_call>``, ``<think>``...) are their special ids and the
text between two of them is encoded as one run. Text from the harness is data: a literal
``<|im_end|>`` inside a message stays text. Because every turn begins with ``<|im_start|>``, the ids
of a turn do not depend on what came before it, which is what lets ``harness_proxy.sessions``
append new turns to the engine's exact ids.

Where this differs from Qwen3's template, on purpose: past assistant turns keep their reasoning
(``reasoning_content``) instead of dropping it, so a re-rendered history agrees with the ids the
policy produced; list-of-parts content is joined with ``\\n`` instead of rendered as ''.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from base.tokenizer import QwenTokenizer

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
)
_TOOLS_EXAMPLE = '\n{"name": <function-name>, "arguments": <args-json-object>}\n'


class _Ids:
    """Accumulates template pieces; adjacent text is encoded as one run, specials are ids."""

    def __init__(self, tok: QwenTokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self._text: list[str] = []

    def text(self, s: str) -> _Ids:
        self._text.append(s)
        return self

    def special(self, name: str) -> _Ids:
        self._flush()
        self.ids.append(self.tok.specials[name])
        return self

    def raw(self, ids: list[int]) -> _Ids:
        """Ids taken as they are (an engine's own output), not re-encoded from text."""
        self._flush()
        self.ids += ids
        return self

    def done(self) -> list[int]:
        self._flush()
        return self.ids

    def _flush(self) -> None:
        if self._text:
            joined = "".join(self._text)
            self._text.clear()
            if joined:
                self.ids += self.tok.encode(joined)


# ---------------------------------------------------------------- rendering


def content_text(content: Any) -> str:
    """A message's content as text: a string, None (''), or a list of text parts joined by ``\\n``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text", "") if isinstance(p, dict) else str(p) for p in content]
        return "\n".join(t for t in texts if isinstance(t, str))
    return str(content)


def tool_call_parts(call: dict[str, Any]) -> tuple[str, Any]:
    """(name, arguments) of an OpenAI ``{"function": {...}}`` or a flat ``{"name", "arguments"}`` call."""
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    return str(fn.get("name", "")), fn.get("arguments", {})


def _system_turn(b: _Ids, system: str | None, tools: list[Any] | None) -> None:
    if not tools:
        if system is not None:
            b.special("<|im_start|>").text(f"system\n{system}").special("<|im_end|>").text("\n")
        return
    b.special("<|im_start|>").text("system\n")
    if system is not None:
        b.text(system + "\n\n")
    b.text(_TOOLS_HEADER)
    for tool in tools:
        b.text("\n" + json.dumps(tool, ensure_ascii=False))
    b.text(_TOOLS_FOOTER).special("<tool_call>").text(_TOOLS_EXAMPLE).special("</tool_call>")
    b.special("<|im_end|>").text("\n")


EXACT_IDS_KEY = "_exact_output_ids"
"""Set by an API adapter on an echoed assistant message it recognised as one of the proxy's own
replies: the engine's output ids for it, rendered verbatim instead of re-encoding the text."""


def _assistant_turn(b: _Ids, m: dict[str, Any]) -> None:
    exact = m.get(EXACT_IDS_KEY)
    if exact:
        b.special("<|im_start|>").text("assistant\n").raw(exact)
        if exact[-1] != b.tok.im_end:  # cut by length: close the turn as the session splice does
            b.special("<|im_end|>")
        b.text("\n")
        return
    content = content_text(m.get("content"))
    reasoning = m.get("reasoning_content")
    b.special("<|im_start|>").text("assistant\n")
    if isinstance(reasoning, str) and reasoning:
        b.special("<think>").text("\n" + reasoning.strip("\n") + "\n").special("</think>").text("\n\n")
        content = content.lstrip("\n")
    b.text(content)
    for i, call in enumerate(m.get("tool_calls") or []):
        if i > 0 or content:
            b.text("\n")
        name, args = tool_call_parts(call)
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        b.special("<tool_call>").text(f'\n{{"name": "{name}", "arguments": {args_text}}}\n')
        b.special("</tool_call>")
    b.special("<|im_end|>").text("\n")


def _render_body(b: _Ids, messages: list[dict[str, Any]]) -> None:
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "assistant":
            _assistant_turn(b, m)
        elif role == "tool":
            # Consecutive tool results share one user turn, as in Qwen3's template.
            if i == 0 or messages[i - 1].get("role") != "tool":
                b.special("<|im_start|>").text("user")
            b.text("\n").special("<tool_response>").text("\n" + content_text(m.get("content")) + "\n")
            b.special("</tool_response>")
            if i == len(messages) - 1 or messages[i + 1].get("role") != "tool":
                b.special("<|im_end|>").text("\n")
        else:
            name = "system" if role == "developer" else str(role)
            b.special("<|im_start|>").text(f"{name}\n{content_text(m.get('content'))}")
            b.special("<|im_end|>").text("\n")


def render_messages(
    tok: QwenTokenizer,
    messages: list[dict[str, Any]],
    *,
    tools: list[Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """A whole conversation to ids: a leading system message (and the tools) form the system turn."""
    b = _Ids(tok)
    system = None
    if messages and messages[0].get("role") in ("system", "developer"):
        system, messages = content_text(messages[0].get("content")), messages[1:]
    _system_turn(b, system, tools)
    _render_body(b, messages)
    ids = b.done()
    if add_generation_prompt:
        ids += generation_prompt(tok)
    return ids


def render_appended(tok: QwenTokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """Turns that follow a complete assistant turn (no system/tools handling, no generation prompt).

    Equal to the tail of ``render_messages`` over the whole conversation, because every turn starts
    with ``<|im_start|>`` and consecutive tool results never straddle an assistant turn.
    """
    b = _Ids(tok)
    _render_body(b, messages)
    return b.done()


def render_turn(tok: QwenTokenizer, role: str, text: str) -> list[int]:
    """One complete non-assistant-output turn: <|im_start|>{role}\\n{text}<|im_end|>\\n."""
    return [tok.im_start, *tok.encode(f"{role}\n{text}"), tok.im_end, *tok.encode("\n")]


def turn_separator(tok: QwenTokenizer) -> list[int]:
    """The context ids after an assistant turn's ``<|im_end|>`` and before the next turn."""
    return tok.encode("\n")


def generation_prompt(tok: QwenTokenizer) -> list[int]:
    return [tok.im_start, *tok.encode("assistant\n")]


# ---------------------------------------------------------------- parsing the model's output


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """An output as an assistant message: ``content`` without the tool-call blocks and reasoning."""

    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    ended: bool = False
    """The output ended with ``<|im_end|>``."""


def _decode(tok: QwenTokenizer, ids: list[int]) -> str:
    # An engine's vocabulary may be padded past the tokenizer's; such ids decode to U+FFFD.
    if all(0 <= t < tok.vocab_size for t in ids):
        return tok.decode(ids)
    return "".join(tok.decode([t]) if 0 <= t < tok.vocab_size else "\ufffd" for t in ids)


def _parse_tool_call(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], args)


def _split_reasoning(tok: QwenTokenizer, ids: list[int]) -> tuple[str | None, list[int]]:
    open_id, close_id = tok.specials["<think>"], tok.specials["</think>"]
    if close_id in ids:
        k = ids.index(close_id)
        head = ids[:k]
        if open_id in head:
            head = head[head.index(open_id) + 1 :]
        return _decode(tok, head).strip("\n"), ids[k + 1 :]
    if ids and ids[0] == open_id:  # cut off while thinking
        return _decode(tok, ids[1:]).strip("\n"), []
    return None, ids


def parse_output(tok: QwenTokenizer, output_ids: list[int]) -> ParsedOutput:
    """Output ids -> content, reasoning and tool calls; a ``<tool_call>`` block that is not valid
    JSON of the form ``{"name": str, "arguments": object}`` (or is unclosed) stays in the content."""
    ids = list(output_ids)
    ended = bool(ids) and ids[-1] == tok.im_end
    if ended:
        ids.pop()
    while ids and ids[-1] in (tok.endoftext, tok.im_end):
        ids.pop()
    reasoning, ids = _split_reasoning(tok, ids)
    open_id, close_id = tok.specials["<tool_call>"], tok.specials["</tool_call>"]
    texts: list[str] = []
    calls: list[ToolCall] = []
    i = 0
    while i < len(ids):
        try:
            j = ids.index(open_id, i)
        except ValueError:
            j = len(ids)
        texts.append(_decode(tok, ids[i:j]))
        if j == len(ids):
            break
        try:
            k = ids.index(close_id, j + 1)
        except ValueError:  # unclosed block: text
            texts.append("<tool_call>" + _decode(tok, ids[j + 1 :]))
            break
        inner = _decode(tok, ids[j + 1 : k])
        call = _parse_tool_call(inner.strip())
        if call is None:
            texts.append("<tool_call>" + inner + "</tool_call>")
        else:
            calls.append(call)
            texts.append("")  # marks where a call stood, so whitespace around calls can be dropped
        i = k + 1
    if calls:
        content = "".join(t for t in texts if t.strip()).strip()
    else:
        content = "".join(texts)
    if reasoning is not None:
        content = content.lstrip("\n")
    return ParsedOutput(content=content, reasoning=reasoning, tool_calls=calls, ended=ended)


def split_output(tok: QwenTokenizer, output_ids: list[int]) -> tuple[str, bool]:
    """The assistant text of an output and whether it ended with <|im_end|>."""
    ended = bool(output_ids) and output_ids[-1] == tok.im_end
    body = output_ids[:-1] if ended else output_ids
    return tok.decode([t for t in body if not tok.is_special(t)]), ended
