"""engine=sglang on CPU: the launch command, and the whole lifecycle against a stand-in checked
against SGLang's own contract.

SGLang cannot run on these CPUs (``shared/notes/cpu-stack.md`` §4), so the server here is a
stand-in: a small aiohttp program (``tests/support/sglang_standin/``) put first on ``PYTHONPATH``
as a ``sglang`` package and started by the real ``SGLangEngine`` as ``python -m
sglang.launch_server ...``: a real process in its own session, real HTTP. Each of its behaviours
(``200 null`` on release and resume, ``/flush_cache`` 400 while the scheduler is busy, an update
without ``load_format`` failing on a ``dummy`` server, ...) names the file of the sglang 0.5.23
wheel it mirrors. Every request body the engine sends and every reply the stand-in gives is
validated against SGLang's own types, read from the pinned wheel installed without its
dependencies (``tests/support/sglang_contract.py``; missing wheel: a failure in CI).
``scripts/gpu_check.sh`` runs the real server on a GPU.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml
import torch

from cellrunner.config import ModelConfig
from cellrunner.engine_sglang import (
    SGLangConfig, SGLangEngine, SGLangError, launch_command, model_config_json, parse_metrics,
)
from cellrunner.model import FlatWeights, build_model, flatten_params
from base.typed_config import ConfigError, build

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 300

STANDIN = ROOT / "tests" / "support" / "sglang_standin"
"""The SGLang stand-in: a ``sglang`` package whose ``launch_server`` is an aiohttp TEST DOUBLE."""
KV_TIER_DEFAULT = yaml.safe_load(open(ROOT / "conf/engine/sglang.yaml"))["kv_tier"]
"""``engine.kv_tier`` as conf/engine/sglang.yaml has it: off (tests/cellrunner/test_sglang_hicache.py turns it on)."""


def sglang_cfg(tmp_path: Path, **over) -> SGLangConfig:
    base = dict(kind="sglang", python="", tp_size=1, dp_size=1, ep_size=1, nnodes=1, dist_init_port=0,
                mem_fraction_static=0.7, dtype="bfloat16", context_length=0, disable_cuda_graph=False,
                weight_update="disk", weight_dir=str(tmp_path / "weights"),
                startup_timeout_s=30.0, request_timeout_s=30.0, poll_interval_s=0.02, extra_args=[],
                flush_cache_timeout_s=30.0, kv_tier=KV_TIER_DEFAULT)
    return build(SGLangConfig, {**base, **over})


def model_cfg() -> ModelConfig:
    return build(ModelConfig, yaml.safe_load(open(ROOT / "conf/model/tiny.yaml")))


def weights(version: int) -> FlatWeights:
    w = flatten_params(build_model(model_cfg(), VOCAB), 0)
    return FlatWeights(version, w.specs, w.data + np.float32(version))


# ---------------------------------------------------------------- pure parts


def test_launch_command_from_config(tmp_path):
    cfg = sglang_cfg(tmp_path, tp_size=4, dp_size=2, ep_size=8, context_length=4096, disable_cuda_graph=True,
                     extra_args=["--enable-hierarchical-cache"])
    cmd = launch_command(cfg, model_path="/m", host="10.0.0.1", port=30001, max_running=64, seed=5,
                         dummy_weights=True)
    assert cmd[:2] == [sys.executable, "-c"] and "runpy.run_module('sglang.launch_server'" in cmd[2]
    flags = dict(zip(cmd[3:], cmd[4:]))
    assert flags["--model-path"] == "/m" and flags["--host"] == "10.0.0.1" and flags["--port"] == "30001"
    assert (flags["--tp-size"], flags["--dp-size"], flags["--ep-size"]) == ("4", "2", "8")
    assert flags["--max-running-requests"] == "64" and flags["--random-seed"] == "5"
    assert flags["--load-format"] == "dummy" and flags["--dtype"] == "bfloat16" and flags["--context-length"] == "4096"
    for flag in ("--skip-tokenizer-init", "--enable-memory-saver", "--enable-metrics", "--disable-cuda-graph"):
        assert flag in cmd
    assert cmd[-1] == "--enable-hierarchical-cache" and "--nnodes" not in cmd

    plain = launch_command(sglang_cfg(tmp_path), model_path="/m", host="h", port=1, max_running=1, seed=0,
                           dummy_weights=False)
    assert "--ep-size" not in plain and "--load-format" not in plain and "--context-length" not in plain

    multi = sglang_cfg(tmp_path, nnodes=2, tp_size=16, weight_dir="/shared/gyre-weights")  # a shared folder
    cmd = launch_command(multi, model_path="/m", host="h", port=1, max_running=1, seed=0, dummy_weights=True,
                         node_rank=1, dist_init_addr="10.0.0.1:5000")
    flags = dict(zip(cmd[3:], cmd[4:]))
    assert (flags["--nnodes"], flags["--node-rank"], flags["--dist-init-addr"]) == ("2", "1", "10.0.0.1:5000")
    with pytest.raises(ValueError, match="dist_init_addr"):
        launch_command(multi, model_path="/m", host="h", port=1, max_running=1, seed=0, dummy_weights=True)
    with pytest.raises(ValueError, match="node_rank"):
        launch_command(multi, model_path="/m", host="h", port=1, max_running=1, seed=0, dummy_weights=True,
                       node_rank=2, dist_init_addr="a:1")


def test_config_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="tp_size"):
        sglang_cfg(tmp_path, tp_size=0)
    with pytest.raises(ConfigError, match="mem_fraction_static"):
        sglang_cfg(tmp_path, mem_fraction_static=1.5)
    with pytest.raises(ConfigError, match="unknown key"):
        sglang_cfg(tmp_path, tensor_parallel=2)
    with pytest.raises(ConfigError, match="node-local, and a server spanning 2 nodes"):
        sglang_cfg(tmp_path, nnodes=2, weight_dir="/dev/shm/gyre")
    assert sglang_cfg(tmp_path, nnodes=2, weight_dir="/shared/gyre-weights").nnodes == 2


def test_parse_metrics_counts_each_scheduler_once():
    text = textwrap.dedent('''\
        # HELP sglang:num_running_reqs The number of running requests.
        # TYPE sglang:num_running_reqs gauge
        sglang:num_running_reqs{dp_rank="0",model_name="m",tp_rank="0"} 3.0
        sglang:num_running_reqs{dp_rank="0",model_name="m",tp_rank="1"} 3.0
        sglang:num_running_reqs{dp_rank="1",model_name="m",tp_rank="0"} 2.0
        sglang:num_queue_reqs{dp_rank="0",model_name="m",tp_rank="0"} 4.0
        sglang:num_running_reqs_other 100
        sglang:token_usage{model_name="m"} 0.5
    ''')
    assert parse_metrics(text, ("sglang:num_running_reqs", "sglang:num_queue_reqs")) == 9.0
    assert parse_metrics("", ("sglang:num_running_reqs",)) == 0.0
    with pytest.raises(SGLangError, match="not a number"):
        parse_metrics("sglang:num_running_reqs{} x\n", ("sglang:num_running_reqs",))
    with pytest.raises(SGLangError, match="not finite"):
        parse_metrics("sglang:num_running_reqs NaN\n", ("sglang:num_running_reqs",))


def test_model_config_names_the_architecture():
    cfg = model_config_json(model_cfg(), VOCAB, "bfloat16")
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["vocab_size"] == VOCAB
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True


# ---------------------------------------------------------------- against the test double


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    record = tmp_path / "record.json"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(STANDIN), str(ROOT)]))
    monkeypatch.setenv("FAKE_SGLANG_RECORD", str(record))
    return lambda: json.loads(record.read_text())


KEY = "ab" * 32
"""The run's engine key (base.engine_key) the engines here are started with."""


def make_engine(tmp_path: Path, api_key: str = KEY, **over) -> SGLangEngine:
    return SGLangEngine(sglang_cfg(tmp_path, **over), model_cfg=model_cfg(), vocab_size=VOCAB, host="127.0.0.1",
                        port=0, cell_id=3, max_running=8, seed=1, log_dir=str(tmp_path / "logs"), api_key=api_key)


def generate(url: str, max_new_tokens: int, api_key: str = KEY) -> dict:
    req = urllib.request.Request(url + "/generate", method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
                                 data=json.dumps({"input_ids": [1, 2, 3], "return_logprob": True,
                                                  "sampling_params": {"max_new_tokens": max_new_tokens}}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes (its parent has not reaped it yet)
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_lifecycle_against_the_fake_server(tmp_path, fake_sglang):
    engine = make_engine(tmp_path)
    engine.start()
    try:
        rec = fake_sglang()
        assert "--load-format" in rec["argv"] and "--enable-memory-saver" in rec["argv"]
        # SGLang got the run's key as --api-key, yet no command line shows it (every local user
        # reads /proc/<pid>/cmdline); every admin call below carries it, or the server says 401
        assert rec["argv"][-2:] == ["--api-key", KEY]
        server = psutil.Process(engine.process.proc.pid)
        assert all(KEY not in " ".join(p.cmdline()) for p in [server, *server.children(recursive=True)])
        with pytest.raises(urllib.error.HTTPError) as refused:
            generate(engine.url, 1, api_key="0" * 64)
        assert refused.value.code == 401
        assert engine.weight_version is None and engine.num_running() == 0

        engine.resume(weights(0))  # first resume: nothing was released, so only the load
        rec = fake_sglang()
        assert [c[0] for c in rec["calls"]] == ["update_weights_from_disk"]
        loaded = rec["loaded"][-1]
        assert loaded["version"] == "0" and loaded["dtype"] == "torch.bfloat16"
        assert loaded["architectures"] == ["Qwen3ForCausalLM"] and loaded["embed_shape"] == [VOCAB, 128]
        assert sorted(s.name for s in weights(0).specs) == loaded["names"]
        assert generate(engine.url, 2)["meta_info"]["weight_version"] == "0"
        with pytest.raises(RuntimeError, match="already loaded"):
            engine.resume(weights(0))

        engine.update_weights(weights(1))
        rec = fake_sglang()
        assert engine.weight_version == 1 and rec["loaded"][-1]["version"] == "1"
        assert not os.path.exists(rec["loaded"][0]["path"])  # the previous version's files are gone
        assert rec["loaded"][-1]["embed_sum"] != rec["loaded"][0]["embed_sum"]

        # Two long calls are still running when the drain's patience ends: both are aborted and
        # answer with their partial output.
        replies: list[dict] = []
        threads = [threading.Thread(target=lambda: replies.append(generate(engine.url, 2000))) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while engine.num_running() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.num_running() == 2  # counted once although two TP ranks export it
        assert engine.drain(0.2) == 2
        for t in threads:
            t.join(10)
        assert [r["meta_info"]["finish_reason"]["type"] for r in replies] == ["abort", "abort"]
        assert all(0 < len(r["output_ids"]) < 2000 for r in replies)

        calls_before = len(fake_sglang()["calls"])
        engine.release()
        assert engine.weight_version is None and engine.num_running() == 0
        engine.resume(weights(2))
        rec = fake_sglang()
        assert [c[0] for c in rec["calls"][calls_before:]] == [
            # flush_cache until the scheduler is idle before the release and the paused load, as slime does
            "pause_generation", "flush_cache", "release_memory_occupation", "resume_memory_occupation",
            "flush_cache", "update_weights_from_disk", "resume_memory_occupation", "continue_generation",
        ]
        assert rec["calls"][calls_before][1] == {"mode": "abort"}
        assert rec["calls"][calls_before + 3][1] == {"tags": ["weights"]}
        assert rec["calls"][calls_before + 6][1] == {"tags": ["kv_cache", "cuda_graph"]}
        assert rec["released"] == [] and engine.weight_version == 2
        assert generate(engine.url, 1)["meta_info"]["weight_version"] == "2"

        # A server that fails an update says so, in words naming the endpoint.
        req = urllib.request.Request(engine.url + "/fake/mode", data=b'{"mode": "not_json"}', method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        urllib.request.urlopen(req, timeout=10).close()
        with pytest.raises(SGLangError, match="update_weights_from_disk: reply is not JSON"):
            engine.update_weights(weights(3))
    finally:
        child = fake_sglang()["child_pid"]
        engine.stop()
    deadline = time.monotonic() + 10
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child)  # the server's whole session ended, forked children included
    assert not (tmp_path / "weights" / "cell3").exists()  # and its tmpfs weight files are gone


def test_updating_released_weights_is_refused_by_the_server(tmp_path, fake_sglang):
    engine = make_engine(tmp_path)
    engine.start()
    try:
        engine.resume(weights(0))
        engine.release()
        with pytest.raises(RuntimeError, match="released"):
            engine.update_weights(weights(1))  # refused here before asking the server
        engine.servers[0].released = False  # pretend we forgot: the server's 400 comes back as an SGLangError
        with pytest.raises(SGLangError, match="HTTP 400.*weights are released"):
            engine.update_weights(weights(1))
    finally:
        engine.stop()


def test_a_server_that_dies_while_starting_is_reported_with_its_log(tmp_path, fake_sglang, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_FAIL", "1")
    engine = make_engine(tmp_path)
    with pytest.raises(SGLangError, match="(?s)exited with 3.*refusing to start"):
        engine.start()
    engine.stop()
    unknown = make_engine(tmp_path, extra_args=["--no-such-flag"])
    monkeypatch.delenv("FAKE_SGLANG_FAIL")
    with pytest.raises(SGLangError, match="(?s)exited with 2.*unrecognized arguments: --no-such-flag"):
        unknown.start()
    unknown.stop()


def test_a_bf16_serving_copy_is_written_as_it_came(tmp_path):
    """A serving cell pulls the bf16 copy (half the bytes); the folder SGLang loads holds the same
    bf16 values the float32 version rounds to, so a serving cell loses nothing by it."""
    from safetensors.torch import load_file

    from cellrunner.engine_sglang import model_config_json, write_weights
    from cellrunner.model import to_bf16

    w = weights(3)
    served = to_bf16(w)
    assert served.dtype == "bfloat16" and served.nbytes * 2 == w.nbytes
    cfg_json = model_config_json(model_cfg(), VOCAB, "bfloat16")
    a = load_file(os.path.join(write_weights(w, str(tmp_path / "f32"), dtype=torch.bfloat16, config_json=cfg_json),
                               "model.safetensors"))
    b = load_file(os.path.join(write_weights(served, str(tmp_path / "bf16"), dtype=torch.bfloat16,
                                             config_json=cfg_json), "model.safetensors"))
    assert a.keys() == b.keys() and all(b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- SGLang's replies, as the wheel gives them


def test_the_first_serve_to_train_switch_takes_sglangs_null_replies(tmp_path, fake_sglang):
    """release/resume_memory_occupation return nothing, which FastAPI sends as ``200 null``."""
    engine = make_engine(tmp_path)
    engine.start()
    try:
        engine.resume(weights(0))
        engine.drain(0.1)
        engine.release()  # pause, flush, release: the reply is `null`
        engine.resume(weights(1))  # resume weights (`null`), load, resume the rest (`null`)
        assert engine.weight_version == 1 and fake_sglang()["released"] == []
    finally:
        engine.stop()


def test_updates_name_their_load_format_for_a_dummy_started_server(tmp_path, fake_sglang):
    """Started with --load-format dummy, SGLang loads an update in the server's format unless the
    request names one, and the dummy loader cannot update: "Failed to get model loader"."""
    from tests.support import sglang_contract

    engine = make_engine(tmp_path)
    engine.start()
    try:
        assert "dummy" in fake_sglang()["argv"]
        engine.resume(weights(0))
        body = fake_sglang()["calls"][-1][1]
        assert body["load_format"] == "safetensors" and body["load_format"] in sglang_contract.load_formats()
        assert fake_sglang()["loaded"][-1]["load_format"] == "safetensors"
    finally:
        engine.stop()


def late_call(engine: SGLangEngine) -> threading.Thread:
    """A call that reaches the server after the drain and before the pause."""
    t = threading.Thread(target=lambda: generate(engine.url, 2000), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while engine.num_running() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    return t


def test_release_waits_until_flush_cache_says_the_scheduler_is_idle(tmp_path, fake_sglang):
    """A call that arrives after the drain is aborted by the pause but stays in the scheduler a
    while; SGLang refuses the release until then, so the engine retries /flush_cache until 200."""
    engine = make_engine(tmp_path)
    engine.start()
    try:
        engine.resume(weights(0))
        assert engine.drain(0.1) == 0
        t = late_call(engine)
        engine.release()
        t.join(10)
        names = [c[0] for c in fake_sglang()["calls"]]
        flushes = names[names.index("pause_generation") + 1 : names.index("release_memory_occupation")]
        assert len(flushes) >= 2 and set(flushes) == {"flush_cache"}  # refused at least once, then idle
        engine.resume(weights(1))
        assert engine.weight_version == 1
    finally:
        engine.stop()


def test_flush_cache_gives_up_after_its_deadline(tmp_path, fake_sglang, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_ABORT_LINGER_S", "30")  # the aborted call never leaves in time
    engine = make_engine(tmp_path, flush_cache_timeout_s=0.5)
    engine.start()
    try:
        engine.resume(weights(0))
        late_call(engine)
        t0 = time.monotonic()
        with pytest.raises(SGLangError, match=r"/flush_cache: .*not idle after 0.5s"):
            engine.release()
        assert time.monotonic() - t0 < 10
        assert "release_memory_occupation" not in [c[0] for c in fake_sglang()["calls"]]
    finally:
        engine.stop()


def test_an_empty_or_null_reply_is_success_only_where_sglang_sends_one(tmp_path, fake_sglang):
    engine = make_engine(tmp_path)
    engine.start()
    try:
        assert engine.servers[0].post("/release_memory_occupation", {}, want_json=False) == {}
        assert engine.servers[0].post("/resume_memory_occupation", {}, want_json=False) == {}
        assert engine.servers[0].post("/abort_request", {"abort_all": True}, want_json=False) == {}  # empty 200
        with pytest.raises(SGLangError, match="/abort_request: want a JSON object, got empty reply"):
            engine.servers[0].post("/abort_request", {"abort_all": True})
        with pytest.raises(SGLangError, match="/resume_memory_occupation: want a JSON object, got null"):
            engine.servers[0].post("/resume_memory_occupation", {})
    finally:
        engine.stop()


# ---------------------------------------------------------------- the contract, from the sglang wheel


def test_every_body_the_engine_sends_is_one_sglang_accepts(tmp_path, fake_sglang):
    """Route by route, each request body in a whole lifecycle (start, load, update, drain with an
    abort, switch to train and back) converts strictly into the type SGLang's own route declares
    (sglang/srt/entrypoints/http_server.py -> sglang/srt/managers/io_struct.py)."""
    from tests.support import sglang_contract

    sglang_contract.wheel_root()
    engine = make_engine(tmp_path)
    engine.start()
    try:
        engine.resume(weights(0))
        engine.update_weights(weights(1))
        late_call(engine)
        assert engine.drain(0.05) == 1
        late_call(engine)
        engine.release()
        engine.resume(weights(2))
    finally:
        engine.stop()
    calls = fake_sglang()["calls"]
    assert {c[0] for c in calls} == {"update_weights_from_disk", "abort_request", "pause_generation", "flush_cache",
                                     "release_memory_occupation", "resume_memory_occupation", "continue_generation"}
    for name, body in calls:
        route = "/" + name
        if name == "flush_cache":  # no body; only the query parameters the route declares
            assert set(body["query"]) <= sglang_contract.route_query_params(route)
            continue
        sglang_contract.check_body(route, body)
        if name == "abort_request":
            sglang_contract.check_api_type("AbortRequest", body)


def test_the_stand_in_answers_in_sglangs_types(tmp_path, fake_sglang):
    from tests.support import sglang_contract

    sglang_contract.wheel_root()
    engine = make_engine(tmp_path)
    engine.start()

    def ask(path: str, body: dict | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(engine.url + path, method="GET" if body is None else "POST",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    try:
        engine.resume(weights(0))
        reply = generate(engine.url, 3)
        sglang_contract.check_api_type("GenerateResponse", reply)
        _, info = ask("/model_info")
        sglang_contract.check_api_type("GetModelInfoResponse", json.loads(info))
        assert json.loads(info)["load_format"] == "dummy"

        update_fields = {f.name for f in msgspec_fields(sglang_contract.io_struct("UpdateWeightFromDiskReqOutput"))}
        status, raw = ask("/update_weights_from_disk", {"model_path": engine._weights_path})  # the server's format
        assert status == 400 and json.loads(raw)["message"].startswith("Failed to get model loader")
        assert set(json.loads(raw)) <= update_fields
        status, raw = ask("/update_weights_from_disk", {"model_path": engine._weights_path,
                                                         "load_format": "safetensors", "weight_version": "9"})
        assert status == 200 and json.loads(raw)["success"] is True and set(json.loads(raw)) <= update_fields

        for path in ("/pause_generation", "/continue_generation"):
            status, raw = ask(path, {})
            assert status == 200 and json.loads(raw) == {"message": json.loads(raw)["message"], "status": "ok"}
        assert ask("/flush_cache")[0] == 200 and ask("/flush_cache", {})[0] == 200
        assert ask("/release_memory_occupation", {}) == (200, b"null")
        assert ask("/resume_memory_occupation", {}) == (200, b"null")
    finally:
        engine.stop()


def msgspec_fields(struct: type) -> tuple:
    import msgspec

    return msgspec.structs.fields(struct)
