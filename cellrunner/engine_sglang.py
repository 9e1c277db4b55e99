"""The cellrunner's side of ``engine=sglang``: one SGLang server per cell, driven over HTTP.

Same lifecycle as ``cellrunner.engine.EmbeddedEngine`` (start / resume / update_weights / drain /
release / stop, ``url``, ``weight_version``, ``num_running``), so ``cellrunner.main`` swaps one for
the other; the proxy talks to the server's native API exactly as to the embedded engine (token
ids in, token ids and log-probs out: ``--skip-tokenizer-init``).

- Start: ``python -m sglang.launch_server`` with tp/dp/ep and, on several nodes, SGLang's own
  ``--nnodes/--node-rank/--dist-init-addr`` (each node's cellrunner starts its rank; only node 0
  serves HTTP). ``--enable-memory-saver`` so the cell can hand its GPU memory to the trainer;
  ``--load-format dummy`` unless an HF checkpoint is given, because the first ``resume`` loads
  the real weights anyway. Healthy = ``GET /health`` answers 200 (a one-token probe).
- Weights: ``POST /update_weights_from_disk`` from a tmpfs folder (``weight_dir``, /dev/shm),
  written as safetensors in the serving dtype. Chosen over the other endpoints because it needs
  no pickle (``/update_weights_from_tensor`` takes MultiprocessingSerializer payloads, which
  are pickles of CUDA-IPC handles), no second NCCL group in the cellrunner
  (``/update_weights_from_distributed``), and works for any TP/DP/EP layout of the server, which
  reshards on load. The cost is one host write + read of the weights per version (GPU.md).
  Every update names ``load_format``: without it SGLang uses the server's own, ``dummy`` for a
  server started without a checkpoint, whose loader cannot update ("Failed to get model loader").
- Role switch (slime's colocated order): serve -> train: drain, ``/pause_generation``
  (mode abort: nothing left running, new calls wait), ``/flush_cache`` until 200 (an aborted call
  leaves the scheduler at its next step; SGLang refuses the release until it is idle),
  ``/release_memory_occupation`` (all tags). Train -> serve: ``/resume_memory_occupation``
  weights, ``/flush_cache`` until 200, load the new version, resume kv_cache + cuda_graph,
  ``/continue_generation``. Release and resume answer ``200 null`` (the route returns nothing).
- Load: the server's Prometheus gauges (``--enable-metrics``): running + queued requests, and
  the aborted-requests counter for what a drain cut short.

Every reply is checked (status, JSON shape); a bad one raises ``SGLangError`` naming the
endpoint. Nothing here imports sglang: it runs in the server's own process.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from cellrunner.errors import BackendUnavailable
from cellrunner.config import ModelConfig, SGLangConfig
from cellrunner.model import FlatWeights, hf_config
from controller import engine_key

log = logging.getLogger(__name__)

ABORT_SETTLE_S = 60.0
"""After ``abort_all``, how long the server may take to answer every aborted request."""
STOP_GRACE_S = 30.0
RUNNING_GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs")
ABORTED_COUNTER = "sglang:num_aborted_requests_total"
WEIGHTS_LOAD_FORMAT = "safetensors"
"""What ``write_weights`` writes, as SGLang's ``LoadFormat`` names it (srt/configs/load_config.py)."""
FLUSH_BACKOFF_MAX_S = 2.0
"""The longest wait between two ``/flush_cache`` tries (it starts at ``poll_interval_s``, doubling)."""
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class SGLangError(BackendUnavailable):
    """The SGLang server failed to start, died, or answered an admin call badly."""




_LAUNCH_WITH_KEY = (
    "import os, runpy, sys; key = os.environ.pop('GYRE_ENGINE_API_KEY', ''); "
    "sys.argv += ['--api-key', key] if key else []; "
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)"
)
"""Runs ``sglang.launch_server`` with ``--api-key`` from the environment (``engine_key.ENV``) added
inside the process: ``/proc/<pid>/cmdline`` keeps the argv it was started with, which every local
user can read. Plain Python, so it needs nothing of Gyre in the SGLang environment."""


def launch_command(
    cfg: SGLangConfig, *, model_path: str, host: str, port: int, max_running: int, seed: int,
    dummy_weights: bool, node_rank: int = 0, dist_init_addr: str = "",
) -> list[str]:
    """The ``sglang.launch_server`` argv for one node of a cell's server (its API key, if any,
    comes from ``engine_key.ENV`` in the server's environment)."""
    if cfg.nnodes > 1 and not dist_init_addr:
        raise ValueError("nnodes > 1 needs dist_init_addr (node 0's host:port)")
    if not 0 <= node_rank < cfg.nnodes:
        raise ValueError(f"node_rank {node_rank}: want 0..{cfg.nnodes - 1}")
    cmd = [
        cfg.python or sys.executable, "-c", _LAUNCH_WITH_KEY,
        "--model-path", model_path, "--host", host, "--port", str(port),
        "--tp-size", str(cfg.tp_size), "--dp-size", str(cfg.dp_size),
        "--skip-tokenizer-init",  # token ids in and out, as the proxy speaks to the embedded engine
        "--enable-memory-saver",  # release/resume_memory_occupation on role switches
        "--enable-metrics",  # running/queued gauges for drains and heartbeats
        "--mem-fraction-static", repr(cfg.mem_fraction_static),
        "--dtype", cfg.dtype,
        "--max-running-requests", str(max_running),
        "--random-seed", str(seed),
        "--skip-server-warmup",
    ]
    if cfg.ep_size > 1:
        cmd += ["--ep-size", str(cfg.ep_size)]
    if cfg.context_length:
        cmd += ["--context-length", str(cfg.context_length)]
    if dummy_weights:
        cmd += ["--load-format", "dummy"]
    if cfg.disable_cuda_graph:
        cmd.append("--disable-cuda-graph")
    if cfg.nnodes > 1:
        cmd += ["--nnodes", str(cfg.nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]
    return cmd + list(cfg.extra_args)


def parse_metrics(text: str, names: Sequence[str]) -> float:
    """Sum Prometheus samples of ``names``. Every TP rank may export the same scheduler's value,
    so samples differing only in ``tp_rank`` count once (their max)."""
    groups: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, raw_labels = head.partition("{")
        if name not in names:
            continue
        labels = []
        for part in raw_labels.rstrip("}").split(","):
            k, _, v = part.partition("=")
            if k and k != "tp_rank":
                labels.append((k.strip(), v.strip().strip('"')))
        try:
            x = float(value)
        except ValueError:
            raise SGLangError(f"/metrics: {name}: not a number: {value!r}") from None
        if not math.isfinite(x):
            raise SGLangError(f"/metrics: {name}: not finite: {value!r}")
        key = (name, tuple(sorted(labels)))
        groups[key] = max(groups.get(key, x), x)
    return float(sum(groups.values()))


def write_weights(weights: FlatWeights, directory: str, *, dtype: torch.dtype, config_json: dict) -> str:
    """``weights`` as an HF folder (model.safetensors + config.json) in the serving dtype."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    src = weights.tensor()
    tensors = {}
    for spec in weights.specs:
        n = int(np.prod(spec.shape, dtype=np.int64))
        tensors[spec.name] = src[spec.offset : spec.offset + n].view(*spec.shape).to(dtype)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config_json, f)
    return directory


def model_config_json(model_cfg: ModelConfig, vocab_size: int, dtype: str) -> dict:
    """An HF config.json SGLang can build the model from (it picks the class by ``architectures``)."""
    cfg = hf_config(model_cfg, vocab_size)
    if not model_cfg.path:  # a checkpoint's config.json names its own (Qwen3MoeForCausalLM...)
        cfg.architectures = ["Qwen3ForCausalLM"]
    out = cfg.to_dict()
    out["torch_dtype"] = dtype
    return out


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SGLangEngine:
    """One cell's SGLang server (this node's rank of it). Lifecycle calls block until done."""

    def __init__(
        self, cfg: SGLangConfig, *, model_cfg: ModelConfig, vocab_size: int, host: str, port: int, cell_id: int,
        max_running: int, seed: int, log_dir: str, node_rank: int = 0, dist_init_addr: str = "",
        api_key: str = "",
    ) -> None:
        """``api_key``: SGLang's --api-key (given through its environment), sent on every call."""
        self.cfg = cfg
        self._model_cfg, self._vocab_size = model_cfg, vocab_size
        self._host, self._port = host, port
        self._cell_id, self._max_running, self._seed = cell_id, max_running, seed
        self._log_dir, self._node_rank, self._dist_init_addr = log_dir, node_rank, dist_init_addr
        self._proc: subprocess.Popen | None = None
        self._api_key = api_key
        self._log_file: Any = None
        self._lifecycle = threading.Lock()
        self._version: int | None = None
        self._released = False
        self._paused = False
        self._weights_path = ""
        self._cell_dir = os.path.join(cfg.weight_dir, f"cell{cell_id}")  # this engine's tmpfs files
        self._config_json = model_config_json(model_cfg, vocab_size, cfg.dtype)
        self.url = ""

    @property
    def weight_version(self) -> int | None:
        return self._version

    @property
    def serves_http(self) -> bool:
        return self._node_rank == 0

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        port = self._port or _free_port(self._host)
        model_path = self._model_cfg.path or self._write_model_dir()
        cmd = launch_command(
            self.cfg, model_path=model_path, host=self._host, port=port, max_running=self._max_running,
            seed=self._seed, dummy_weights=not self._model_cfg.path, node_rank=self._node_rank,
            dist_init_addr=self._dist_init_addr,
        )
        os.makedirs(self._log_dir, exist_ok=True)
        log_path = os.path.join(self._log_dir, f"sglang-cell{self._cell_id}-node{self._node_rank}.log")
        self._log_file = open(log_path, "ab")
        # Its own session, so stop() can end the server and every scheduler it forked together.
        env = {**os.environ, engine_key.ENV: self._api_key}
        self._proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                      env=env)
        self.url = f"http://{self._host}:{port}"
        log.info("sglang cell=%s node=%s: %s", self._cell_id, self._node_rank, " ".join(cmd))
        if self.serves_http:
            self._wait_healthy(log_path)

    def resume(self, weights: FlatWeights) -> None:
        if not self.serves_http:
            return  # node 0 drives the whole server
        with self._lifecycle:
            if self._version is not None and not self._released:
                raise RuntimeError("resume: a model is already loaded; use update_weights, or release first")
            if self._released:
                self._post("/resume_memory_occupation", {"tags": ["weights"]}, want_json=False)
            self._load(weights)
            if self._released:
                self._post("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}, want_json=False)
                self._released = False
            if self._paused:
                self._post("/continue_generation", {})
                self._paused = False
        log.info("sglang cell=%s serving weight_version=%s", self._cell_id, weights.version)

    def update_weights(self, weights: FlatWeights) -> None:
        if not self.serves_http:
            return
        with self._lifecycle:
            if self._released:
                raise RuntimeError("update_weights: the engine is released; resume it")
            self._load(weights)

    def drain(self, timeout_s: float) -> int:
        """Let running calls finish for up to ``timeout_s``, abort the rest (they answer 200 with
        their partial output); return how many were aborted."""
        if not self.serves_http or self._released:
            return 0
        with self._lifecycle:
            aborted_before = self._aborted_total()
            deadline = time.monotonic() + timeout_s
            while self._load_now() and time.monotonic() < deadline:
                time.sleep(self.cfg.poll_interval_s)
            if self._load_now():
                self._post("/abort_request", {"abort_all": True}, want_json=False)
                settle = time.monotonic() + ABORT_SETTLE_S
                while self._load_now() and time.monotonic() < settle:
                    time.sleep(self.cfg.poll_interval_s)
            return max(0, int(self._aborted_total() - aborted_before))

    def release(self) -> None:
        """Stop serving and free the GPU memory (weights, KV cache, CUDA graphs)."""
        if not self.serves_http or self._released:
            return
        with self._lifecycle:
            # Abort mode: nothing keeps running (release needs an idle server); new calls wait.
            self._post("/pause_generation", {"mode": "abort"})
            self._paused = True
            self._wait_idle()
            self._post("/release_memory_occupation", {}, want_json=False)
            self._released = True
            self._version = None

    def stop(self) -> None:
        with self._lifecycle:
            proc, self._proc = self._proc, None
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(STOP_GRACE_S)
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None
            shutil.rmtree(self._cell_dir, ignore_errors=True)
            self._weights_path = ""

    def num_running(self) -> int:
        """Running + queued requests on the server, for heartbeats: 0 when it is released, not
        node 0, or its metrics cannot be read (logged; a heartbeat must not kill the cell)."""
        if not self.serves_http or self._released or self._proc is None:
            return 0
        try:
            return self._load_now()
        except SGLangError as exc:
            log.warning("sglang cell=%s: load unknown: %s", self._cell_id, exc)
            return 0

    def _load_now(self) -> int:
        return int(parse_metrics(self._get_text("/metrics"), RUNNING_GAUGES))

    # ------------------------------------------------------------ internals

    def _write_model_dir(self) -> str:
        path = os.path.join(self._cell_dir, "init")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self._config_json, f)
        return path

    def _load(self, weights: FlatWeights) -> None:
        """Write the version to tmpfs, have the server load it, drop the previous version's files."""
        path = os.path.join(self._cell_dir, f"v{weights.version}")
        write_weights(weights, path, dtype=_DTYPES[self.cfg.dtype], config_json=self._config_json)
        if self._paused:
            # Switching back to serve: nothing may be left in the scheduler, or the update's own
            # flush fails it. While serving, the update waits for running calls (SGLang's
            # model-update lock) and flushes itself; live traffic would keep /flush_cache at 400.
            self._wait_idle()
        reply = self._post("/update_weights_from_disk", {
            "model_path": path, "load_format": WEIGHTS_LOAD_FORMAT, "weight_version": str(weights.version),
            "flush_cache": True, "abort_all_requests": False,
        })
        if reply.get("success") is not True:
            raise SGLangError(f"/update_weights_from_disk: {reply.get('message')!r}")
        if self._weights_path and self._weights_path != path:
            shutil.rmtree(self._weights_path, ignore_errors=True)
        self._weights_path = path
        self._version = weights.version

    def _aborted_total(self) -> float:
        return parse_metrics(self._get_text("/metrics"), (ABORTED_COUNTER,))

    def _wait_healthy(self, log_path: str) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise SGLangError(f"sglang exited with {self._proc.returncode} while starting; "
                                  f"last log lines:\n{_tail(log_path)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=self.cfg.request_timeout_s) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while it loads
            time.sleep(self.cfg.poll_interval_s)
        self.stop()
        raise SGLangError(f"sglang not healthy after {self.cfg.startup_timeout_s}s; last log lines:\n{_tail(log_path)}")

    def _wait_idle(self) -> None:
        """``/flush_cache`` until it answers 200: SGLang flushes only an idle scheduler and answers
        400 while requests run or wait (slime retries it the same way). Retried with doubling
        waits up to ``FLUSH_BACKOFF_MAX_S``; ``SGLangError`` after ``cfg.flush_cache_timeout_s``."""
        deadline = time.monotonic() + self.cfg.flush_cache_timeout_s
        delay, last = self.cfg.poll_interval_s, ""
        while True:
            req = urllib.request.Request(self.url + "/flush_cache", data=b"", method="POST",
                                         headers=engine_key.headers(self._api_key))
            try:
                with urllib.request.urlopen(req, timeout=self.cfg.request_timeout_s):
                    return
            except urllib.error.HTTPError as e:
                last = e.read()[:200].decode(errors="replace").strip()
                if e.code != 400:
                    raise SGLangError(f"/flush_cache: HTTP {e.code}: {last}") from None
            except (urllib.error.URLError, OSError) as e:
                raise SGLangError(f"/flush_cache: {e}") from None
            if time.monotonic() + delay > deadline:
                raise SGLangError(f"/flush_cache: scheduler not idle after {self.cfg.flush_cache_timeout_s}s "
                                  f"(requests still running or waiting); last reply: {last!r}")
            time.sleep(delay)
            delay = min(2 * delay, FLUSH_BACKOFF_MAX_S)

    def _post(self, path: str, body: dict, *, want_json: bool = True) -> dict:
        """POST JSON; return the JSON object reply. ``want_json=False``: an empty body or ``null``
        is success, ``{}`` (release/resume return nothing, which FastAPI sends as ``200 null``;
        abort sends an empty 200); a JSON object is still checked for an error."""
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **engine_key.headers(self._api_key)})
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.request_timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            raise SGLangError(f"{path}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise SGLangError(f"{path}: {e}") from None
        if not raw.strip():
            if want_json:
                raise SGLangError(f"{path}: want a JSON object, got empty reply")
            return {}
        try:
            reply = json.loads(raw)
        except ValueError:
            raise SGLangError(f"{path}: reply is not JSON: {raw[:200]!r}") from None
        if reply is None and not want_json:
            return {}
        if not isinstance(reply, dict):
            got = "null" if reply is None else type(reply).__name__
            raise SGLangError(f"{path}: want a JSON object, got {got}")
        if reply.get("success") is False or "error" in reply or reply.get("status") == "error":
            raise SGLangError(f"{path}: {reply.get('message') or reply.get('error')!r}")
        return reply

    def _get_text(self, path: str) -> str:
        try:
            req = urllib.request.Request(self.url + path, headers=engine_key.headers(self._api_key))
            with urllib.request.urlopen(req, timeout=self.cfg.request_timeout_s) as r:
                return r.read().decode()
        except urllib.error.HTTPError as e:
            raise SGLangError(f"{path}: HTTP {e.code}") from None
        except (urllib.error.URLError, OSError) as e:
            raise SGLangError(f"{path}: {e}") from None


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return "(no log)"
