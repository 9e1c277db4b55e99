"""gyre-view over HTTP, against the real server: filters, bad requests, escaping, read-only, the CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from base import wire
from base.tokenizer import get_tokenizer
from tests.trajectory import ASSISTANT, END, SYS, USER, grade
from tests.trajectory import Run as Calls
from tests.viewer import TOKENIZER, get, snapshot, write_run

TOK = get_tokenizer(TOKENIZER["tokenizer"], TOKENIZER["compact_ranks"])
GYRE_VIEW = Path(sys.executable).parent / "gyre-view"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Three train executions (rewards 1, 0, crashed) and an eval one; one more harness in metrics."""
    msgs: list[wire.Message] = []
    for k in range(4):
        c = Calls(f"e{k}")
        p = c.call([SYS, *TOK.encode(f"task {k}: <script>alert({k})</script>"), USER, ASSISTANT],
                   TOK.encode(f"<b>done {k}</b>") + [END])
        c.call(p + [USER, ASSISTANT], TOK.encode("ok") + [END])
        msgs += [*c.records, c.sealed()]
    write_run(tmp_path, msgs, [grade("e0", "g", 1.0, group_size=3), grade("e1", "g", 0.0, group_size=3),
                               grade("e2", "g", None, group_size=3, outcome="crashed"),
                               grade("e3", "eval", 0.5, group_size=1, train=False)])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "execution", "id": "m0", "step": 1, "train": True, "harness": "<i>mini</i>",
                            "outcome": "timed_out", "reward": 0.25, "run_s": 3.0}) + "\n")
    return tmp_path


def listed(body: str) -> list[str]:
    return re.findall(r"href='/execution/([^']+)'", body)


def test_filters_pick_executions(run_dir: Path, viewer) -> None:
    base = viewer(run_dir)
    assert listed(get(f"{base}/")[1]) == ["e0", "e1", "e2", "e3", "m0"]
    assert listed(get(f"{base}/?min_reward=0.5")[1]) == ["e0", "e3"]
    assert listed(get(f"{base}/?min_reward=0.1&max_reward=0.5&kind=train")[1]) == ["m0"]
    assert listed(get(f"{base}/?outcome=crashed")[1]) == ["e2"]
    assert listed(get(f"{base}/?harness=claude_code&kind=eval")[1]) == ["e3"]
    assert listed(get(f"{base}/?harness=%3Ci%3Emini%3C%2Fi%3E&outcome=&bogus=1")[1]) == ["m0"]
    body = get(f"{base}/?outcome=finished")[1]
    assert "<option selected>finished</option>" in body and "Executions (3 of 5)" in body


@pytest.mark.parametrize("query, why", [
    ("min_reward=lots", "min_reward=&#x27;lots&#x27;: want a finite number"),
    ("max_reward=nan", "want a finite number"),
    ("outcome=exploded", "outcome=&#x27;exploded&#x27;: want one of finished, timed_out, crashed"),
    ("kind=both", "want train or eval"),
])
def test_a_bad_filter_gets_a_400_page(run_dir: Path, viewer, query: str, why: str) -> None:
    status, body = get(f"{viewer(run_dir)}/?{query}")
    assert status == 400 and why in body and "Traceback" not in body


def test_unknown_pages_executions_and_folders_get_a_404_page(run_dir: Path, viewer, tmp_path: Path) -> None:
    base = viewer(run_dir)
    for path, why in [("/execution/nope", "no execution &#x27;nope&#x27;"),
                      ("/execution/..%2F..%2Fetc%2Fpasswd", "no execution &#x27;../../etc/passwd&#x27;"),
                      ("/favicon.ico", "no page &#x27;/favicon.ico&#x27;")]:
        status, body = get(base + path)
        assert status == 404 and why in body and "Traceback" not in body
    status, body = get(f"{viewer(tmp_path / 'nothing')}/execution/e0")
    assert status == 404 and "no run folder at" in body


def test_text_from_the_run_is_escaped(run_dir: Path, viewer) -> None:
    base = viewer(run_dir)
    page = get(f"{base}/execution/e0")[1]
    assert "task 0: &lt;script&gt;alert(0)&lt;/script&gt;" in page  # the prompt, decoded, as text
    assert "&lt;b&gt;" in "".join(re.findall(r">([^<]*)</span>", page))  # the output, token by token
    run_page = get(f"{base}/")[1]
    assert "&lt;i&gt;mini&lt;/i&gt;" in run_page
    for body in (page, run_page):
        assert not re.search(r"<(script|b|i)>", body)


def test_pages_of_a_half_written_and_torn_run_write_nothing(run_dir: Path, viewer, tmp_path: Path) -> None:
    with open(run_dir / "processor" / "processor.log", "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02\x03\x04torn")
    (run_dir / "summary.json").write_text('{"steps": ')
    before = snapshot(run_dir)
    base = viewer(run_dir)
    status, body = get(f"{base}/")
    assert status == 200 and "log ends in a torn entry after" in body and "summary.json: unreadable" in body
    for eid in listed(body):
        assert get(f"{base}/execution/{eid}")[0] == 200
    assert snapshot(run_dir) == before
    (tmp_path / "fresh" / "processor").mkdir(parents=True)  # a run started a moment ago
    status, body = get(f"{viewer(tmp_path / 'fresh')}/")
    assert status == 200 and "processor/processor.log: missing" in body and "metrics.jsonl: missing" in body


def test_the_cli_serves_loopback_on_a_free_port_and_prints_its_url(run_dir: Path) -> None:
    proc = subprocess.Popen([str(GYRE_VIEW), str(run_dir), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        url = re.match(r"gyre-view: (http://127\.0\.0\.1:\d+/) ", line)
        assert url, line
        status, body = get(url.group(1) + "execution/e0")
        assert status == 200 and "trained: the processor sent" in body and "in attempt 0" in body
        port = url.group(1).rsplit(":", 1)[1].rstrip("/")
        taken = subprocess.run([str(GYRE_VIEW), str(run_dir), "--port", port], capture_output=True, text=True, timeout=30)
        assert taken.returncode == 2 and f"cannot serve on 127.0.0.1:{port}" in taken.stderr
    finally:
        proc.terminate()
        proc.wait(10)
