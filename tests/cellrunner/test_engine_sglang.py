"""engine=sglang on CPU: the launch command, and the whole lifecycle against a TEST DOUBLE.

SGLang cannot run on these CPUs (``shared/notes/cpu-stack.md`` §4), so the server here is a
fake: a small aiohttp program installed as a ``sglang`` package in a temporary folder and
started by the real ``SGLangEngine`` as ``python -m sglang.launch_server ...`` — a real process
in its own session, real HTTP. It implements only the admin endpoints the engine uses, with
SGLang's documented shapes (``shared/notes/gpu-stack-apis.md`` §1), refuses flags it does not
know, records every call, checks the safetensors it is pointed at, and fails like SGLang where
it matters (releasing a busy server; updating released weights). It proves the engine's side
of the protocol, not SGLang's; ``scripts/gpu_check.sh`` runs the real server on a GPU.
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
from controller.typed_config import ConfigError, build

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 300

FAKE_SGLANG = r'''
"""TEST DOUBLE of `python -m sglang.launch_server` (admin endpoints only). Not SGLang."""
import argparse, asyncio, json, os, subprocess, sys, time
from aiohttp import web
from safetensors import safe_open

ap = argparse.ArgumentParser()
for flag in ("--model-path", "--host", "--dtype", "--load-format", "--dist-init-addr"):
    ap.add_argument(flag, required=flag in ("--model-path", "--host"))
for flag in ("--port", "--tp-size", "--dp-size", "--ep-size", "--max-running-requests", "--random-seed",
             "--context-length", "--nnodes", "--node-rank"):
    ap.add_argument(flag, type=int)
ap.add_argument("--mem-fraction-static", type=float)
ap.add_argument("--api-key")
for flag in ("--skip-tokenizer-init", "--enable-memory-saver", "--enable-metrics", "--skip-server-warmup",
             "--disable-cuda-graph", "--enable-hierarchical-cache"):
    ap.add_argument(flag, action="store_true")
args = ap.parse_args()  # an unknown flag exits 2, as SGLang's argparse does
RECORD = os.environ["FAKE_SGLANG_RECORD"]
if os.environ.get("FAKE_SGLANG_FAIL"):
    print("fake sglang: refusing to start (FAKE_SGLANG_FAIL)", flush=True)
    sys.exit(3)
# A forked "scheduler", as SGLang has: stop() must end it with the server.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
state = {"version": "default", "released": set(), "paused": False, "running": {}, "aborted": 0,
         "calls": [], "loaded": [], "argv": sys.argv[1:], "child_pid": child.pid, "started": time.time(),
         "mode": "ok"}

def save():
    with open(RECORD + ".tmp", "w") as f:
        json.dump({k: (sorted(v) if isinstance(v, set) else v) for k, v in state.items() if k != "running"}, f)
    os.replace(RECORD + ".tmp", RECORD)

def call(name, body=None):
    state["calls"].append([name, body])
    save()

async def health(request):
    if time.time() - state["started"] < 0.5 or "weights" in state["released"]:
        return web.Response(status=503)  # starting, or no weights to run the probe with
    return web.Response(status=200)

async def metrics(request):
    n = len(state["running"])
    lines = ["# HELP sglang:num_running_reqs The number of running requests.",
             "# TYPE sglang:num_running_reqs gauge"]
    for tp in (0, 1):  # every TP rank exports its scheduler's gauge
        lines.append(f'sglang:num_running_reqs{{model_name="m",tp_rank="{tp}"}} {float(n)}')
    lines.append('sglang:num_queue_reqs{model_name="m",tp_rank="0"} 0.0')
    lines.append(f'sglang:num_aborted_requests_total{{model_name="m"}} {float(state["aborted"])}')
    return web.Response(text="\n".join(lines) + "\n")

async def model_info(request):
    return web.json_response({"model_path": args.model_path, "weight_version": state["version"]})

async def generate(request):
    body = await request.json()
    while state["paused"]:
        await asyncio.sleep(0.01)
    rid = body.get("rid") or str(time.time())
    n = body.get("sampling_params", {}).get("max_new_tokens", 8)
    fut = asyncio.get_running_loop().create_future()
    state["running"][rid] = fut
    out, reason = [], {"type": "length", "length": n}
    for i in range(n):
        if fut.done():
            reason = {"type": "abort", "message": "aborted"}
            break
        out.append(7)
        await asyncio.sleep(0.01)
    state["running"].pop(rid, None)
    return web.json_response({"output_ids": out, "meta_info": {
        "id": rid, "finish_reason": reason, "weight_version": state["version"],
        "output_token_logprobs": [[-1.0, t, None] for t in out], "completion_tokens": len(out)}})

def abort_all():
    for fut in state["running"].values():
        if not fut.done():
            fut.set_result(None)
            state["aborted"] += 1

async def abort_request(request):
    body = await request.json()
    call("abort_request", body)
    if body.get("abort_all"):
        abort_all()
    return web.Response(status=200)

async def pause(request):
    body = await request.json()
    call("pause_generation", body)
    if body.get("mode", "abort") == "abort":
        abort_all()
    state["paused"] = True
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

async def cont(request):
    call("continue_generation", await request.json())
    state["paused"] = False
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

async def release(request):
    body = await request.json()
    call("release_memory_occupation", body)
    await asyncio.sleep(0.05)
    if state["running"]:  # SGLang asserts an idle server here
        return web.json_response({"success": False, "message": "server is not idle"}, status=500)
    state["released"] |= set(body.get("tags") or ["weights", "kv_cache", "cuda_graph"])
    return web.Response(status=200)

async def resume(request):
    body = await request.json()
    call("resume_memory_occupation", body)
    state["released"] -= set(body.get("tags") or ["weights", "kv_cache", "cuda_graph"])
    return web.Response(status=200)

async def update_from_disk(request):
    body = await request.json()
    call("update_weights_from_disk", body)
    if state["mode"] == "not_json":
        return web.Response(text="<html>oops</html>", status=200)
    if "weights" in state["released"]:
        return web.json_response({"success": False, "message": "weights are released", "num_paused_requests": 0},
                                 status=400)
    path = body["model_path"]
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
        t = f.get_tensor("model.embed_tokens.weight")
        loaded = {"names": names, "dtype": str(t.dtype), "embed_shape": list(t.shape),
                  "embed_sum": float(t.float().sum()), "architectures": config.get("architectures"),
                  "path": path, "version": body.get("weight_version")}
    state["loaded"].append(loaded)
    if body.get("weight_version") is not None:
        state["version"] = body["weight_version"]
    save()
    return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

async def fake_mode(request):  # test control: how update_weights_from_disk misbehaves
    state["mode"] = (await request.json())["mode"]
    return web.Response(status=200)

@web.middleware
async def api_key(request, handler):  # SGLang's own rule: /health and /metrics open, else Bearer <key>
    if (args.api_key and not request.path.startswith(("/health", "/metrics"))
            and request.headers.get("Authorization") != "Bearer " + args.api_key):
        return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)

app = web.Application(middlewares=[api_key])
app.router.add_get("/health", health)
app.router.add_get("/metrics", metrics)
app.router.add_get("/model_info", model_info)
app.router.add_post("/generate", generate)
for path, fn in (("/abort_request", abort_request), ("/pause_generation", pause), ("/continue_generation", cont),
                 ("/release_memory_occupation", release), ("/resume_memory_occupation", resume),
                 ("/update_weights_from_disk", update_from_disk), ("/fake/mode", fake_mode)):
    app.router.add_post(path, fn)
save()
web.run_app(app, host=args.host, port=args.port, print=None)
'''


def sglang_cfg(tmp_path: Path, **over) -> SGLangConfig:
    base = dict(kind="sglang", python="", tp_size=1, dp_size=1, ep_size=1, nnodes=1, dist_init_port=0,
                mem_fraction_static=0.7, dtype="bfloat16", context_length=0, disable_cuda_graph=False,
                weight_update="disk", weight_dir=str(tmp_path / "weights"),
                startup_timeout_s=30.0, request_timeout_s=30.0, poll_interval_s=0.02, extra_args=[])
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
    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""TEST DOUBLE package standing in for sglang (not SGLang)."""\n')
    (pkg / "launch_server.py").write_text(FAKE_SGLANG)
    record = tmp_path / "record.json"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fake"), str(ROOT)]))
    monkeypatch.setenv("FAKE_SGLANG_RECORD", str(record))
    return lambda: json.loads(record.read_text())


KEY = "ab" * 32
"""The run's engine key (controller.engine_key) the engines here are started with."""


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
        server = psutil.Process(engine._proc.pid)
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
            "pause_generation", "release_memory_occupation", "resume_memory_occupation",
            "update_weights_from_disk", "resume_memory_occupation", "continue_generation",
        ]
        assert rec["calls"][calls_before][1] == {"mode": "abort"}
        assert rec["calls"][calls_before + 2][1] == {"tags": ["weights"]}
        assert rec["calls"][calls_before + 4][1] == {"tags": ["kv_cache", "cuda_graph"]}
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
        engine._released = False  # pretend we forgot: the server's 400 comes back as an SGLangError
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
