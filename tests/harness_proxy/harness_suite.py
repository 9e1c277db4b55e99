"""What the suites of the real pinned harness binaries share: the proxy and folders they run in,
the checks on their CallRecords (drift, splices), and per harness (``HARNESSES``, keyed like
``test_proxy_restart``'s) how its scripted session is run and what it must leave behind.

``test_harnesses.py`` runs each shared test against every harness; ``test_claude_code.py`` and
``test_qwen_code.py`` keep what only one of them does, on the same fixtures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from base import wire
from harness_proxy.template import generation_prompt
from tests.harness_proxy import TOK, LiveProxy
from tests.harness_proxy.claude_code import (
    CLAUDE_BIN, CLAUDE_CODE_VERSION, CodingScript, claude_env, claude_version, run_claude,
)
from tests.harness_proxy.qwen_code import (
    QWEN_BIN, QWEN_CODE_VERSION, QwenCodingScript, qwen_env, qwen_version, run_qwen,
)

TASK = "Create hello.txt, edit it, and have a sub-agent write sub.txt."
# Auto-compaction at 40% of a 100k window: above the ~17k-id prompts before the large Bash output
# (compact vocabulary), below the ~45k-id prompt after it, so exactly one compaction happens.
COMPACT_ENV = {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "40"}

QWEN_HARNESS_TURNS = ("Got it. Thanks for the context!<|im_end|>", "Got it. Thanks for the additional context!<|im_end|>")
"""Assistant turns Qwen Code writes itself (after its environment preamble and after a compression)."""


@pytest.fixture
def proxy():
    p = LiveProxy(num_engines=2, max_request_bytes=8 << 20, max_context_tokens=400_000, max_new_tokens_cap=4096)
    yield p
    p.close()


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    return home, work


def call_records(msgs: list[wire.Message]) -> list[wire.CallRecord]:
    return [m for m in msgs if isinstance(m, wire.CallRecord)]


def assistant_turns(prompt_ids: list[int]) -> list[list[int]]:
    """The ids of each complete assistant turn in a prompt, from after ``<|im_start|>assistant\\n``
    through its ``<|im_end|>`` (the trailing generation prompt has none and is left out)."""
    head = generation_prompt(TOK)
    turns = []
    for i in range(len(prompt_ids) - len(head)):
        if prompt_ids[i : i + len(head)] == head:
            start = i + len(head)
            try:
                end = prompt_ids.index(TOK.im_end, start)
            except ValueError:
                continue
            turns.append(prompt_ids[start : end + 1])
    return turns


def drift(records: list[wire.CallRecord], harness_turns: tuple[str, ...] = ()) -> tuple[int, int]:
    """(echoed policy tokens, of which differ from the engine's originals).

    Every assistant turn in every prompt is an echo of some earlier output (the engine is the
    only author of assistant turns here, except ``harness_turns``: those the harness writes
    itself, left out), whether the proxy spliced the history or rendered it afresh: a turn that
    is not id-for-id one of the engine's outputs has drifted, all of it.
    """
    echoed = differ = 0
    outputs: set[tuple[int, ...]] = set()
    for r in records:
        for turn in assistant_turns(r.prompt_ids):
            if harness_turns and TOK.decode(turn) in harness_turns:
                continue
            echoed += len(turn)
            differ += 0 if tuple(turn) in outputs else len(turn)
        outputs.add(tuple(r.output_ids))
    return echoed, differ


def continues(later: wire.CallRecord, earlier: wire.CallRecord) -> bool:
    n = len(earlier.prompt_ids) + len(earlier.output_ids)
    return later.prompt_ids[:n] == earlier.prompt_ids + earlier.output_ids


@dataclass(frozen=True)
class Harness:
    """One pinned harness binary, and the scripted session (``TASK``: a tool loop and a
    foreground sub-agent) that the shared tests run it through."""

    binary: Path
    version: str  # pinned in the Makefile
    installed_version: Callable[[], str | None]
    make_target: str  # installs the pinned version
    make_script: Callable[[Path], Any]  # the engine's policy for the session, given the work folder
    run: Callable[[Path, Path, str, str], dict[str, Any]]  # (work, home, proxy url, api key) -> its result
    execution_id: str
    hello: str  # what hello.txt holds once the session has edited it
    calls: dict[str, int]  # the script's call counts, its background ones left out
    lineages: dict[str, int]  # CallRecords per lineage, side calls left out
    trajectories: list[str]  # the tree's trajectory kinds, sorted
    background: str | None = None  # the script's count of background side calls (timing-dependent)
    harness_turns: tuple[str, ...] = ()  # assistant turns the harness writes itself: not drift
    agent_id_prefix: str = ""  # how a sub-agent's agent_id starts
    compacts: bool = False  # the session's history is compacted once, under a new root
    settle_ms: int = 200  # how long the records may trail the harness's exit


def run_claude_session(work: Path, home: Path, url: str, api_key: str) -> dict[str, Any]:
    return run_claude(TASK, cwd=work, env=claude_env(home, url, api_key, **COMPACT_ENV))


def run_qwen_session(work: Path, home: Path, url: str, api_key: str) -> dict[str, Any]:
    return run_qwen(TASK, cwd=work, env=qwen_env(home, url, api_key))


HARNESSES = {
    "claude_code": Harness(
        binary=CLAUDE_BIN, version=CLAUDE_CODE_VERSION, installed_version=claude_version, make_target="claude-code",
        make_script=CodingScript, run=run_claude_session, execution_id="ex-cc", hello="hello from gyre, edited\n",
        calls={"main": 8, "sub-agent": 2, "summary": 1}, lineages={"main": 8, "sub-agent": 2, "main-summary": 1},
        # The main line before the compaction (its last tool_use turn is a leaf: the summary branched
        # off before it), the summary branch, the main line from the new root, the sub-agent.
        trajectories=["main", "main", "main-summary", "sub-agent"],
        agent_id_prefix="a",  # Claude Code names its agents
        compacts=True,
    ),
    # Qwen Code sends no header that says which agent is calling: the proxy derives each line.
    "qwen_code": Harness(
        binary=QWEN_BIN, version=QWEN_CODE_VERSION, installed_version=qwen_version, make_target="qwen-code",
        make_script=QwenCodingScript, run=run_qwen_session, execution_id="ex-qwen", hello="hello from qwen, edited\n",
        calls={"main": 5, "sub-agent": 2, "other": 0}, lineages={"main": 5, "sub-agent": 2},
        trajectories=["main", "sub-agent"],  # one main trajectory, the sub-agent's calls in between notwithstanding
        background="memory",  # the background memory extraction, if it ran before exit
        harness_turns=QWEN_HARNESS_TURNS,
        settle_ms=1000,
    ),
}
