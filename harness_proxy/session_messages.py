"""Messages as the session store compares and remembers them (``harness_proxy.sessions``).

Messages are compared on role, content and tool calls after normalising: key order ignored,
missing / null / empty content alike, list-of-text-parts content as its text, tool-call arguments
as parsed JSON (a harness may re-serialise them), tool-call ids ignored. Tools are compared as
JSON values (key order ignored). A remembered message goes out on its call's CallRecord in its
wire form (``wire.SessionMessage``) and comes back from there after a restart.
"""

from __future__ import annotations

import json
from typing import Any

from base import wire
from harness_proxy.template import content_text, tool_call_parts

NormMessage = tuple[str, str, tuple[tuple[str, str], ...]]
RawArgs = tuple[Any, ...]
"""A message's tool-call arguments as the request carried them (a fast equality check before JSON)."""


def _canonical_arguments(args: Any) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return args
    return json.dumps(args, sort_keys=True, ensure_ascii=False)


def _tool_calls(m: dict[str, Any]) -> list[tuple[str, Any]]:
    return [tool_call_parts(c) for c in (m.get("tool_calls") or []) if isinstance(c, dict)]


def message_role(m: dict[str, Any]) -> str:
    role = str(m.get("role"))
    return "system" if role == "developer" else role


def message_text(m: dict[str, Any]) -> str:
    c = m.get("content")
    return c if type(c) is str else content_text(c)


def normalize_message(m: dict[str, Any]) -> NormMessage:
    """The parts of a message that decide its rendering, in a comparable form."""
    calls = tuple((name, _canonical_arguments(args)) for name, args in _tool_calls(m))
    return message_role(m), message_text(m), calls


def raw_arguments(m: dict[str, Any]) -> RawArgs:
    return tuple(args for _, args in _tool_calls(m)) if m.get("tool_calls") else ()


def same_message(m: dict[str, Any], norm: NormMessage, raw: RawArgs) -> bool:
    """``normalize_message(m) == norm``, without JSON work when the arguments came back verbatim."""
    role, content, calls = norm
    if message_text(m) != content or message_role(m) != role:
        return False
    if not m.get("tool_calls"):
        return not calls
    parts = _tool_calls(m)
    if len(parts) != len(calls):
        return False
    for i, ((name, args), (want_name, want_args)) in enumerate(zip(parts, calls)):
        if name != want_name:
            return False
        # Verbatim (the same string, or the same object the proxy minted) needs no JSON round trip.
        verbatim = args is raw[i] or (type(args) is str and (args == raw[i] or args == want_args))
        if not (verbatim or _canonical_arguments(args) == want_args):
            return False
    return True


def tools_key(tools: list[Any] | None) -> str:
    return json.dumps(tools or [], sort_keys=True, ensure_ascii=False)


def wire_message(norm: NormMessage) -> wire.SessionMessage:
    role, content, calls = norm
    return wire.SessionMessage(role=wire_text(role), content=wire_text(content),
                               tool_calls=[[wire_text(name), wire_text(args)] for name, args in calls])


def wire_text(text: str) -> str:
    """``text``, or, where JSON escapes gave it lone surrogates (UTF-8 cannot carry them), with those
    replaced: such a message no longer matches after a restore, and the call after it is rendered
    from scratch (a branch in the tree), never refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text


def message_from_wire(m: wire.SessionMessage) -> dict[str, Any]:
    """A message that normalises back to ``m`` (its arguments are canonical JSON already)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"function": {"name": name, "arguments": args}} for name, args in m.tool_calls]
    return out
