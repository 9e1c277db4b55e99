"""gyre-view over real run folders: a Claude Code execution with a sub-agent recorded by the real
proxy, shown in a real headless Chromium; half-written and torn run folders answered with a page."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from controller import wire
from harness_proxy.auth import mint_token
from tests.harness_proxy import SECRET, LiveProxy
from tests.harness_proxy.claude_code import CodingScript, claude_env, run_claude
from tests.harness_proxy.test_claude_code import COMPACT_ENV, TASK, call_records
from trajectory.log import AppendLog
from viewer.main import serve

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def write_run(run_dir: Path, records: list[wire.CallRecord], *, grade: wire.Grade) -> None:
    """A run folder as the controller and processor leave it, for one execution."""
    eid = grade.execution_id
    (run_dir / "processor").mkdir(parents=True)
    log = AppendLog(run_dir / "processor" / "processor.log", fsync=False)
    list(log.replay())
    log.append_many([wire.encode(r) for r in records] + [wire.encode(grade)])
    log.close()
    (run_dir / "cellrunner.json").write_text(json.dumps(
        {"model": {"tokenizer": "qwen_compact", "compact_ranks": 4096},  # the proxy tests' TOK
         "algo": {"max_trajectories_per_execution": 5}}))
    (run_dir / "metrics.jsonl").write_text(json.dumps(
        {"kind": "execution", "id": eid, "step": 0, "train": True, "task": "t", "harness": "claude_code",
         "outcome": "finished", "run_s": 12.5, "reward": grade.reward, "state": "graded"}) + "\n")
    work = run_dir / "work" / eid
    work.mkdir(parents=True)
    (work / "grade.json").write_text(json.dumps({"reward": grade.reward, "error": None}))
    (work / "stdout.log").write_text("Done: the harness's own words\n")


@pytest.fixture
def viewer():
    servers = []

    def start(run_dir: Path) -> str:
        server = serve(run_dir, "127.0.0.1", 0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture(scope="module")
def claude_code_run(tmp_path_factory) -> Path:
    """The real pinned Claude Code through the real proxy: a tool loop, a sub-agent, a compaction."""
    tmp = tmp_path_factory.mktemp("cc")
    home, work = tmp / "home", tmp / "work"
    home.mkdir()
    work.mkdir()
    proxy = LiveProxy(num_engines=2, max_request_bytes=8 << 20, max_context_tokens=400_000, max_new_tokens_cap=4096)
    try:
        script = CodingScript(work)
        for e in proxy.engines:
            e.policy = script
        run_claude(TASK, cwd=work, env=claude_env(home, proxy.url, mint_token(SECRET, "ex-cc"), **COMPACT_ENV))
        records = call_records(proxy.recv_all())
    finally:
        proxy.close()
    assert {r.lineage for r in records} >= {"main", "sub-agent"}
    run_dir = tmp / "run"
    write_run(run_dir, records, grade=wire.Grade(execution_id="ex-cc", group_id="g", step=0, group_size=1,
                                                 outcome="finished", reward=1.0, train=True))
    return run_dir


@pytest.mark.e2e
def test_a_claude_code_tree_with_a_sub_agent_in_headless_chromium(claude_code_run, viewer, tmp_path):
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: make system-packages installs it"
    base = viewer(claude_code_run)
    url = f"{base}/execution/ex-cc"
    profile = tmp_path / "profile"
    dom = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120).stdout
    assert "Execution ex-cc" in dom
    assert "class=\"edge sub-agent\"" in dom and "class=\"edge main\"" in dom  # both branches drawn
    text = html.unescape(re.sub(r"<[^>]+>", "", dom))
    assert "sub-agent was here" in text  # the sub-agent's own words, decoded token by token
    assert "<td class=\"label\">sub-agent</td>" in dom and "<td class=\"label\">main-summary</td>" in dom
    assert "title=\"logprob" in dom and "background:hsl(" in dom  # the heat strip
    assert "its kept trajectories were trained" in dom and "the harness's own words" in dom
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "viewer-claude-code.png"
    shot.unlink(missing_ok=True)
    subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1280,2000",
                    f"--screenshot={shot}", url], capture_output=True, timeout=120)
    assert shot.stat().st_size > 10_000  # kept as the test's artifact


def test_filters_and_bad_requests(claude_code_run, viewer):
    base = viewer(claude_code_run)
    assert "ex-cc" in get(f"{base}/?min_reward=0.5&harness=claude_code")[1]
    assert "ex-cc" not in get(f"{base}/?max_reward=0.5")[1]
    assert "ex-cc" not in get(f"{base}/?outcome=crashed")[1]
    status, body = get(f"{base}/?min_reward=lots")
    assert status == 400 and "Traceback" not in body
    assert get(f"{base}/execution/nope")[0] == 404
    assert get(f"{base}/execution/..%2F..%2Fetc")[0] == 404


def test_missing_half_written_and_torn_run_folders_get_a_clear_page(claude_code_run, viewer, tmp_path):
    status, body = get(f"{viewer(tmp_path / 'nothing')}/")
    assert status == 404 and "no run folder" in body
    empty = tmp_path / "empty"
    (empty / "processor").mkdir(parents=True)
    (empty / "metrics.jsonl").write_text('{"kind": "execution", "id": "e1", "outcome": "fin')  # torn line
    status, body = get(f"{viewer(empty)}/")
    assert status == 200 and "not JSON" in body and "processor.log: missing" in body
    torn = tmp_path / "torn"
    shutil.copytree(claude_code_run, torn)
    log = torn / "processor" / "processor.log"
    size = log.stat().st_size
    with open(log, "ab") as f:
        f.write(b"\x10\x00\x00\x00garbage")  # a processor killed mid-write
    status, body = get(f"{viewer(torn)}/execution/ex-cc")
    assert status == 200 and "torn entry" in body and "sub-agent" in body
    assert log.stat().st_size == size + 11  # read-only: the torn tail is left as it was
