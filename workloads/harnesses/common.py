"""What every harness process gets, whatever its kind, and the placeholders of ``harness=command``."""

from __future__ import annotations

import os
from pathlib import Path

from workloads.api import HarnessLaunch

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TOOLS_DIR = PROJECT_ROOT / ".tools"
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def common_env(launch: HarnessLaunch) -> dict[str, str]:
    """The proxy's URLs and the execution's token under the names both SDKs read, and the prompt file."""
    return {
        "PATH": SYSTEM_PATH, "HOME": str(launch.home), "LANG": "C.UTF-8", "TERM": "dumb",
        "OPENAI_BASE_URL": launch.base_url, "OPENAI_API_KEY": launch.token,
        "ANTHROPIC_BASE_URL": launch.anthropic_base_url, "ANTHROPIC_API_KEY": launch.token,
        "GYRE_PROMPT_FILE": str(launch.prompt_file), "GYRE_WORKSPACE": str(launch.workspace),
        "GYRE_MODEL": launch.model,
    }


def placeholders(launch: HarnessLaunch) -> dict[str, str]:
    return {
        "prompt_file": str(launch.prompt_file), "workspace": str(launch.workspace), "model": launch.model,
        "base_url": launch.base_url, "anthropic_base_url": launch.anthropic_base_url, "token": launch.token,
    }


def expand(text: str, values: dict[str, str]) -> str:
    """``text`` with each ``{name}`` replaced; an unknown ``{name}`` is an error (a typo would
    otherwise reach the harness verbatim)."""
    out, i = [], 0
    while i < len(text):
        start = text.find("{", i)
        if start < 0:
            out.append(text[i:])
            break
        end = text.find("}", start)
        if end < 0:
            raise ValueError(f"harness: unclosed placeholder in {text!r}")
        name = text[start + 1:end]
        if name not in values:
            raise ValueError(f"harness: unknown placeholder {{{name}}} in {text!r}; known: {sorted(values)}")
        out += [text[i:start], values[name]]
        i = end + 1
    return "".join(out)


def is_root() -> bool:
    return os.geteuid() == 0


def missing_binary(path: Path, kind: str, make_target: str) -> str:
    """'' when ``path`` is an executable; else the one line that says how to install it."""
    if os.access(path, os.X_OK):
        return ""
    return f"harness={kind}: {path} is not installed; run `make {make_target}`"


def read_prompt(launch: HarnessLaunch) -> str:
    return launch.prompt_file_on_host.read_text(encoding="utf-8")


# Linux caps one argv string at 128 KiB; a prompt is passed on argv by harnesses that take it there.
MAX_ARG_BYTES = 120 * 1024


def prompt_arg(launch: HarnessLaunch) -> str:
    prompt = read_prompt(launch)
    if len(prompt.encode("utf-8")) > MAX_ARG_BYTES:
        raise ValueError(f"{launch.execution_id}: the task's prompt is over {MAX_ARG_BYTES} bytes, more than "
                         "a command-line argument may hold; use harness=command with {prompt_file}")
    return prompt
