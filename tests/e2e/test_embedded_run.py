"""The embedded default, end to end: real processes, ZeroMQ sockets and HTTP, a short run.

While the run goes, the test throws a malformed frame at the controller's socket, a malformed
request at the proxy, and SIGKILLs a harness mid-run; each must leave a clear line in the logs
and the run must finish. Afterwards: training moved the weights, and the engines served the new
versions (the CallRecords say which version produced each call).
"""

import json
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
import safetensors.numpy
import yaml
import zmq

from cellrunner.config import ModelConfig
from cellrunner.model import build_model, flatten_params
from base import wire
from base.typed_config import build
from base.tokenizer import get_tokenizer
from tests.e2e import ROOT, call_records, member_socket, metrics, run_gyre_with

STEPS = 3


def inject_faults(run_dir: Path, done: threading.Event, report: dict) -> None:
    """Wait for the run to be up, then misbehave once in each of three ways."""
    endpoints = run_dir / "endpoints.json"
    while not endpoints.exists() and not done.is_set():
        time.sleep(0.1)
    if done.is_set():
        return
    ep = json.loads(endpoints.read_text())
    ctx = zmq.Context.instance()
    # a member of the run (CURVE admits nobody else; tests/e2e/test_curve.py) gone wrong
    dealer = member_socket(ctx, run_dir, "cell-1", zmq.DEALER, "controller")
    dealer.connect(ep["controller"])
    dealer.send(b"\x93\x01\xa5bogus\x80")  # [1, "bogus", {}]: a valid msgpack frame with an unknown tag
    if dealer.poll(10_000):
        report["controller_reply"] = wire.decode(dealer.recv())
    dealer.close(0)
    req = urllib.request.Request(f"{ep['proxy']}/v1/chat/completions", data=b"{not json",
                                 headers={"Authorization": "Bearer nope", "Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=10)
    except urllib.error.HTTPError as exc:
        report["proxy_status"] = exc.code
    # A stranger on the node at a cell's engine: refused without the run's key.
    gen = urllib.request.Request(f"{ep['cells']['0']}/generate", data=b'{"input_ids": [1], "sampling_params": {}}',
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(gen, timeout=10)
    except urllib.error.HTTPError as exc:
        report["engine_status"] = exc.code
    secret = (run_dir / "proxy.secret").read_text().strip()
    engine_key = (run_dir / "engine.key").read_text().strip()
    token = re.compile(r"gyre\.[A-Za-z0-9_-]+\.\d+\.[te]\.[0-9a-f]{64}")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not done.is_set():
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            line = " ".join(cmd)
            if secret in line or engine_key in line or token.search(line):  # /proc/<pid>/cmdline is every local user's to read
                report["secret_on_argv"] = line  # the bundled harness: `python3 -I .../workloads/harness.py`, in its sandbox
            if len(cmd) > 2 and cmd[2].endswith("workloads/harness.py") and is_of_run(p, run_dir):
                try:
                    p.send_signal(signal.SIGKILL)
                    report["killed_harness"] = " ".join(cmd)
                    return
                except psutil.NoSuchProcess:
                    continue
        time.sleep(0.02)


def is_of_run(proc: psutil.Process, run_dir: Path) -> bool:
    """Whether ``proc`` was started by this run: inside the sandbox the harness sees fixed paths
    (/workspace), so only the ``bwrap`` above it names the run's folder in its bind mounts."""
    try:
        return any(str(run_dir) in " ".join(parent.cmdline()) for parent in proc.parents())
    except psutil.Error:
        return False


@pytest.mark.e2e
def test_short_embedded_run(tmp_path):
    runs = tmp_path / "runs"
    run_dir, report = run_gyre_with(runs, inject_faults, f"run.steps={STEPS}", "run.eval_every=1")
    summary = json.loads((run_dir / "summary.json").read_text())

    # The run finished its steps, every cell served, cells switched and trained.
    assert summary["steps"] == STEPS
    assert all(c["served_s"] > 0 for c in summary["cells"])
    assert any(c["trained_s"] > 0 and c["core"] for c in summary["cells"])
    assert sum(c["switches"] for c in summary["cells"]) >= 2
    assert summary["switch_s"]["to_train_median"] is not None
    for name in ("reward.png", "roles.png", "report.md", "metrics.jsonl"):
        assert (run_dir / name).stat().st_size > 0

    # Training changed the weights: the core's final checkpoint differs from the seeded init.
    model_cfg = build(ModelConfig, yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text()))
    tok = get_tokenizer(model_cfg.tokenizer, model_cfg.compact_ranks)
    init = flatten_params(build_model(model_cfg, tok.vocab_size), 0)
    final = safetensors.numpy.load_file(str(run_dir / f"checkpoints/v{STEPS}/model.safetensors"))
    first = init.specs[0]
    n = int(np.prod(first.shape))
    assert not np.allclose(final[first.name].reshape(-1), init.data[first.offset:first.offset + n])

    # The engines served the new versions: records carry the version that produced them.
    records = call_records(run_dir)
    versions = {r.weight_version for r in records}
    assert 0 in versions and max(versions) >= 1, versions
    eval_end = [r for r in records if r.execution_id.startswith("eval-end")]
    assert eval_end and all(r.weight_version == STEPS for r in eval_end)

    # run.eval_every=1: a held-out round at each version between, beside the rollouts, logged once.
    evals = [e for e in metrics(run_dir, "eval")]
    assert [e["label"] for e in evals if e["label"].startswith("v")] == [f"v{v}" for v in range(1, STEPS)]
    assert {e["label"] for e in evals} >= {"start", "end"}
    periodic = [r for r in records if r.execution_id.startswith("eval-v")]
    assert periodic and all(r.weight_version >= int(r.execution_id.split("-")[1][1:]) for r in periodic)

    # Each injected fault left a clear line and the run went on.
    ctl_log = (run_dir / "controller.log").read_text()
    assert isinstance(report.get("controller_reply"), wire.ErrorReply)
    assert "unknown tag 'bogus'" in ctl_log
    assert report.get("proxy_status") in (400, 401)
    assert report.get("engine_status") == 401  # the engine wants the run's key (base.engine_key)
    assert "killed_harness" in report, "no harness process was caught running"
    assert "secret_on_argv" not in report, report.get("secret_on_argv")
    assert "harness crashed" in ctl_log
