"""The embedded serving engine: the subset of SGLang's native HTTP API that Gyre's proxy uses.

Runs inside the cellrunner process: an aiohttp server on its own thread and event loop, and the
generation thread of `engine_batch.BatchLoop` (continuous batching over a torch Qwen3 model).
The proxy talks to it exactly as to `sglang.launch_server --skip-tokenizer-init`, so a cluster
swaps in real SGLang with `engine=sglang`. Lifecycle (start / resume / update_weights / drain /
release / stop) is driven by the cellrunner, never by HTTP, except the SGLang-compatible
`/update_weights_from_disk`.

A prefix cache (`engine_batch.PrefixCache`) keeps the KV of finished requests: a prompt that
starts with cached tokens (a session's earlier call, a harness's fixed system prompt) prefills
only the rest, and `meta_info.cached_tokens` says how many were reused, as in SGLang. It is
emptied whenever the weights change and on drain and release.

Not implemented: text prompts (token ids only), streaming, batch input, stop strings, penalties.
The only stop condition besides length is `stop_token_ids`; the model has no built-in EOS.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import uuid
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy
from aiohttp import web

from cellrunner import engine_batch
from cellrunner.config import ModelConfig
from cellrunner.engine_batch import BatchLoop, GenRequest
from cellrunner.model import FlatWeights, build_model, load_flat, max_positions, num_elements
from base import engine_key
from base.wire import TensorSpec

logger = logging.getLogger(__name__)

SAFETENSORS_FILE = "model.safetensors"
MAX_BODY_BYTES = 256 * 1024 * 1024  # long agent prompts are ~1M ids of JSON
# Drained requests must all answer before release; abort lands within one decode iteration.
ABORT_SETTLE_S = 60.0

# Our sampling fields and their SGLang defaults.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": engine_batch.TOP_K_ALL,
    "stop_token_ids": None,
    "ignore_eos": False,  # as in SGLang, True also ignores stop_token_ids
}
# SGLang fields that only shape text output, which a token-in/token-out engine has none of.
TEXT_ONLY_FIELDS = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"})
# SGLang fields this engine does not implement: accepted only at their no-op values.
NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "stop": (None, "", []), "stop_regex": (None, "", []), "min_p": (0, 0.0), "min_new_tokens": (0,), "n": (1,),
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,),
    "logit_bias": (None, {}), "custom_params": (None,), "sampling_seed": (None,), "stream_interval": (None,),
}


class BadRequest(ValueError):
    """A /generate body that SGLang would refuse with 400."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(sp: dict[str, Any], name: str, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = sp[name]
    if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
        raise BadRequest(f"sampling_params.{name}: want a number, got {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise BadRequest(f"sampling_params.{name}: want {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _token_ids(v: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise BadRequest(f"{name}: want a list of token ids")
    bad = next((t for t in v if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"{name}: token id {bad} outside [0, {vocab_size})")
    return v


def _sampling_params(raw: Any, vocab_size: int) -> dict[str, Any]:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params: want an object")
    for key, value in raw.items():
        if key in NOOP_VALUES and not any(value == ok and type(value) is type(ok) for ok in NOOP_VALUES[key]):
            raise BadRequest(f"sampling_params.{key}: not supported by the embedded engine")
        if key not in SAMPLING_DEFAULTS and key not in TEXT_ONLY_FIELDS and key not in NOOP_VALUES:
            raise BadRequest(f"unknown field `{key}`")
    sp = {**SAMPLING_DEFAULTS, **{k: v for k, v in raw.items() if k in SAMPLING_DEFAULTS}}
    if not _is_int(sp["max_new_tokens"]) or sp["max_new_tokens"] < 0:
        raise BadRequest(f"sampling_params.max_new_tokens: want an int >= 0, got {sp['max_new_tokens']!r}")
    if not _is_int(sp["top_k"]) or not (sp["top_k"] == engine_batch.TOP_K_ALL or sp["top_k"] >= 1):
        raise BadRequest(f"sampling_params.top_k: want -1 (all) or an int >= 1, got {sp['top_k']!r}")
    if not isinstance(sp["ignore_eos"], bool):
        raise BadRequest(f"sampling_params.ignore_eos: want a bool, got {sp['ignore_eos']!r}")
    stop = None if sp["ignore_eos"] else sp["stop_token_ids"]
    return {
        "max_new_tokens": sp["max_new_tokens"],
        "temperature": _number(sp, "temperature", 0.0, math.inf),
        "top_p": _number(sp, "top_p", 0.0, 1.0, lo_open=True),
        "top_k": sp["top_k"],
        "stop_token_ids": frozenset(_token_ids(stop, "sampling_params.stop_token_ids", vocab_size) if stop else ()),
    }


def parse_generate(body: Any, *, vocab_size: int, max_positions: int) -> dict[str, Any]:
    """Check a /generate body; return GenRequest's fields (without `on_done`) or raise BadRequest.

    Unknown top-level keys are ignored and unknown sampling fields refused, as SGLang does.
    """
    if not isinstance(body, dict):
        raise BadRequest("body: want a JSON object")
    if body.get("stream"):
        raise BadRequest("stream: not supported by the embedded engine")
    if "input_ids" not in body:
        raise BadRequest("input_ids: required (this engine takes token ids, not text)")
    input_ids = _token_ids(body["input_ids"], "input_ids", vocab_size)
    if not input_ids:
        raise BadRequest("input_ids: empty prompt")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest("rid: want a string")
    return_logprob = body.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise BadRequest("return_logprob: want a bool")
    sp = _sampling_params(body.get("sampling_params"), vocab_size)
    if len(input_ids) + sp["max_new_tokens"] > max_positions:
        raise BadRequest(
            f"input_ids: {len(input_ids)} prompt tokens + max_new_tokens {sp['max_new_tokens']} "
            f"exceed the context length {max_positions}"
        )
    return {"rid": rid or uuid.uuid4().hex, "input_ids": input_ids, "return_logprob": return_logprob, **sp}


def save_safetensors(weights: FlatWeights, directory: str) -> str:
    """Write `weights` as `<directory>/model.safetensors`, one tensor per parameter; return the path."""
    os.makedirs(directory, exist_ok=True)
    tensors = {}
    for spec in weights.specs:
        n = int(np.prod(spec.shape, dtype=np.int64))
        tensors[spec.name] = weights.data[spec.offset : spec.offset + n].reshape(spec.shape)
    path = os.path.join(directory, SAFETENSORS_FILE)
    safetensors.numpy.save_file(tensors, path)
    return path


def load_safetensors(directory: str, *, specs: tuple[TensorSpec, ...], version: int) -> FlatWeights:
    """Read `<directory>/model.safetensors` into the layout `specs`; names and shapes must match."""
    tensors = safetensors.numpy.load_file(os.path.join(directory, SAFETENSORS_FILE))
    names = {s.name for s in specs}
    if set(tensors) != names:
        missing, extra = sorted(names - set(tensors)), sorted(set(tensors) - names)
        raise ValueError(f"{SAFETENSORS_FILE}: missing {missing[:5]}, unexpected {extra[:5]}")
    data = np.empty(num_elements(specs), dtype=np.float32)
    for spec in specs:
        t = tensors[spec.name]
        if list(t.shape) != list(spec.shape):
            raise ValueError(f"{SAFETENSORS_FILE}: {spec.name} has shape {list(t.shape)}, want {spec.shape}")
        data[spec.offset : spec.offset + t.size] = t.reshape(-1)
    return FlatWeights(version, specs, data)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


class EmbeddedEngine:
    """One cell's serving engine. Thread-safe; the lifecycle methods block until done.

    States: started (HTTP up, no model, 503) -> resume() -> serving -> drain() -> draining
    (503 for new calls) -> release() -> started again. update_weights() works while serving or
    draining. A request's `weight_version` is the version that produced its first output token;
    `meta_info.weight_versions` gives every version it saw when a swap landed mid-request.
    """

    def __init__(
        self,
        *,
        model_cfg: ModelConfig,
        vocab_size: int,
        host: str,
        port: int,
        cell_id: int,
        max_running: int,
        seed: int,
        prefix_cache_bytes: int = 0,
        prefix_cache_min_tokens: int = 1,
        api_key: str = "",
        share_prefill: bool = True,
        kv_tier: Any = None,
    ) -> None:
        """`prefix_cache_bytes` 0: no prefix cache (EmbeddedEngineConfig has the fields' meaning).
        `share_prefill`, `kv_tier`: as `engine_batch.BatchLoop`'s.
        `api_key`: every route but /health wants `Authorization: Bearer <api_key>` ("" = open),
        as SGLang's --api-key (base.engine_key)."""
        if max_running < 1:
            raise ValueError(f"max_running: want >= 1, got {max_running}")
        self._model_cfg = model_cfg
        self._max_positions = max_positions(model_cfg)
        self._vocab_size = vocab_size
        self._host, self._port = host, port
        self._cell_id = cell_id
        self._api_key = api_key
        self._batch_loop = BatchLoop(
            max_running=max_running, seed=seed, name=f"engine-gen-{cell_id}",
            prefix_cache_bytes=prefix_cache_bytes, prefix_cache_min_tokens=prefix_cache_min_tokens,
            share_prefill=share_prefill, kv_tier=kv_tier,
        )
        self._lifecycle = threading.Lock()  # one of resume/update/drain/release/stop at a time
        self._specs: tuple[TensorSpec, ...] | None = None  # manifest of the loaded weights, to read disk files
        self._aio: asyncio.AbstractEventLoop | None = None
        self._http_thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    @property
    def weight_version(self) -> int | None:
        return self._batch_loop.version

    def num_running(self) -> int:
        return self._batch_loop.num_active()

    def num_output_tokens(self) -> int:
        return self._batch_loop.num_output_tokens()

    def num_prefill_tokens(self) -> int:
        """Prompt tokens prefilled so far; the prefix cache's hits are not counted."""
        return self._batch_loop.num_prefill_tokens()

    def prefix_cache_usage(self) -> tuple[int, int]:
        """(entries, bytes) held by the prefix cache."""
        return self._batch_loop.prefix_cache_usage()

    def num_tier_tokens(self) -> int:
        """Prompt tokens whose KV came from the run's shared KV tier."""
        return self._batch_loop.num_tier_tokens()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._aio = asyncio.new_event_loop()
        self._http_thread = threading.Thread(
            target=self._aio.run_forever, name=f"engine-http-{self._cell_id}", daemon=True
        )
        self._http_thread.start()
        port = asyncio.run_coroutine_threadsafe(self._serve(), self._aio).result(timeout=30)
        self.url = f"http://{self._host}:{port}"
        self._batch_loop.start()
        logger.info("engine cell=%s listening on %s (no model yet)", self._cell_id, self.url)

    def resume(self, weights: FlatWeights) -> None:
        with self._lifecycle:
            if self.weight_version is not None:
                raise RuntimeError("resume: a model is already loaded; use update_weights, or release first")
            model = build_model(self._model_cfg, self._vocab_size)
            load_flat(model, weights)
            model.eval()
            self._batch_loop.install(model, weights.version)
            self._specs = weights.specs
            self._batch_loop.set_accepting(True)
        logger.info("engine cell=%s serving weight_version=%s", self._cell_id, weights.version)

    def update_weights(self, weights: FlatWeights) -> None:
        """Swap weights between two decode iterations; in-flight requests continue on the new ones."""
        with self._lifecycle:
            self._batch_loop.load_weights(lambda model: _load(model, weights))
            self._specs = weights.specs
        logger.info("engine cell=%s weight_version=%s", self._cell_id, weights.version)

    def drain(self, timeout_s: float) -> int:
        """Refuse new calls, let in-flight ones finish for up to `timeout_s`, abort the rest
        (they answer 200 with their partial output); return how many were aborted."""
        with self._lifecycle:
            self._batch_loop.set_accepting(False)
            aborted_before = self._batch_loop.num_aborted
            if not self._batch_loop.wait_idle(timeout_s):
                self._batch_loop.abort(message=f"cell {self._cell_id} drained")
                if not self._batch_loop.wait_idle(ABORT_SETTLE_S):
                    logger.warning(
                        "engine cell=%s: %s requests still open after abort", self._cell_id, self.num_running()
                    )
            num_aborted = self._batch_loop.num_aborted - aborted_before
            # Its sessions' next calls go to other cells: they read this KV from the shared tier
            # instead of computing it again (the aborted calls' prompts and output are in it too).
            spilled = self._batch_loop.spill_to_tier()
            if spilled:
                logger.info("engine cell=%s wrote %s KV pages to the shared tier", self._cell_id, spilled)
            # A drained cell goes on to train: whatever it serves next runs on other weights.
            self._batch_loop.clear_prefix_cache()
        logger.info("engine cell=%s drained, %s aborted", self._cell_id, num_aborted)
        return num_aborted

    def release(self) -> None:
        """Drop the model and KV cache; anything still running is aborted first."""
        if self.num_running():
            self.drain(0.0)
        with self._lifecycle:
            self._batch_loop.set_accepting(False)
            # Parameters and KV tensors are freed by reference counting as the batch loop drops
            # them (no cycles hold them); a full gc.collect() here cost ~0.9 s of every switch.
            self._batch_loop.release()
        logger.info("engine cell=%s released", self._cell_id)

    def stop(self) -> None:
        with self._lifecycle:
            self._batch_loop.stop()
            if self._aio is not None and self._runner is not None:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._aio).result(timeout=30)
            if self._aio is not None:
                self._aio.call_soon_threadsafe(self._aio.stop)
                self._http_thread.join()
                self._aio.close()
                self._aio = None
        logger.info("engine cell=%s stopped", self._cell_id)

    # ------------------------------------------------------------ HTTP

    async def _serve(self) -> int:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._check_key])
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_post("/abort_request", self._abort_request)
        app.router.add_post("/update_weights_from_disk", self._update_weights_from_disk)
        # handler_cancellation: a caller that hangs up gets its request aborted, freeing its KV rows.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        return self._runner.addresses[0][1]

    @web.middleware
    async def _check_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Before the body is read: a caller without the run's key gets SGLang's own 401."""
        if not engine_key.allowed(self._api_key, request.path, request.headers.get("Authorization")):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _generate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body: not valid JSON")
        try:
            fields = parse_generate(
                body, vocab_size=self._vocab_size, max_positions=self._max_positions
            )
        except BadRequest as e:
            return _error(400, str(e))
        aio = asyncio.get_running_loop()
        done: asyncio.Future = aio.create_future()

        def on_done(status: int, reply: dict[str, Any]) -> None:  # called on the generation thread
            aio.call_soon_threadsafe(_settle, done, (status, reply))

        req = GenRequest(**fields, on_done=on_done)
        if not self._batch_loop.submit(req):
            return _error(503, f"cell {self._cell_id} is not serving", "service_unavailable")
        try:
            status, reply = await done
        except asyncio.CancelledError:
            self._batch_loop.abort(message="client disconnected", req=req)
            raise
        return web.json_response(reply, status=status)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self._batch_loop.accepting() else 503)

    async def _model_info(self, request: web.Request) -> web.Response:
        version = self.weight_version
        return web.json_response({
            "model_path": f"embedded:{self._model_cfg.name}",
            "served_model_name": self._model_cfg.name,
            "tokenizer_path": None,
            "weight_version": None if version is None else str(version),
            "is_generation": True,
        })

    async def _abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body: not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "body: want a JSON object")
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            return _error(400, "rid: want a string; abort_all: want a bool")
        if abort_all:
            self._batch_loop.abort(message="aborted by abort_request")
        elif rid:
            self._batch_loop.abort(message="aborted by abort_request", rid=rid)
        return web.Response(status=200)

    async def _update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            path, version = body["model_path"], body.get("weight_version")
            if not isinstance(path, str) or not (version is None or isinstance(version, str)):
                raise TypeError("model_path: want a string; weight_version: want a string")
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"success": False, "message": f"bad request: {e}"}, status=400)
        try:
            # Reading the file and waiting for the swap must not block this event loop.
            await asyncio.get_running_loop().run_in_executor(None, self._load_from_disk, path, version)
        except (OSError, ValueError, RuntimeError, safetensors.SafetensorError) as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response({"success": True, "message": f"loaded {path}", "num_paused_requests": 0})

    def _load_from_disk(self, path: str, version_str: str | None) -> None:
        specs, current = self._specs, self.weight_version
        if specs is None or current is None:
            raise RuntimeError("no model loaded")
        version = current if version_str is None else _parse_version(version_str)
        self.update_weights(load_safetensors(path, specs=specs, version=version))


def _parse_version(s: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise ValueError(f"weight_version: want an integer string, got {s!r}") from None


def _load(model: Any, weights: FlatWeights) -> int:
    load_flat(model, weights)
    return weights.version


def _settle(future: asyncio.Future, result: Any) -> None:
    if not future.done():  # the handler may have been cancelled meanwhile
        future.set_result(result)
