"""Running the real Qwen Code CLI against the proxy (OpenAI API), over a scripted engine.

What was learned running Qwen Code 0.15.10 (``make qwen-code``: npm ``@qwen-code/qwen-code``, node
20; ``.tools/qwen-code/node_modules/.bin/qwen``) against a logging loopback server, 2026-12-03:

- **Headless:** ``qwen "<prompt>" --yolo --auth-type openai --openai-base-url <proxy>/v1
  --model <name> --output-format json`` (the positional prompt is one-shot; ``-p`` is deprecated
  but works). ``--yolo`` approves every tool. ``--output-format json`` prints one JSON array on
  stdout: an ``init`` event (tools, agents), the assistant messages, and a ``result`` event
  (``is_error``, ``result``, ``stats.models.<model>.bySource``: which sources called the model,
  e.g. ``main`` and ``managed-auto-memory-extractor``). ``--max-session-turns N`` bounds the loop.
- **Env:** ``OPENAI_API_KEY`` (sent as ``Authorization: Bearer``: the execution token goes here),
  ``OPENAI_BASE_URL`` and ``OPENAI_MODEL`` (the flags above win over them). Nothing else is needed.
- **Offline:** in a fresh ``$HOME``, ``~/.qwen/settings.json`` with
  ``privacy.usageStatisticsEnabled=false``, ``telemetry.enabled=false``,
  ``general.disableAutoUpdate=true`` (what ``workloads/harnesses/qwen_code.py`` writes): the only
  traffic to the base URL is ``POST /v1/chat/completions``; no ``/models`` probe, no preflight.
- **What it sends:** every call streams (``stream: true``, ``stream_options.include_usage``),
  ``max_tokens: 8000``, User-Agent ``QwenCode/0.15.10``, the OpenAI JS SDK's ``x-stainless-*``
  headers, and **no header that names the agent**. Content is a list of text parts
  (``[{"type": "text", ...}]``), also for tool results. The main agent's messages: a ~37k-char
  system prompt (ending with the memory index), a user *environment preamble* (date, OS, cwd,
  folder listing), a fixed assistant "Got it. Thanks for the context!", then the task; 15 tools
  (``agent``, ``write_file``, ``edit``, ``read_file``, ``run_shell_command``, ``todo_write`` ...).
  History is echoed append-only: tool-call ``arguments`` come back as the very string returned,
  assistant ``content`` ``null`` when there were only tool calls.
- **Sub-agents:** the ``agent`` tool (``description``, ``prompt``, ``subagent_type`` of
  general-purpose / Explore / statusline-setup, ``run_in_background``). A foreground sub-agent is
  a new conversation: its own system prompt ("You are a general-purpose agent..." ~16k chars),
  its own preamble (slightly different), the same "Got it", then the ``prompt`` argument verbatim
  as its task; 14 tools (no ``agent``). Its last text is the parent's tool result. Nothing in the
  request says it is a sub-agent: the proxy recognises the hand-off (the task is the string the
  parent's tool call carried).
- **Side calls:** after a main turn, in the background, *managed auto-memory extraction*: a
  different system prompt ("...managed memory extraction subagent..."), the main conversation's
  messages after the system prompt verbatim, and an appended user instruction; 7 tools (it may
  read or write memory files). Whether it runs before ``-p`` exits is timing-dependent. Chat
  compression (over the context limit) sends the history under a compression system prompt with
  the instruction "... generate the <state_snapshot>." and restarts the history from the summary.

The engine double (``ScriptedEngine`` with ``QwenCodingScript`` as its policy) sees only token
ids: it decodes the prompt, tells the caller by its first system block, and counts its scripted
tool calls in the prompt, as ``claude_code.CodingScript`` does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness_proxy import TOK, Step
from tests.harness_proxy.claude_code import engine_ids, tool_call, tool_calls_in

PROJECT_ROOT = Path(__file__).resolve().parents[2]
QWEN_CODE_VERSION = re.search(
    r"^QWEN_CODE_VERSION\s*:=\s*(\S+)", (PROJECT_ROOT / "Makefile").read_text(), flags=re.M
).group(1)  # type: ignore[union-attr]  # pinned in one place: the Makefile that installs it
QWEN_BIN = PROJECT_ROOT / ".tools" / "qwen-code" / "node_modules" / ".bin" / "qwen"
MODEL = "gyre-policy"
SETTINGS = {"privacy": {"usageStatisticsEnabled": False}, "general": {"disableAutoUpdate": True},
            "telemetry": {"enabled": False}}

MAIN_MARK = "You are Qwen Code, an interactive CLI agent"
MEMORY_MARK = "memory extraction"
SUB_TASK = "SUB-TASK: create sub.txt containing the line: sub-agent was here"


@dataclass
class QwenCodingScript:
    """A main agent that writes a file, edits it, hands a task to a foreground general-purpose
    sub-agent, checks both files and answers; the sub-agent writes its file and reports."""

    workdir: Path
    main_steps: list[str] = field(init=False)
    sub_steps: list[str] = field(init=False)
    calls: dict[str, int] = field(default_factory=lambda: {"main": 0, "sub-agent": 0, "memory": 0, "other": 0})

    def __post_init__(self) -> None:
        hello, sub = str(self.workdir / "hello.txt"), str(self.workdir / "sub.txt")
        self.main_steps = [
            "I will write the file first." + tool_call("write_file", {"file_path": hello, "content": "hello from qwen\n"}),
            tool_call("edit", {"file_path": hello, "old_string": "hello from qwen", "new_string": "hello from qwen, edited"}),
            tool_call("agent", {"description": "Write sub.txt", "prompt": SUB_TASK, "subagent_type": "general-purpose"}),
            tool_call("run_shell_command", {"command": "cat hello.txt sub.txt", "description": "Show both files"}),
            "Done: hello.txt was written and edited, and the sub-agent wrote sub.txt.",
        ]
        self.sub_steps = [
            tool_call("write_file", {"file_path": sub, "content": "sub-agent was here\n"}),
            "Created sub.txt with the requested line.",
        ]

    @staticmethod
    def _progress(prompt: str, steps: list[str]) -> int:
        seen = tool_calls_in(prompt)
        done = 0
        for k, step in enumerate(steps):
            calls = tool_calls_in(step)
            if (calls and calls[0] in seen) or (not calls and step in prompt):
                done = k + 1
        return done

    def __call__(self, input_ids: list[int]) -> Step:
        prompt = TOK.decode(input_ids)
        system = prompt[: prompt.find("<|im_end|>")]
        if MAIN_MARK in system:
            who, steps = "main", self.main_steps
        elif MEMORY_MARK in system:
            self.calls["memory"] += 1
            return Step(output_ids=engine_ids("Nothing durable to save from this conversation."))
        elif SUB_TASK in prompt:
            who, steps = "sub-agent", self.sub_steps
        else:
            self.calls["other"] += 1
            return Step(output_ids=engine_ids("ok"))
        self.calls[who] += 1
        return Step(output_ids=engine_ids(steps[min(self._progress(prompt, steps), len(steps) - 1)]))


def qwen_home(home: Path) -> Path:
    """A fresh ``$HOME`` whose settings keep Qwen Code offline (no usage statistics, telemetry, updates)."""
    settings = home / ".qwen" / "settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps(SETTINGS))
    return home


def qwen_env(home: Path, base_url: str, api_key: str, **extra: str) -> dict[str, str]:
    """The headless environment: ``base_url`` is the proxy's root (``/v1`` is added)."""
    return {
        "PATH": "/usr/bin:/bin", "HOME": str(qwen_home(home)), "LANG": "C.UTF-8",
        "OPENAI_API_KEY": api_key, "OPENAI_BASE_URL": f"{base_url}/v1", "OPENAI_MODEL": MODEL, **extra,
    }


def qwen_argv(prompt: str, base_url: str, *, max_turns: int = 30) -> list[str]:
    return [str(QWEN_BIN), prompt, "--yolo", "--auth-type", "openai", "--openai-base-url", f"{base_url}/v1",
            "--model", MODEL, "--output-format", "json", "--max-session-turns", str(max_turns)]


def run_qwen(prompt: str, *, cwd: Path, env: dict[str, str], timeout_s: float = 240) -> dict[str, Any]:
    """``qwen`` one-shot; returns the ``result`` event of its JSON output (raises with stderr on failure)."""
    proc = subprocess.run(
        qwen_argv(prompt, env["OPENAI_BASE_URL"].removesuffix("/v1")), cwd=cwd, env=env, capture_output=True,
        text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise AssertionError(f"qwen exited {proc.returncode}\nstdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr[-3000:]}")
    events = json.loads(proc.stdout)
    return next(e for e in events if e.get("type") == "result")


def qwen_version() -> str | None:
    if not os.access(QWEN_BIN, os.X_OK):
        return None
    out = subprocess.run([str(QWEN_BIN), "--version"], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})
    return out.stdout.strip() if out.returncode == 0 and out.stdout else None
