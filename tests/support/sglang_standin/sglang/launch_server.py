"""TEST DOUBLE of ``python -m sglang.launch_server`` (the admin endpoints Gyre uses). Not SGLang.

Started by the real ``SGLangEngine`` with this folder first on PYTHONPATH. Each behaviour copies
the sglang 0.5.23 wheel's and names the file it mirrors; ``tests/support/sglang_contract.py``
checks what it answers against SGLang's own types. Test controls live under ``/fake/``.
"""
import argparse, asyncio, json, os, subprocess, sys, time
from aiohttp import web
from safetensors import safe_open

ap = argparse.ArgumentParser()
for flag in ("--model-path", "--host", "--dtype", "--load-format", "--dist-init-addr", "--served-model-name",
             "--hicache-write-policy", "--hicache-mem-layout", "--hicache-io-backend", "--hicache-storage-backend",
             "--hicache-storage-prefetch-policy", "--hicache-storage-backend-extra-config"):
    ap.add_argument(flag, required=flag in ("--model-path", "--host"))
for flag in ("--port", "--tp-size", "--dp-size", "--ep-size", "--max-running-requests", "--random-seed",
             "--context-length", "--nnodes", "--node-rank", "--base-gpu-id", "--page-size", "--hicache-size"):
    ap.add_argument(flag, type=int)
ap.add_argument("--mem-fraction-static", type=float)
ap.add_argument("--hicache-ratio", type=float)
ap.add_argument("--api-key")
ap.add_argument("--admin-api-key")
for flag in ("--skip-tokenizer-init", "--enable-memory-saver", "--enable-metrics", "--skip-server-warmup",
             "--disable-cuda-graph", "--enable-hierarchical-cache"):
    ap.add_argument(flag, action="store_true")
args = ap.parse_args()  # an unknown flag exits 2, as SGLang's argparse does
LOAD_FORMAT = args.load_format or "auto"  # sglang/srt/server_args.py: load_format defaults to "auto"
# One record a server: "{port}" in the path names this one's (a cell may start several).
RECORD = os.environ["FAKE_SGLANG_RECORD"].replace("{port}", str(args.port))
ABORT_LINGER_S = float(os.environ.get("FAKE_SGLANG_ABORT_LINGER_S", "0.3"))
"""How long an aborted request stays in the scheduler: an abort is applied at its next step
(sglang/srt/managers/scheduler.py), so the scheduler is not idle at once."""
if os.environ.get("FAKE_SGLANG_FAIL"):
    print("fake sglang: refusing to start (FAKE_SGLANG_FAIL)", flush=True)
    sys.exit(3)
# A forked "scheduler", as SGLang has: stop() must end it with the server.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
state = {"version": "default", "released": set(), "paused": False, "running": {}, "waiting": {}, "aborted": 0,
         "calls": [], "loaded": [], "argv": sys.argv[1:], "child_pid": child.pid, "started": time.time(),
         "mode": "ok", "generated": [], "pid": os.getpid(),
         # the L3 store: its tag, and every tag a load ran under (None: detached)
         "l3_tag": (json.loads(args.hicache_storage_backend_extra_config or "{}").get("extra_backend_tag")
                    if args.hicache_storage_backend else None),
         "tags_at_load": [], "mooncake_local_hostname": os.environ.get("MOONCAKE_LOCAL_HOSTNAME")}
slots = asyncio.Semaphore(args.max_running_requests or 1)  # beyond it, requests wait in the queue


def save():
    with open(RECORD + ".tmp", "w") as f:
        json.dump({k: (sorted(v) if isinstance(v, set) else v) for k, v in state.items()
                   if k not in ("running", "waiting")}, f)
    os.replace(RECORD + ".tmp", RECORD)


def call(name, body=None):
    state["calls"].append([name, body])
    save()


def idle():
    # sglang/srt/managers/scheduler.py (is_fully_idle): nothing running and nothing waiting
    return not state["running"] and not state["waiting"]


def error_response(message, status=400):
    # sglang/srt/entrypoints/http_server.py (_create_error_response)
    return web.json_response({"error": {"message": message}}, status=status)


async def health(request):
    if time.time() - state["started"] < 0.5 or "weights" in state["released"]:
        return web.Response(status=503)  # starting, or no weights to run the probe with
    return web.Response(status=200)


async def metrics(request):
    # sglang/srt/metrics/collector.py: gauges per TP rank, the aborted counter
    lines = ["# HELP sglang:num_running_reqs The number of running requests.",
             "# TYPE sglang:num_running_reqs gauge"]
    for tp in (0, 1):  # every TP rank exports its scheduler's gauge
        lines.append(f'sglang:num_running_reqs{{model_name="m",tp_rank="{tp}"}} {float(len(state["running"]))}')
    lines.append(f'sglang:num_queue_reqs{{model_name="m",tp_rank="0"}} {float(len(state["waiting"]))}')
    lines.append(f'sglang:num_aborted_requests_total{{model_name="m"}} {float(state["aborted"])}')
    return web.Response(text="\n".join(lines) + "\n")


async def model_info(request):
    # sglang/srt/entrypoints/http_server.py (model_info): its keys, and the load format in effect
    return web.json_response({
        "model_path": args.model_path, "served_model_name": args.model_path, "tokenizer_path": args.model_path,
        "is_generation": True, "preferred_sampling_params": None, "weight_version": state["version"],
        "load_format": LOAD_FORMAT, "reasoning_parser": None, "tool_call_parser": None})


async def generate(request):
    body = await request.json()
    # sglang/srt/managers/tokenizer_manager.py: while paused, new requests wait in the tokenizer
    while state["paused"]:
        await asyncio.sleep(0.01)
    rid = body.get("rid") or str(time.time())
    state["generated"].append(rid)  # test record: which server took which call
    save()
    n = body.get("sampling_params", {}).get("max_new_tokens", 8)
    fut = asyncio.get_running_loop().create_future()
    state["waiting"][rid] = fut
    async with slots:
        state["waiting"].pop(rid, None)
        state["running"][rid] = fut
        out, reason = [], {"type": "length", "length": n}
        for i in range(n):
            if fut.done():
                reason = {"type": "abort", "message": "aborted"}
                await asyncio.sleep(ABORT_LINGER_S)
                break
            out.append(7)
            await asyncio.sleep(0.01)
        state["running"].pop(rid, None)
    # sglang/api/v1/api_types.py (GenerateResponse, GenerateMetaInfo)
    return web.json_response({"text": "", "output_ids": out, "meta_info": {
        "id": rid, "finish_reason": reason, "weight_version": state["version"], "prompt_tokens": 3,
        "output_token_logprobs": [[-1.0, t, None] for t in out], "completion_tokens": len(out)}})


def abort_all():
    for fut in [*state["running"].values(), *state["waiting"].values()]:
        if not fut.done():
            fut.set_result(None)
            state["aborted"] += 1


async def abort_request(request):
    body = await request.json()
    call("abort_request", body)
    if body.get("abort_all"):
        abort_all()
    return web.Response(status=200)  # sglang/srt/entrypoints/http_server.py: empty 200


async def pause(request):
    body = await request.json()
    call("pause_generation", body)
    if body.get("mode", "abort") == "abort":
        abort_all()
    state["paused"] = True
    # sglang/srt/entrypoints/http_server.py (pause_generation)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def cont(request):
    call("continue_generation", await request.json())
    state["paused"] = False
    # sglang/srt/entrypoints/http_server.py (continue_generation)
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def flush_cache(request):
    # sglang/srt/entrypoints/http_server.py (flush_cache, GET or POST): plain text, 400 unless the
    # scheduler is idle (sglang/srt/managers/scheduler.py flush_cache)
    call("flush_cache", {"method": request.method, "query": dict(request.query)})
    if not idle():
        return web.Response(text="Flush cache failed.\n", status=400)
    return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
                             "or waiting requests, the operation will not be performed.)\n", status=200)


async def release(request):
    body = await request.json()
    call("release_memory_occupation", body)
    await asyncio.sleep(0.05)
    # sglang/srt/managers/scheduler_components/weight_updater.py (release_memory_occupation) asserts
    # an idle scheduler; the route turns the error into http_server.py's _create_error_response
    if not idle():
        return error_response("release_memory_occupation should be called only when server is idle.")
    state["released"] |= set(body.get("tags") or ["weights", "kv_cache", "cuda_graph"])
    save()
    # sglang/srt/entrypoints/http_server.py (release_memory_occupation) returns nothing: FastAPI
    # answers 200 with the JSON body `null`
    return web.json_response(None)


async def resume(request):
    body = await request.json()
    call("resume_memory_occupation", body)
    state["released"] -= set(body.get("tags") or ["weights", "kv_cache", "cuda_graph"])
    save()
    # sglang/srt/entrypoints/http_server.py (resume_memory_occupation): 200 `null`, as release
    return web.json_response(None)


def update_reply(success, message, status):
    # sglang/srt/entrypoints/http_server.py (update_weights_from_disk): 200 or 400, same keys
    return web.json_response({"success": success, "message": message, "num_paused_requests": 0}, status=status)


async def update_from_disk(request):
    body = await request.json()
    call("update_weights_from_disk", body)
    if state["mode"] == "not_json":
        return web.Response(text="<html>oops</html>", status=200)
    if "weights" in state["released"]:
        return update_reply(False, "weights are released", 400)
    # sglang/srt/managers/tokenizer_manager.py (update_weights_from_disk): no load_format means the
    # server's own; sglang/srt/model_executor/model_runner_components/weight_updater.py: only the
    # default loader can update, so a server started with --load-format dummy fails
    load_format = body.get("load_format") or LOAD_FORMAT
    if load_format not in ("auto", "safetensors"):
        return update_reply(False, f"Failed to get model loader: <{load_format} loader>.", 400)
    path = body["model_path"]
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
        t = f.get_tensor("model.embed_tokens.weight")
        loaded = {"names": names, "dtype": str(t.dtype), "embed_shape": list(t.shape),
                  "embed_sum": float(t.float().sum()), "architectures": config.get("architectures"),
                  "path": path, "version": body.get("weight_version"), "load_format": load_format}
    state["loaded"].append(loaded)
    state["tags_at_load"].append(state["l3_tag"])
    if body.get("weight_version") is not None:
        state["version"] = body["weight_version"]
    save()
    # sglang/srt/managers/scheduler_components/weight_updater.py (flush_cache_after_weight_update):
    # the weights are in, but a flush refused by a busy scheduler fails the call
    if body.get("flush_cache", True) and not idle():
        return update_reply(False, "Weights were updated, but the cache was not flushed because requests are "
                                   "still running or queued. Retract or finish them, then call /flush_cache.", 400)
    return update_reply(True, "Succeeded to update model weights.", 200)


def admin_key_missing():
    # sglang/srt/entrypoints/http_server.py (_admin_api_key_missing_response)
    return web.json_response({"error": "This endpoint requires admin API key, but this server was started "
                                       "without one (admin-api-key). Restart with --admin-api-key to enable."},
                             status=400)


async def attach_storage(request):
    # sglang/srt/entrypoints/http_server.py (attach_hicache_storage_backend): an admin key, then
    # sglang/srt/managers/scheduler.py (attach_hicache_storage_wrapped): HiCache on, an idle
    # scheduler, and the same backend only once (unified_cache/storage_attachment.py); plain text
    body = await request.json()
    call("attach_hicache_storage", body)
    if not args.admin_api_key:
        return admin_key_missing()
    failed = "Failed to attach HiCache storage backend.\n"
    if not args.enable_hierarchical_cache:
        return web.Response(text=failed + "Hierarchical cache is not enabled.\n", status=400)
    if not idle():
        return web.Response(text=failed + f"Reject attach: scheduler is not idle. #queue-req={len(state['waiting'])} "
                                          f"#running-req={len(state['running'])}\n", status=400)
    if state["l3_tag"] is not None:  # the tag stays that of the backend already attached
        return web.Response(text="HiCache storage backend attached.\nHiCache storage backend already enabled "
                                 "with same backend; policies updated.\n", status=200)
    state["l3_tag"] = json.loads(body.get("hicache_storage_backend_extra_config_json") or "{}").get("extra_backend_tag")
    save()
    return web.Response(text="HiCache storage backend attached.\nAttached HiCache storage backend successfully.\n")


async def detach_storage(request):
    # sglang/srt/entrypoints/http_server.py (detach_hicache_storage_backend), scheduler.py
    # (detach_hicache_storage_wrapped): idempotent, 200 also when nothing is attached
    call("detach_hicache_storage", None)
    if not args.admin_api_key:
        return admin_key_missing()
    if not idle():
        return web.Response(text="Failed to detach HiCache storage backend.\nReject detach: scheduler is not "
                                 "idle.\n", status=400)
    state["l3_tag"] = None
    save()
    return web.Response(text="HiCache storage backend detached.\nDetached HiCache storage backend successfully.\n")


async def fake_mode(request):  # test control: how update_weights_from_disk misbehaves
    state["mode"] = (await request.json())["mode"]
    return web.Response(status=200)


@web.middleware
async def api_key(request, handler):  # SGLang's own rule: /health and /metrics open, else Bearer <key>
    # sglang/srt/utils/auth.py: an admin route takes the admin key when there is one, else the API key
    key = args.admin_api_key if request.path.startswith("/hicache/") and args.admin_api_key else args.api_key
    if (key and not request.path.startswith(("/health", "/metrics"))
            and request.headers.get("Authorization") != "Bearer " + key):
        return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


if (args.node_rank or 0) >= 1:
    # sglang/srt/entrypoints/engine.py (_launch_subprocesses): a node other than the server's first
    # runs no tokenizer and no HTTP API, only sglang/srt/utils/common.py's
    # launch_dummy_health_check_server on its --port (/ping, /health, /health_generate; /metrics
    # with --enable-metrics), until node 0 stops its schedulers.
    async def ok(request):
        return web.Response(status=200)

    side = web.Application()
    for path in ("/ping", "/health", "/health_generate"):
        side.router.add_get(path, ok)
    save()
    web.run_app(side, host=args.host, port=args.port, print=None)
    sys.exit(0)

app = web.Application(middlewares=[api_key])
app.router.add_get("/health", health)
app.router.add_get("/metrics", metrics)
app.router.add_get("/model_info", model_info)
app.router.add_post("/generate", generate)
app.router.add_route("*", "/flush_cache", flush_cache)
app.router.add_put("/hicache/storage-backend", attach_storage)
app.router.add_delete("/hicache/storage-backend", detach_storage)
for path, fn in (("/abort_request", abort_request), ("/pause_generation", pause), ("/continue_generation", cont),
                 ("/release_memory_occupation", release), ("/resume_memory_occupation", resume),
                 ("/update_weights_from_disk", update_from_disk), ("/fake/mode", fake_mode)):
    app.router.add_post(path, fn)
save()
web.run_app(app, host=args.host, port=args.port, print=None)
