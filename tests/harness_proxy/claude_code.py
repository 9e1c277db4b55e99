"""Running the real Claude Code binary against the proxy, over a scripted engine.

The engine double (``ScriptedEngine`` with a policy) sees only token ids, like a real engine. The
policy decodes the prompt and answers in Qwen3's output format (``<think>``, ``<tool_call>``
JSON, ``<|im_end|>``): it finds how far the script has got by looking for the exact text of its
own earlier tool calls in the prompt (the proxy splices them back verbatim), so the harness's own
re-serialisation of history cannot fool it. Which agent is asking is read from the prompt too:
a sub-agent's first user turn holds the task the script's Agent call gave it (the billing line that
marks sub-agents, ``cc_is_subagent=true``, is kept out of the prompt by the proxy), compaction-summary
calls end with Claude Code's summary instruction.

The binary is the pinned npm package installed by ``make claude-code`` (``.tools/claude-code``).
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

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CLAUDE_CODE_VERSION = re.search(
    r"^CLAUDE_CODE_VERSION\s*:=\s*(\S+)", (PROJECT_ROOT / "Makefile").read_text(), flags=re.M
).group(1)  # type: ignore[union-attr]  # pinned in one place: the Makefile that installs it
CLAUDE_BIN = PROJECT_ROOT / ".tools" / "claude-code" / "node_modules" / ".bin" / "claude"

SUMMARY_MARK = "Your task is to create a detailed summary"
DONE_MARK = "[gyre-steps-done {}]"
"""Written into the compaction summary: how many main steps were done before the history was cut."""


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    # Compact separators, unlike the proxy's own rendering: a turn re-rendered from its text
    # instead of spliced from the engine's ids would differ, and the drift check would see it.
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, separators=(",", ":"))
    return f"<tool_call>\n{body}\n</tool_call>"


_SPECIAL = re.compile(r"(<think>|</think>|<tool_call>|</tool_call>)")


def engine_ids(text: str) -> list[int]:
    """``text`` as a policy might sample it: specials as their ids, the rest in 3-character pieces.

    BPE would merge across the pieces, so these ids are not what the tokenizer makes of the text:
    any re-tokenisation of an echoed turn shows up as drift.
    """
    ids: list[int] = []
    for part in _SPECIAL.split(text):
        if part in TOK.specials:
            ids.append(TOK.specials[part])
        else:
            for k in range(0, len(part), 3):
                ids += TOK.encode(part[k : k + 3])
    return ids + [TOK.im_end]


def tool_calls_in(prompt: str) -> list[tuple[str, Any]]:
    """(name, arguments) of every well-formed ``<tool_call>`` block in a decoded prompt."""
    out = []
    for block in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", prompt, flags=re.S):
        try:
            call = json.loads(block)
        except ValueError:
            continue
        if isinstance(call, dict) and "name" in call:
            out.append((call["name"], call.get("arguments")))
    return out


@dataclass
class CodingScript:
    """A main agent that writes, reads, edits, runs Bash, delegates to a foreground sub-agent and
    prints a large output (to push the reported usage over the compaction threshold)."""

    workdir: Path
    big_output_lines: int = 4000
    main_steps: list[str] = field(init=False)
    sub_steps: list[str] = field(init=False)
    sub_task: str = field(init=False)
    calls: dict[str, int] = field(default_factory=lambda: {"main": 0, "sub-agent": 0, "summary": 0})

    def __post_init__(self) -> None:
        hello = str(self.workdir / "hello.txt")
        sub = str(self.workdir / "sub.txt")
        self.sub_task = f"Create {sub} containing the line: sub-agent was here"
        self.main_steps = [
            "<think>\nThe file does not exist yet: write it, read it back, then edit it.\n</think>\n\n"
            + tool_call("Write", {"content": "hello from gyre\n", "file_path": hello}),
            tool_call("Read", {"file_path": hello}),
            "Now the edit." + tool_call("Edit", {"file_path": hello, "old_string": "hello from gyre",
                                                 "new_string": "hello from gyre, edited"}),
            tool_call("Bash", {"command": "cat hello.txt && ls", "description": "Show the edited file"}),
            tool_call("Agent", {"description": "Write sub.txt", "subagent_type": "general-purpose",
                                "prompt": self.sub_task,
                                "run_in_background": False}),
            tool_call("Bash", {"command": f"seq 100000 {100000 + self.big_output_lines - 1}",
                               "description": "Print a long run of numbers"}),
            tool_call("Bash", {"command": "cat hello.txt sub.txt", "description": "Show both files"}),
            "Done: hello.txt was written and edited, and the sub-agent wrote sub.txt.",
        ]
        self.sub_steps = [
            tool_call("Write", {"file_path": sub, "content": "sub-agent was here\n"}),
            "Created sub.txt with the requested line.",
        ]

    def _progress(self, prompt: str, steps: list[str]) -> int:
        """How many steps the prompt shows as done: the last scripted step whose tool call (by
        name and arguments, however it was serialised) or final text is in the prompt."""
        seen = tool_calls_in(prompt)
        done = 0
        for k, step in enumerate(steps):
            calls = tool_calls_in(step)
            if (calls and calls[0] in seen) or (not calls and step in prompt):
                done = k + 1
        return done

    def __call__(self, input_ids: list[int]) -> Step:
        prompt = TOK.decode(input_ids)
        last_user = prompt[prompt.rfind("<|im_start|>user"):]
        if SUMMARY_MARK in last_user:
            self.calls["summary"] += 1
            done = self._progress(prompt, self.main_steps)
            return Step(output_ids=engine_ids(
                "<analysis>\nThe user asked for hello.txt and sub.txt.\n</analysis>\n\n"
                f"<summary>\n1. hello.txt written, read and edited; a sub-agent wrote sub.txt. "
                f"{DONE_MARK.format(done)}\n</summary>"
            ))
        first_user = prompt[prompt.find("<|im_start|>user"):]
        if self.sub_task in first_user[: first_user.find("<|im_end|>")]:
            self.calls["sub-agent"] += 1
            done = self._progress(prompt, self.sub_steps)
            return Step(output_ids=engine_ids(self.sub_steps[min(done, len(self.sub_steps) - 1)]))
        self.calls["main"] += 1
        done = self._progress(prompt, self.main_steps)
        for k in range(len(self.main_steps), 0, -1):  # a summary carries the count across the cut
            if DONE_MARK.format(k) in prompt:
                done = max(done, k)
                break
        return Step(output_ids=engine_ids(self.main_steps[min(done, len(self.main_steps) - 1)]))


def claude_env(home: Path, base_url: str, api_key: str, **extra: str) -> dict[str, str]:
    """The offline headless environment of notes §2: nothing but the proxy is contacted."""
    return {
        "PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
        "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": api_key, "ANTHROPIC_MODEL": "gyre-policy",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "IS_SANDBOX": "1", **extra,
    }


def run_claude(prompt: str, *, cwd: Path, env: dict[str, str], timeout_s: float = 240) -> dict[str, Any]:
    """``claude -p`` headless; returns its ``--output-format json`` result (raises with stderr on failure)."""
    proc = subprocess.run(
        [str(CLAUDE_BIN), "-p", prompt, "--output-format", "json", "--dangerously-skip-permissions"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise AssertionError(f"claude exited {proc.returncode}\nstdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def claude_version() -> str | None:
    if not os.access(CLAUDE_BIN, os.X_OK):
        return None
    out = subprocess.run([str(CLAUDE_BIN), "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.split()[0] if out.returncode == 0 and out.stdout else None
