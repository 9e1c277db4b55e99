"""The execution page of a real Claude Code run with a sub-agent and a compaction, in a real
headless Chromium: both branches drawn with their decoded text, the cap's and the trainer's marks
matching what the processor sent, the heat strip. The screenshot stays in tests/artifacts/."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


class Edges(HTMLParser):
    """Each tree box's CSS class and its own text (nested boxes not included), and the heat
    strip's spans counted by class."""

    def __init__(self) -> None:
        super().__init__()
        self.edges: list[tuple[str, list[str]]] = []
        self._stack: list[int | None] = []  # per open div: its index in edges, or None
        self.spans: Counter = Counter()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "div":
            if a.get("class", "").startswith("edge "):
                self.edges.append((a["class"].removeprefix("edge "), []))
                self._stack.append(len(self.edges) - 1)
            else:
                self._stack.append(None)
        elif tag == "span" and "logprob" in a.get("title", "") and "hsl(" in a.get("style", ""):
            self.spans[a.get("class", "")] += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "div":
            self._stack.pop()

    def handle_data(self, data: str) -> None:
        box = next((i for i in reversed(self._stack) if i is not None), None)
        if box is not None:
            self.edges[box][1].append(data)


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.e2e
def test_a_claude_code_tree_with_a_sub_agent_in_headless_chromium(claude_code_run, viewer, tmp_path) -> None:
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: `make system-packages` installs it"
    run_dir, sent = claude_code_run
    base = viewer(run_dir)
    dom = chromium("--dump-dom", f"{base}/", profile=tmp_path / "p").stdout
    assert "Run run" in dom and "href=\"/execution/ex-cc\"" in dom

    url = f"{base}/execution/ex-cc"
    dom = chromium("--dump-dom", url, profile=tmp_path / "p").stdout
    assert "Execution ex-cc" in dom
    page = Edges()
    page.feed(dom)
    text = {cls: ["".join(t) for c, t in page.edges if c == cls] for cls in ("main", "main-summary", "sub-agent")}
    assert all(text.values()), [c for c, _ in page.edges]  # every branch drawn in its own box
    sub = "\n".join(text["sub-agent"])
    assert "containing the line: sub-agent was here" in sub  # the sub-agent's prompt, decoded
    assert re.search(r"T\d+ sub-agent", sub) and "(agent " in sub
    assert "sub-agent was here" not in "\n".join(text["main-summary"])  # its words stay on its branch
    # The cap kept every branch; each trained token is marked once, as many as the processor sent.
    assert dom.count(">kept #") == 4 and "over the cap" not in dom
    assert page.spans["trained"] == sent["ex-cc"] and page.spans["untrained"] == 0
    assert f"trained: the processor sent {sent['ex-cc']} policy tokens" in dom
    assert "the harness's own words for ex-cc in attempt 0" in dom and "reward 1.0, train True" in dom

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "viewer-claude-code.png"
    shot.unlink(missing_ok=True)
    chromium("--window-size=1280,2000", f"--screenshot={shot}", url, profile=tmp_path / "p")
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
