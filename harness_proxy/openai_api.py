"""OpenAI Chat Completions: the request as harnesses send it, the response as they expect it.

``parse_chat_request`` validates a request body and returns a ``ChatRequest`` whose messages are
clean dicts the template renders (``role``, ``content`` as text, ``tool_calls`` as
``{"name", "arguments"}``, ``reasoning_content``); any problem raises ``ApiError`` carrying the
HTTP status and OpenAI's error shape. The response builders turn a parsed model output into a
``chat.completion`` object or its ``chat.completion.chunk`` stream. No I/O here; the server owns
sockets, the engine and recording.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from harness_proxy.template import ParsedOutput, content_text

ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """A refusal for the harness, in OpenAI's error shape."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error",
        param: str | None = None, code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    temperature: float
    top_p: float
    max_tokens: int | None
    """What the harness asked for (None: not said); the server caps it."""
    stream: bool
    include_usage: bool


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        isinstance(value, float) and not math.isfinite(value)
    ):
        raise _bad(key, f"want a number, got {json.dumps(value)[:40]}")
    if value < lo or value > hi or (lo_open and value == lo):
        raise _bad(key, f"want {'>' if lo_open else '>='} {lo} and <= {hi}, got {value}")
    return float(value)


def _optional(body: dict[str, Any], key: str, kind: type, what: str) -> Any:
    value = body.get(key)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise _bad(key, f"want {what}, got {type(value).__name__}")
    return value


def _content(value: Any, param: str) -> str:
    if value is None or isinstance(value, str):
        return content_text(value)
    if not isinstance(value, list):
        raise _bad(param, f"want a string or a list of text parts, got {type(value).__name__}")
    for j, part in enumerate(value):
        if not isinstance(part, dict):
            raise _bad(f"{param}[{j}]", "want a content part object")
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _bad(f"{param}[{j}]", "only text parts ({'type': 'text', 'text': str}) are supported")
    return content_text(value)


def _tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad(param, "want a list")
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{param}[{j}]", "want {'type': 'function', 'function': {'name': str, 'arguments': str}}")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise _bad(f"{param}[{j}].function.arguments", "want a JSON string")
        calls.append({"name": fn["name"], "arguments": args})
    return calls


def _message(m: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(param, "want an object")
    role = m.get("role")
    if role not in ROLES:
        raise _bad(f"{param}.role", f"want one of {list(ROLES)}, got {json.dumps(role)[:40]}")
    out: dict[str, Any] = {"role": role, "content": _content(m.get("content"), f"{param}.content")}
    if role == "assistant":
        calls = _tool_calls(m.get("tool_calls"), f"{param}.tool_calls")
        if calls:
            out["tool_calls"] = calls
        reasoning = m.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise _bad(f"{param}.reasoning_content", "want a string")
            out["reasoning_content"] = reasoning
    return out


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad("tools", "want a list")
    for j, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{j}]", "want {'type': 'function', 'function': {'name': str, ...}}")
    return value or None


def load_json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or ``ApiError`` (400).

    orjson first: at a 100k-token context the body is megabytes and the stdlib parser is most of
    the proxy's time. What orjson refuses but the stdlib takes (``NaN``, integers past 64 bits,
    lone surrogate escapes) goes through the stdlib, so the accepted inputs do not change.
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise ApiError(400, f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body: want a JSON object")
    return body


def parse_chat_request(raw: bytes) -> ChatRequest:
    """Validate a ``POST /v1/chat/completions`` body; raise ``ApiError`` (400) on anything wrong."""
    body = load_json_object(raw)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "want a non-empty list of messages")
    if _optional(body, "n", int, "an integer") not in (None, 1):
        raise _bad("n", "only n=1 is supported")
    stream = _optional(body, "stream", bool, "a boolean")
    stream_options = _optional(body, "stream_options", dict, "an object") or {}
    include_usage = stream_options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise _bad("stream_options.include_usage", "want a boolean")
    max_tokens = _optional(body, "max_completion_tokens", int, "an integer")
    if max_tokens is None:
        max_tokens = _optional(body, "max_tokens", int, "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise _bad("max_tokens", f"want >= 1, got {max_tokens}")
    return ChatRequest(
        model=_optional(body, "model", str, "a string"),
        messages=[_message(m, i) for i, m in enumerate(messages)],
        tools=_tools(body.get("tools")),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        max_tokens=max_tokens,
        stream=bool(stream),
        include_usage=bool(include_usage),
    )


# ---------------------------------------------------------------- responses


def new_call_id() -> str:
    """A proxy-minted call id; also the OpenAI response id and the engine's request id."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def reply_message(parsed: ParsedOutput) -> dict[str, Any]:
    """The assistant message returned to the harness (and remembered by the session)."""
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": parsed.content if parsed.content or not parsed.tool_calls else None,
    }
    if parsed.reasoning is not None:
        msg["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        msg["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
            }
            for c in parsed.tool_calls
        ]
    return msg


def finish_reason(engine_finish: str, message: dict[str, Any]) -> str:
    if engine_finish == "length":
        return "length"
    return "tool_calls" if message.get("tool_calls") else "stop"


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


def completion_body(
    *, call_id: str, created: int, model: str, message: dict[str, Any], finish: str, usage: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": call_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": usage,
    }


def stream_events(
    *, call_id: str, created: int, model: str, message: dict[str, Any], finish: str,
    usage: dict[str, int] | None,
) -> list[bytes]:
    """The whole answer as SSE ``data:`` events in OpenAI's chunk format, ending with ``[DONE]``."""

    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return {
            "id": call_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}],
        }

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("reasoning_content"):
        chunks.append(chunk({"reasoning_content": message["reasoning_content"]}))
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}))
    for i, call in enumerate(message.get("tool_calls", [])):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    chunks.append(chunk({}, finish))
    if usage is not None:
        chunks.append({
            "id": call_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [], "usage": usage,
        })
    events = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks]
    events.append(b"data: [DONE]\n\n")
    return events


def models_body(model_name: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "gyre"}]}
