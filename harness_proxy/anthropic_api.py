"""Anthropic Messages API: requests as Claude Code sends them, responses and SSE as it expects them.

``parse_messages_request`` turns a ``POST /v1/messages`` body (and its headers) into a
``MessagesRequest``: a ``ChatRequest`` of clean template messages (the same form the OpenAI
adapter produces, so the Qwen3 template and ``SessionStore`` serve both APIs) plus what decides
the CallRecord's lineage. Mapping onto the template:

- ``system`` (a string or text blocks; ``cache_control`` ignored; accounting blocks such as
  Claude Code's billing line dropped) -> the leading system message;
  a mid-conversation ``role: "system"`` message -> a ``system`` turn in place.
- user ``text`` blocks -> a user turn (consecutive blocks joined by ``\\n``, empty ones dropped);
  each ``tool_result`` -> a ``tool`` message (rendered ``<tool_response>``), in block order.
- assistant ``thinking`` -> ``reasoning_content``, ``text`` -> content, ``tool_use`` ->
  ``tool_calls`` (rendered ``<tool_call>`` JSON); ``redacted_thinking`` is dropped.
- ``tools`` ``{name, description, input_schema}`` -> OpenAI-style function tools.

Splicing the engine's exact ids (``SessionStore``) needs each echoed assistant turn to compare
equal to the reply the proxy returned. Claude Code re-serialises tool inputs (keys reordered,
defaults such as ``"replace_all": false`` inserted), so text comparison alone cannot find the
turn. The Messages API does not echo the message id (``msg_...``, which is also the call id,
the engine's request id and the CallRecord's ``call_id``), but it does echo every ``tool_use``
id verbatim. ``MintedToolUses`` remembers, per execution, each ``toolu_...`` id the proxy minted
with the name and input the model produced; ``canonicalize`` puts those back into any echoed
tool_use that carries such an id before the session lookup, so a re-serialised echo splices.
Text and thinking are compared as the harness sent them (empty text blocks dropped, list and
string content alike); a turn the harness really changed is rendered from scratch.

No I/O here; the server owns sockets, the engine and recording.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from harness_proxy.openai_api import ApiError, ChatRequest, _number, load_json_object
from harness_proxy.template import EXACT_IDS_KEY, ParsedOutput, content_text

SUMMARY_MARKER = "Your task is to create a detailed summary"
"""In the text block Claude Code appends to the last user message of a compaction-summary call."""
AGENT_ID_HEADER = "x-claude-code-agent-id"
ROLES = ("user", "assistant", "system")

_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
    529: "overloaded_error",
}


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


# ---------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True, kw_only=True)
class MessagesRequest:
    chat: ChatRequest
    agent_id: str
    """``x-claude-code-agent-id`` (a sub-agent), or '' for the main agent."""
    lineage: str
    """main | main-summary | sub-agent | sub-agent-summary | side (base.wire.Lineage)."""

    @property
    def session_key(self) -> str:
        """Whose line of calls this extends: each sub-agent its own; side calls apart from both."""
        return f"side:{self.agent_id}" if self.lineage == "side" else self.agent_id


def _text_of_blocks(value: Any, param: str, *, allow: tuple[str, ...] = ()) -> str:
    """A string, or a list of text blocks (and ``allow``ed others), as text joined by ``\\n``."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if not isinstance(value, list):
        raise _bad(param, f"want a string or a list of content blocks, got {type(value).__name__}")
    texts = []
    for j, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise _bad(f"{param}[{j}].text", "want a string")
            if block["text"]:
                texts.append(block["text"])
        elif kind == "tool_reference" and "tool_reference" in allow:
            texts.append(f"Tool loaded: {block.get('tool_name', '')}")
        elif kind in ("image", "document") and kind in allow:
            texts.append(f"[{kind}]")
        else:
            raise _bad(f"{param}[{j}]", f"unsupported content block {json.dumps(kind)[:40]}")
    return "\n".join(texts)


def _user_messages(content: Any, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise _bad(param, f"want a string or a list of content blocks, got {type(content).__name__}")
    out: list[dict[str, Any]] = []
    texts: list[Any] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": _text_of_blocks(list(texts), param, allow=("image", "document"))})
            texts.clear()

    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise _bad(f"{param}[{j}]", "want a content block object")
        if block.get("type") == "tool_result":
            flush()
            result = _text_of_blocks(
                block.get("content"), f"{param}[{j}].content", allow=("tool_reference", "image", "document")
            )
            out.append({"role": "tool", "content": result, "tool_call_id": block.get("tool_use_id")})
        else:
            texts.append(block)
    flush()
    return out or [{"role": "user", "content": ""}]


def _assistant_message(content: Any, param: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(param, f"want a string or a list of content blocks, got {type(content).__name__}")
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"{param}[{j}]"
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise _bad(f"{where}.text", "want a string")
            if block["text"]:
                texts.append(block["text"])
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise _bad(f"{where}.thinking", "want a string")
            thoughts.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise _bad(where, "want {'type': 'tool_use', 'id': str, 'name': str, 'input': object}")
            calls.append({"id": block.get("id"), "name": block["name"], "arguments": block.get("input", {})})
        else:
            raise _bad(where, f"unsupported assistant content block {json.dumps(kind)[:40]}")
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thoughts:
        msg["reasoning_content"] = "\n".join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "want a non-empty list of messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(param, "want an object")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{param}.role", f"want one of {list(ROLES)}, got {json.dumps(role)[:40]}")
        if role == "user":
            out += _user_messages(m.get("content"), f"{param}.content")
        elif role == "assistant":
            out.append(_assistant_message(m.get("content"), f"{param}.content"))
        else:
            out.append({"role": "system", "content": _text_of_blocks(m.get("content"), f"{param}.content")})
    return out


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad("tools", "want a list")
    out = []
    for j, tool in enumerate(value):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise _bad(f"tools[{j}]", "want {'name': str, 'description': str, 'input_schema': object}")
        fn: dict[str, Any] = {"name": tool["name"]}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        fn["parameters"] = tool.get("input_schema") if isinstance(tool.get("input_schema"), dict) else {}
        out.append({"type": "function", "function": fn})
    return out or None


def _is_summary(messages: Any) -> bool:
    """The last user message ends with a text block holding SUMMARY_MARKER (a compaction summary)."""
    last = next((m for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "user"), None)
    content = last.get("content") if last else None
    if isinstance(content, list) and content and isinstance(content[-1], dict):
        content = content[-1].get("text") if content[-1].get("type") == "text" else None
    return isinstance(content, str) and SUMMARY_MARKER in content


def _is_title(body: dict[str, Any]) -> bool:
    """A session-title side call: ``tools: []`` and a json_schema output format."""
    fmt = body.get("output_config", {}).get("format") if isinstance(body.get("output_config"), dict) else None
    return body.get("tools") == [] and isinstance(fmt, dict) and fmt.get("type") == "json_schema"


def lineage_of(body: dict[str, Any], agent_id: str) -> str:
    if _is_title(body):
        return "side"
    base = "sub-agent" if agent_id else "main"
    return f"{base}-summary" if _is_summary(body.get("messages") or []) else base


# System text blocks meant for the API's accounting, not the model, kept out of the prompt. Claude
# Code's first block is ``x-anthropic-billing-header: cc_version=<version>.<3 hex>; ...``: the hex
# is derived from the first user message, so it differs between tasks and changes at compaction,
# and as the prompt's first line it would end the prefix that executions share (their system
# prompt and tools, ~22k ids) after ~33 ids. The CallRecord holds the ids rendered without it.
ACCOUNTING_BLOCK_PREFIXES = ("x-anthropic-billing-header:",)


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, list):
        value = [b for b in value if not (isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
                                          and b["text"].startswith(ACCOUNTING_BLOCK_PREFIXES))]
    return [{"role": "system", "content": _text_of_blocks(value, "system")}]


def parse_messages_request(raw: bytes, headers: Mapping[str, str]) -> MessagesRequest:
    """Validate a ``POST /v1/messages`` body; raise ``ApiError`` (400) on anything wrong.

    Keys Claude Code sends that do not change generation (``thinking``, ``context_management``,
    ``output_config``, ``metadata``, ``top_k``, ``stop_sequences``...) are accepted and ignored.
    """
    body = load_json_object(raw)
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _bad("max_tokens", f"want an integer >= 1, got {json.dumps(max_tokens)[:40]}")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", "want a boolean")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "want a string")
    chat = ChatRequest(
        model=model,
        messages=_system(body.get("system")) + _messages(body.get("messages")),
        tools=_tools(body.get("tools")),
        temperature=_number(body, "temperature", 1.0, 0.0, 1.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        max_tokens=max_tokens,
        stream=bool(stream),
        include_usage=True,
    )
    agent_id = headers.get(AGENT_ID_HEADER, "")
    return MessagesRequest(chat=chat, agent_id=agent_id, lineage=lineage_of(body, agent_id))


def parse_count_tokens_request(raw: bytes) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A ``POST /v1/messages/count_tokens`` body as (template messages, tools)."""
    body = load_json_object(raw)
    return _system(body.get("system")) + _messages(body.get("messages")), _tools(body.get("tools"))


# ---------------------------------------------------------------- minted tool_use ids


class MintedToolUses:
    """Per execution: each ``toolu_...`` id the proxy returned -> the turn that minted it.

    A turn is remembered with the tool inputs as the model wrote them and the engine's exact
    output ids. ``canonicalize`` restores echoed inputs (so a re-serialised turn still compares
    equal for the session splice) and, where the echoed turn is the whole reply unchanged (same
    text, thinking and tool_use ids), marks it with the output ids, so that even a history the
    proxy must render from scratch (after a compaction, in a fork) carries the policy's own ids.
    """

    def __init__(self) -> None:
        self._by_execution: dict[str, dict[str, _MintedTurn]] = {}

    def reply(self, execution_id: str, parsed: ParsedOutput, output_ids: list[int]) -> dict[str, Any]:
        """The template form of the assistant reply, minting (and remembering) its tool_use ids."""
        msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning is not None:
            msg["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            msg["tool_calls"] = [
                {"id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name, "arguments": call.arguments}
                for call in parsed.tool_calls
            ]
            self.restore(execution_id, parsed, output_ids, [c["id"] for c in msg["tool_calls"]])
        return msg

    def restore(self, execution_id: str, parsed: ParsedOutput, output_ids: list[int], ids: list[str]) -> None:
        """Remember the turn whose tool calls got ``ids`` (``reply``, or a restarted proxy reading its
        CallRecord back: ``SessionEntry.reply_tool_ids``)."""
        if not parsed.tool_calls or len(ids) != len(parsed.tool_calls) or not all(i.startswith("toolu_") for i in ids):
            return
        turn = _MintedTurn(
            content=parsed.content, reasoning=parsed.reasoning or "", output_ids=list(output_ids),
            calls={i: (call.name, call.arguments) for i, call in zip(ids, parsed.tool_calls)},
        )
        minted = self._by_execution.setdefault(execution_id, {})
        for i in ids:
            minted[i] = turn

    def canonicalize(self, execution_id: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with each echoed tool_use the proxy minted restored to the model's own input,
        and each echoed whole reply marked with its exact output ids."""
        minted = self._by_execution.get(execution_id)
        if not minted:
            return messages
        out = []
        for m in messages:
            calls = m.get("tool_calls")
            if m.get("role") == "assistant" and calls and any(c.get("id") in minted for c in calls):
                restored = [
                    {"id": c["id"], "name": minted[c["id"]].name_of(c["id"]), "arguments": minted[c["id"]].args_of(c["id"])}
                    if c.get("id") in minted else c
                    for c in calls
                ]
                m = {**m, "tool_calls": restored}
                turn = minted.get(calls[0].get("id"))
                if turn is not None and turn.is_echoed_by(m):
                    m[EXACT_IDS_KEY] = turn.output_ids
            out.append(m)
        return out

    def drop_execution(self, execution_id: str) -> None:
        self._by_execution.pop(execution_id, None)


@dataclass(frozen=True, slots=True, kw_only=True)
class _MintedTurn:
    content: str
    reasoning: str
    output_ids: list[int]
    """Shared with every echo it marks (read only): marking costs no copy per call."""
    calls: dict[str, tuple[str, dict[str, Any]]]
    """tool_use id -> (name, input as the model wrote it), in the turn's order."""

    def name_of(self, tool_use_id: str) -> str:
        return self.calls[tool_use_id][0]

    def args_of(self, tool_use_id: str) -> dict[str, Any]:
        return self.calls[tool_use_id][1]

    def is_echoed_by(self, m: dict[str, Any]) -> bool:
        """The harness sent this turn back whole: the same tool_use ids in order, text and thinking
        byte-equal (an empty text block dropped is the same text). A fork that copies only the
        tool_use blocks, or a turn whose text was edited, is not."""
        ids = [c.get("id") for c in m.get("tool_calls") or []]
        return (
            ids == list(self.calls)
            and content_text(m.get("content")) == self.content
            and (m.get("reasoning_content") or "") == self.reasoning
        )


# ---------------------------------------------------------------- responses


def new_message_id() -> str:
    """A proxy-minted message id; also the call id, the engine's request id and the record's call_id."""
    return f"msg_{uuid.uuid4().hex}"


def content_blocks(reply: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.get("reasoning_content") is not None:
        blocks.append({"type": "thinking", "thinking": reply["reasoning_content"], "signature": ""})
    calls = reply.get("tool_calls") or []
    if reply["content"] or not calls:
        blocks.append({"type": "text", "text": reply["content"]})
    for c in calls:
        blocks.append({"type": "tool_use", "id": c["id"], "name": c["name"], "input": c["arguments"]})
    return blocks


def stop_reason(engine_finish: str, reply: dict[str, Any]) -> str:
    if engine_finish == "length":
        return "max_tokens"
    return "tool_use" if reply.get("tool_calls") else "end_turn"


def message_body(
    *, message_id: str, model: str, reply: dict[str, Any], stop: str, num_prompt: int, num_output: int
) -> dict[str, Any]:
    return {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": content_blocks(reply), "stop_reason": stop, "stop_sequence": None,
        "usage": {"input_tokens": num_prompt, "output_tokens": num_output},
    }


def _event(name: str, data: dict[str, Any]) -> bytes:
    # ASCII-escaped: a string the request carried (the model name) may hold a lone surrogate,
    # which has no UTF-8 encoding; escaped it is valid JSON and cannot break a started stream.
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def stream_events(body: dict[str, Any]) -> list[bytes]:
    """A whole ``message_body`` as Anthropic SSE: message_start, ping, per block start/delta(s)/stop,
    message_delta, message_stop; every event an ``event:`` + ``data:`` pair."""
    start = {**body, "content": [], "stop_reason": None,
             "usage": {"input_tokens": body["usage"]["input_tokens"], "output_tokens": 0}}
    events = [_event("message_start", {"type": "message_start", "message": start}), _event("ping", {"type": "ping"})]
    for i, block in enumerate(body["content"]):
        kind = block["type"]
        if kind == "thinking":
            first = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": block["thinking"]},
                      {"type": "signature_delta", "signature": block["signature"]}]
        elif kind == "tool_use":
            first = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}]
        else:
            first = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": block["text"]}]
        events.append(_event("content_block_start", {"type": "content_block_start", "index": i, "content_block": first}))
        for delta in deltas:
            events.append(_event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}))
        events.append(_event("content_block_stop", {"type": "content_block_stop", "index": i}))
    events.append(_event("message_delta", {
        "type": "message_delta", "delta": {"stop_reason": body["stop_reason"], "stop_sequence": None},
        "usage": {"output_tokens": body["usage"]["output_tokens"]},
    }))
    events.append(_event("message_stop", {"type": "message_stop"}))
    return events


def error_reply(err: ApiError, *, too_long: tuple[int, int] | None = None) -> tuple[int, dict[str, Any]]:
    """(status, body) of ``err`` in Anthropic's shape. 503 (no engine could serve, or the record
    could not be sent) becomes 529 ``overloaded_error``, which Claude Code retries by itself."""
    status = 529 if err.status == 503 else err.status
    message = err.message
    if too_long is not None:
        message = f"prompt is too long: {too_long[0]} tokens > {too_long[1]} maximum"
    kind = _ERROR_TYPES.get(status, "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}
