from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest

from base import wire
from base.execution_token import mint_token
from tests.harness_proxy import SECRET, LiveProxy
from tests.harness_proxy.claude_code import CodingScript, claude_env, run_claude
from tests.harness_proxy.harness_suite import COMPACT_ENV, TASK
from tests.viewer import write_run
from viewer.main import serve


@pytest.fixture
def viewer():
    """Start a real gyre-view server on a free loopback port: ``viewer(run_dir) -> base URL``."""
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


@pytest.fixture(scope="session")
def claude_code_run(tmp_path_factory) -> tuple[Path, Counter]:
    """The pinned Claude Code, run for real through the real proxy with the scripted engine of
    tests/harness_proxy/test_harnesses.py (a tool loop, a sub-agent, one compaction), sealed as
    the controller seals it, graded, and logged by the processor's own service into a run folder.
    Returns the folder and the policy tokens the processor sent to train."""
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
        proxy.seal("ex-cc")
        messages = proxy.recv_all()
    finally:
        proxy.close()
    assert {m.lineage for m in messages if isinstance(m, wire.CallRecord)} >= {"main", "sub-agent", "main-summary"}
    assert isinstance(messages[-1], wire.ExecutionSealed)
    run_dir = tmp / "run"
    sent = write_run(run_dir, messages, [wire.Grade(execution_id="ex-cc", group_id="g0", step=0, group_size=1,
                                                    outcome="finished", reward=1.0, train=True)])
    assert sent["ex-cc"] > 0
    return run_dir, sent
