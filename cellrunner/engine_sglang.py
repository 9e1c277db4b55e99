"""The cellrunner's side of ``engine=sglang``: a cell's SGLang servers, driven over HTTP.

Same lifecycle as ``cellrunner.engine.EmbeddedEngine`` (start / resume / update_weights / drain /
release / stop, ``url``, ``weight_version``, ``num_running``), so ``cellrunner.main`` swaps one for
the other; the proxy talks to each server's native API exactly as to the embedded engine (token
ids in, token ids and log-probs out: ``--skip-tokenizer-init``).

- Servers: a cell runs as many independent servers as its layout gives (``cellrunner.servers``:
  SGLang refuses DP across nodes, so a 48-node cell at TP 8 is 48 servers). ``SGLangProcess`` is
  one node's part of one server, started by the rank the placement names; ``SGLangServer`` is
  one server's admin API; ``SGLangEngine``, on the cell's leader, starts server 0 and sends every
  switch to all servers at once, raising one error that names each server that failed.
- Start: ``python -m sglang.launch_server`` with tp/dp/ep, ``--base-gpu-id`` for a server that
  is not its node's first, and, on several nodes, SGLang's own ``--nnodes/--node-rank/--dist-init-addr``
  (each node's part is started by a rank there; only the server's first node serves HTTP, the
  others a health check). ``--enable-memory-saver`` so the cell can hand its GPU memory to the trainer;
  ``--load-format dummy`` unless an HF checkpoint is given, because the first ``resume`` loads
  the real weights anyway. Healthy = ``GET /health`` answers 200 (a one-token probe).
- Weights: ``POST /update_weights_from_disk`` from a tmpfs folder (``weight_dir``, /dev/shm),
  written once by the leader as safetensors in the serving dtype and loaded by every server (a
  cell over several nodes needs ``weight_dir`` on a shared file system). Chosen over the other endpoints because it needs
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
- Shared KV (``engine.kv_tier``, off by default): HiCache with Mooncake Store as the run's L3
  (``cellrunner.sglang_hicache``). Every load detaches the store first and attaches it again after,
  its keys tagged with the new version; an update while serving then pauses (abort mode) around it.
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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from cellrunner import sglang_hicache
from cellrunner.errors import BackendUnavailable
from cellrunner.config import ModelConfig, SGLangConfig
from cellrunner.model import FlatWeights, hf_config
from base import engine_key

log = logging.getLogger(__name__)

ABORT_SETTLE_S = 60.0
"""After ``abort_all``, how long the server may take to answer every aborted request."""
STOP_GRACE_S = 30.0
RUNNING_GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs")
ABORTED_COUNTER = "sglang:num_aborted_requests_total"
WEIGHTS_LOAD_FORMAT = "safetensors"
"""What ``write_weights`` writes, as SGLang's ``LoadFormat`` names it (srt/configs/load_config.py)."""
MAX_PARALLEL = 64
"""At most this many servers are driven at once (a 48-node cell at TP 8 runs 48)."""
FLUSH_BACKOFF_MAX_S = 2.0
"""The longest wait between two ``/flush_cache`` tries (it starts at ``poll_interval_s``, doubling)."""
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class SGLangError(BackendUnavailable):
    """An SGLang server failed to start, died, or answered an admin call badly."""


def _launch_with_key(key_flags: tuple[str, ...]) -> str:
    """Python that runs ``sglang.launch_server`` with each of ``key_flags`` followed by the key from
    the environment (``engine_key.ENV``), added inside the process: ``/proc/<pid>/cmdline`` keeps the
    argv it was started with, which every local user can read. Plain Python, so it needs nothing of
    Gyre in the SGLang environment."""
    return (
        "import os, runpy, sys; key = os.environ.pop('GYRE_ENGINE_API_KEY', ''); "
        f"sys.argv += [a for flag in {list(key_flags)!r} for a in (flag, key)] if key else []; "
        "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)"
    )


_LAUNCH_WITH_KEY = _launch_with_key(("--api-key",))
_LAUNCH_WITH_ADMIN_KEY = _launch_with_key(("--api-key", "--admin-api-key"))
"""With ``engine.kv_tier``: the same key as ``--admin-api-key`` too, which SGLang demands before it
re-attaches the L3 store (``http_server.py``, ``attach_hicache_storage_backend``). Its admin routes
then take the admin key only (``srt/utils/auth.py``), which is the same key, so every call works."""


def launch_command(
    cfg: SGLangConfig, *, model_path: str, host: str, port: int, max_running: int, seed: int,
    dummy_weights: bool, node_rank: int = 0, dist_init_addr: str = "", base_gpu_id: int = 0,
    served_model_name: str = "",
) -> list[str]:
    """The ``sglang.launch_server`` argv for one node of a cell's server (its API key, if any,
    comes from ``engine_key.ENV`` in the server's environment). ``served_model_name``: the same in
    every server of the run, needed with ``kv_tier`` (``sglang_hicache.launch_flags``)."""
    if cfg.nnodes > 1 and not dist_init_addr:
        raise ValueError("nnodes > 1 needs dist_init_addr (node 0's host:port)")
    if not 0 <= node_rank < cfg.nnodes:
        raise ValueError(f"node_rank {node_rank}: want 0..{cfg.nnodes - 1}")
    if base_gpu_id < 0:
        raise ValueError(f"base_gpu_id {base_gpu_id}: want >= 0")
    tier = cfg.kv_tier
    cmd = [
        cfg.python or sys.executable, "-c", _LAUNCH_WITH_ADMIN_KEY if tier.enabled else _LAUNCH_WITH_KEY,
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
    if base_gpu_id:  # one of several servers on this node (cellrunner.servers)
        cmd += ["--base-gpu-id", str(base_gpu_id)]
    if cfg.nnodes > 1:
        cmd += ["--nnodes", str(cfg.nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]
    if tier.enabled:
        cmd += sglang_hicache.launch_flags(tier, tp_size=cfg.tp_size, served_model_name=served_model_name)
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


def server_log_path(log_dir: str, cell_id: int, server: int, node_rank: int) -> str:
    """Where one node's part of a server logs: the same name on every node (a shared log folder
    lets the leader quote a remote server's last lines when it fails to start)."""
    return os.path.join(log_dir, f"sglang-cell{cell_id}-server{server}-node{node_rank}.log")


class SGLangProcess:
    """One node's part of one server: ``sglang.launch_server`` in a session of its own, started by
    the rank that ``cellrunner.servers`` gives it. Its port is picked here, so its URL is known
    (and can be gathered by the leader) before it starts."""

    def __init__(
        self, cfg: SGLangConfig, *, model_cfg: ModelConfig, vocab_size: int, host: str, port: int, cell_id: int,
        max_running: int, seed: int, log_dir: str, server: int = 0, node_rank: int = 0, base_gpu_id: int = 0,
        dist_init_addr: str = "", api_key: str = "",
    ) -> None:
        self.cfg = cfg
        self._model_cfg, self._vocab_size = model_cfg, vocab_size
        self._cell_id, self._max_running, self._seed = cell_id, max_running, seed
        self.server, self.node_rank, self.base_gpu_id = server, node_rank, base_gpu_id
        self.dist_init_addr = dist_init_addr
        self._api_key = api_key
        self.proc: subprocess.Popen | None = None
        self._log_file: Any = None
        self.log_path = server_log_path(log_dir, cell_id, server, node_rank)
        # Each part writes its own start-up folder: on a shared weight_dir, parts of other servers
        # write theirs at the same moment.
        self._init_dir = os.path.join(cfg.weight_dir, f"cell{cell_id}", f"init-s{server}-n{node_rank}")
        self.url = f"http://{host}:{port or _free_port(host)}"
        self._host, self._port = host, int(self.url.rsplit(":", 1)[1])

    @property
    def serves_http(self) -> bool:
        return self.node_rank == 0

    def start(self) -> None:
        """Start the process and return (the leader waits for every server's health)."""
        model_path = self._model_cfg.path or self._write_model_dir()
        cmd = launch_command(
            self.cfg, model_path=model_path, host=self._host, port=self._port, max_running=self._max_running,
            seed=self._seed, dummy_weights=not self._model_cfg.path, node_rank=self.node_rank,
            dist_init_addr=self.dist_init_addr, base_gpu_id=self.base_gpu_id, served_model_name=self._model_cfg.name,
        )
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        # Its own session, so stop() can end the server and every scheduler it forked together.
        env = {**os.environ, engine_key.ENV: self._api_key}
        if self.cfg.kv_tier.enabled:
            env.update(sglang_hicache.server_env(self._host))
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env)
        log.info("sglang cell=%s server=%s node=%s: %s", self._cell_id, self.server, self.node_rank, " ".join(cmd))

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        proc, self.proc = self.proc, None
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
        shutil.rmtree(self._init_dir, ignore_errors=True)

    def _write_model_dir(self) -> str:
        os.makedirs(self._init_dir, exist_ok=True)
        with open(os.path.join(self._init_dir, "config.json"), "w") as f:
            json.dump(model_config_json(self._model_cfg, self._vocab_size, self.cfg.dtype), f)
        return self._init_dir


class SGLangServer:
    """One server's admin API, driven over HTTP by the cell's leader wherever the server runs.
    Holds what the leader knows of it: the version it serves, released, paused."""

    def __init__(self, cfg: SGLangConfig, url: str, *, index: int, api_key: str = "", log_path: str = "") -> None:
        self.cfg, self.url, self.index = cfg, url, index
        self.api_key, self.log_path = api_key, log_path
        self.version: int | None = None
        self.released = False
        self.paused = False

    @property
    def name(self) -> str:
        return f"server {self.index} ({self.url})"

    def wait_healthy(self, deadline: float, proc: SGLangProcess | None = None) -> None:
        """``GET /health`` until 200; SGLangError (with the log's last lines) when the process
        exits or ``deadline`` (monotonic) passes."""
        while time.monotonic() < deadline:
            code = proc.exit_code() if proc is not None else None
            if code is not None:
                raise SGLangError(f"{self.name}: sglang exited with {code} while starting; "
                                  f"last log lines:\n{_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=self.cfg.request_timeout_s) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while it loads
            time.sleep(self.cfg.poll_interval_s)
        raise SGLangError(f"{self.name}: not healthy after {self.cfg.startup_timeout_s}s; last log lines "
                          f"({self.log_path}):\n{_tail(self.log_path)}")

    # ------------------------------------------------------------ one switch, on this server

    def resume(self, path: str, version: int) -> None:
        if self.version is not None and not self.released:
            raise RuntimeError(f"resume: a model is already loaded on {self.name}; use update_weights, or release first")
        if self.released:
            self.post("/resume_memory_occupation", {"tags": ["weights"]}, want_json=False)
        self.load(path, version)
        if self.released:
            self.post("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}, want_json=False)
            self.released = False
        self.attach_kv_tier(version)  # once the pools it registers are back
        if self.paused:
            self.post("/continue_generation", {})
            self.paused = False

    def update(self, path: str, version: int) -> None:
        if self.released:
            raise RuntimeError(f"update_weights: {self.name} is released; resume it")
        if not self.cfg.kv_tier.enabled:
            self.load(path, version)
            return
        # SGLang swaps its L3 store only on an idle scheduler (srt/managers/scheduler.py,
        # attach/detach_hicache_storage_wrapped), so the update cannot run under live traffic: the
        # running calls are aborted as in a drain (the proxy sends them again), new ones wait in
        # the tokenizer until continue_generation, which follows whether the load worked or not.
        self.post("/pause_generation", {"mode": "abort"})
        self.paused = True
        try:
            self.load(path, version)
            self.attach_kv_tier(version)
        finally:
            self.post("/continue_generation", {})
            self.paused = False

    def load(self, path: str, version: int) -> None:
        if self.paused:
            # Switching back to serve: nothing may be left in the scheduler, or the update's own
            # flush fails it. While serving, the update waits for running calls (SGLang's
            # model-update lock) and flushes itself; live traffic would keep /flush_cache at 400.
            self.wait_idle()
        # Off the store before the weights change: a server that fails half-way through a load
        # must neither read nor write pages under the old version's tag.
        self.detach_kv_tier()
        reply = self.post("/update_weights_from_disk", {
            "model_path": path, "load_format": WEIGHTS_LOAD_FORMAT, "weight_version": str(version),
            "flush_cache": True, "abort_all_requests": False,
        })
        if reply.get("success") is not True:
            raise SGLangError(f"{self.name}: /update_weights_from_disk: {reply.get('message')!r}")
        self.version = version

    def drain(self, timeout_s: float, poll_s: float) -> int:
        if self.released:
            return 0
        aborted_before = self.aborted_total()
        deadline = time.monotonic() + timeout_s
        while self.load_now() and time.monotonic() < deadline:
            time.sleep(poll_s)
        if self.load_now():
            self.post("/abort_request", {"abort_all": True}, want_json=False)
            settle = time.monotonic() + ABORT_SETTLE_S
            while self.load_now() and time.monotonic() < settle:
                time.sleep(poll_s)
        return max(0, int(self.aborted_total() - aborted_before))

    def release(self) -> None:
        if self.released:
            return
        # Abort mode: nothing keeps running (release needs an idle server); new calls wait.
        self.post("/pause_generation", {"mode": "abort"})
        self.paused = True
        self.wait_idle()
        self.post("/release_memory_occupation", {}, want_json=False)
        self.released = True
        self.version = None

    def detach_kv_tier(self) -> None:
        """``DELETE /hicache/storage-backend``: SGLang answers 200 also when nothing is attached."""
        if self.cfg.kv_tier.enabled:
            self.send_text("DELETE", "/hicache/storage-backend")

    def attach_kv_tier(self, version: int) -> None:
        """``PUT /hicache/storage-backend``: a new store backend whose keys carry ``version``."""
        if self.cfg.kv_tier.enabled:
            body = sglang_hicache.attach_body(self.cfg.kv_tier, tp_size=self.cfg.tp_size, version=version)
            self.send_text("PUT", "/hicache/storage-backend", body)

    # ------------------------------------------------------------ HTTP

    def load_now(self) -> int:
        return int(parse_metrics(self.get_text("/metrics"), RUNNING_GAUGES))

    def aborted_total(self) -> float:
        return parse_metrics(self.get_text("/metrics"), (ABORTED_COUNTER,))

    def wait_idle(self) -> None:
        """``/flush_cache`` until it answers 200: SGLang flushes only an idle scheduler and answers
        400 while requests run or wait (slime retries it the same way). Retried with doubling
        waits up to ``FLUSH_BACKOFF_MAX_S``; ``SGLangError`` after ``cfg.flush_cache_timeout_s``."""
        deadline = time.monotonic() + self.cfg.flush_cache_timeout_s
        delay, last = self.cfg.poll_interval_s, ""
        while True:
            req = urllib.request.Request(self.url + "/flush_cache", data=b"", method="POST",
                                         headers=engine_key.headers(self.api_key))
            try:
                with urllib.request.urlopen(req, timeout=self.cfg.request_timeout_s):
                    return
            except urllib.error.HTTPError as e:
                last = e.read()[:200].decode(errors="replace").strip()
                if e.code != 400:
                    raise SGLangError(f"{self.name}: /flush_cache: HTTP {e.code}: {last}") from None
            except (urllib.error.URLError, OSError) as e:
                raise SGLangError(f"{self.name}: /flush_cache: {e}") from None
            if time.monotonic() + delay > deadline:
                raise SGLangError(f"{self.name}: /flush_cache: scheduler not idle after "
                                  f"{self.cfg.flush_cache_timeout_s}s (requests still running or waiting); "
                                  f"last reply: {last!r}")
            time.sleep(delay)
            delay = min(2 * delay, FLUSH_BACKOFF_MAX_S)

    def post(self, path: str, body: dict, *, want_json: bool = True) -> dict:
        """POST JSON; return the JSON object reply. ``want_json=False``: an empty body or ``null``
        is success, ``{}`` (release/resume return nothing, which FastAPI sends as ``200 null``;
        abort sends an empty 200); a JSON object is still checked for an error."""
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **engine_key.headers(self.api_key)})
        where = f"{self.name}: {path}"
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.request_timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            raise SGLangError(f"{where}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise SGLangError(f"{where}: {e}") from None
        if not raw.strip():
            if want_json:
                raise SGLangError(f"{where}: want a JSON object, got empty reply")
            return {}
        try:
            reply = json.loads(raw)
        except ValueError:
            raise SGLangError(f"{where}: reply is not JSON: {raw[:200]!r}") from None
        if reply is None and not want_json:
            return {}
        if not isinstance(reply, dict):
            got = "null" if reply is None else type(reply).__name__
            raise SGLangError(f"{where}: want a JSON object, got {got}")
        if reply.get("success") is False or "error" in reply or reply.get("status") == "error":
            raise SGLangError(f"{where}: {reply.get('message') or reply.get('error')!r}")
        return reply

    def send_text(self, method: str, path: str, body: dict | None = None) -> str:
        """A route SGLang answers in plain text, 200 or 400 with the reason (``http_server.py``,
        the ``/hicache/storage-backend`` routes); anything but 200 raises ``SGLangError``."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **engine_key.headers(self.api_key)})
        where = f"{self.name}: {method} {path}"
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.request_timeout_s) as r:
                return r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace").strip()
            raise SGLangError(f"{where}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise SGLangError(f"{where}: {e}") from None

    def get_text(self, path: str) -> str:
        try:
            req = urllib.request.Request(self.url + path, headers=engine_key.headers(self.api_key))
            with urllib.request.urlopen(req, timeout=self.cfg.request_timeout_s) as r:
                return r.read().decode()
        except urllib.error.HTTPError as e:
            raise SGLangError(f"{self.name}: {path}: HTTP {e.code}") from None
        except (urllib.error.URLError, OSError) as e:
            raise SGLangError(f"{self.name}: {path}: {e}") from None


class SGLangEngine:
    """A cell's serving, on its leader: server 0's first node part (this process starts it) and
    every server of the cell, driven over HTTP. Each switch goes to all servers at once; one that
    fails is named in the ``SGLangError`` the switch raises, after the others have finished theirs.
    Lifecycle calls block until done."""

    def __init__(
        self, cfg: SGLangConfig, *, model_cfg: ModelConfig, vocab_size: int, host: str, port: int, cell_id: int,
        max_running: int, seed: int, log_dir: str, dist_init_addr: str = "", api_key: str = "",
        process: SGLangProcess | None = None, other_servers: Sequence[str] = (), log_paths: Sequence[str] = (),
    ) -> None:
        """``process``: server 0's first part, when the caller placed it (else made from the
        arguments); ``other_servers``: the HTTP URLs of the cell's servers 1.. (started by other
        ranks), ``log_paths`` theirs (quoted when one fails to start)."""
        if cfg.kv_tier.enabled and not api_key:
            raise ValueError("engine.kv_tier: SGLang re-attaches its L3 store at each weight version only for "
                             "an admin key (--admin-api-key), and the run's engine key is that key; none given")
        self.cfg = cfg
        self._cell_id = cell_id
        self.process = process or SGLangProcess(
            cfg, model_cfg=model_cfg, vocab_size=vocab_size, host=host, port=port, cell_id=cell_id,
            max_running=max_running, seed=seed, log_dir=log_dir, dist_init_addr=dist_init_addr, api_key=api_key)
        urls = [self.process.url, *other_servers]
        if len(set(urls)) != len(urls):
            raise ValueError(f"the cell's servers must have distinct URLs, got {urls}")
        paths = [self.process.log_path, *log_paths, *[""] * len(urls)]
        self.servers = [SGLangServer(cfg, u, index=i, api_key=api_key, log_path=paths[i]) for i, u in enumerate(urls)]
        self._lifecycle = threading.Lock()
        self._cell_dir = os.path.join(cfg.weight_dir, f"cell{cell_id}")  # this cell's weight files
        self._config_json = model_config_json(model_cfg, vocab_size, cfg.dtype)
        self._weights_path = ""
        self._unreachable: set[str] = set()
        self.down_urls: tuple[str, ...] = ()
        """The servers whose load could not be read at the last ``num_running``: the cell's
        heartbeat names them, and the controller stops routing to them until they answer."""
        self._pool = ThreadPoolExecutor(max_workers=min(len(self.servers), MAX_PARALLEL), thread_name_prefix="sglang")

    @property
    def url(self) -> str:
        return self.servers[0].url

    @property
    def urls(self) -> list[str]:
        """Every server's URL, server 0 (this node's) first."""
        return [s.url for s in self.servers]

    @property
    def weight_version(self) -> int | None:
        """The oldest version a server serves (the lower bound the routing table promises; a
        server that failed an update keeps its last); None while any serves none (released)."""
        versions = [s.version for s in self.servers]
        return None if None in versions else min(versions)  # type: ignore[type-var]

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.process.start()
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        try:
            self._each("start", lambda s: s.wait_healthy(deadline, self.process if s.index == 0 else None))
        except SGLangError:
            self.stop()
            raise

    def resume(self, weights: FlatWeights) -> None:
        with self._lifecycle:
            path = self._write(weights)
            self._each("resume", lambda s: s.resume(path, weights.version))
            self._drop_old(path)
        log.info("sglang cell=%s: %d server(s) serving weight_version=%s", self._cell_id, len(self.servers),
                 weights.version)

    def update_weights(self, weights: FlatWeights) -> None:
        with self._lifecycle:
            released = [s.name for s in self.servers if s.released]
            if released:
                raise RuntimeError(f"update_weights: {', '.join(released)} released; resume the engine")
            path = self._write(weights)
            self._each("update_weights", lambda s: s.update(path, weights.version))
            self._drop_old(path)

    def drain(self, timeout_s: float) -> int:
        """Let running calls finish for up to ``timeout_s``, abort the rest (they answer 200 with
        their partial output); return how many were aborted, over all servers."""
        with self._lifecycle:
            return sum(self._each("drain", lambda s: s.drain(timeout_s, self.cfg.poll_interval_s)))

    def release(self) -> None:
        """Stop serving and free the GPU memory (weights, KV cache, CUDA graphs) of every server."""
        with self._lifecycle:
            self._each("release", lambda s: s.release())

    def stop(self) -> None:
        with self._lifecycle:
            self.process.stop()
            shutil.rmtree(self._cell_dir, ignore_errors=True)
            self._weights_path = ""
        self._pool.shutdown(wait=False)

    def num_running(self) -> int:
        """Running + queued requests over the servers, for heartbeats. A released server counts 0;
        one whose metrics cannot be read counts 0 and is logged once until it answers again (a
        heartbeat must not kill the cell)."""
        def load(s: SGLangServer) -> int:
            if s.released:
                return 0
            try:
                n = s.load_now()
            except SGLangError as exc:
                if s.url not in self._unreachable:
                    log.warning("sglang cell=%s: load unknown: %s", self._cell_id, exc)
                self._unreachable.add(s.url)
                return 0
            if s.url in self._unreachable:
                log.info("sglang cell=%s: %s answers again", self._cell_id, s.name)
                self._unreachable.discard(s.url)
            return n

        if self.process.proc is None:
            return 0
        total = sum(self._pool.map(load, self.servers))
        # Replaced whole, never mutated: the heartbeat thread reads it while this one works.
        self.down_urls = tuple(s.url for s in self.servers if s.url in self._unreachable)
        return total

    # ------------------------------------------------------------ internals

    def _each(self, what: str, fn: Callable[[SGLangServer], Any]) -> list[Any]:
        """``fn`` on every server at once; every server finishes its own before a failure is
        raised, naming each server that failed (so none is left half-way without a word)."""
        futures = [self._pool.submit(fn, s) for s in self.servers]
        results, failed = [], []
        for s, fut in zip(self.servers, futures):
            try:
                results.append(fut.result())
            except Exception as exc:  # every failure is reported below, none dropped
                failed.append((s, exc))
        if failed:
            lines = "; ".join(str(exc) if s.name in str(exc) else f"{s.name}: {exc}" for s, exc in failed)
            kind = RuntimeError if all(isinstance(e, RuntimeError) and not isinstance(e, SGLangError)
                                       for _, e in failed) else SGLangError
            raise kind(f"{what}: {len(failed)} of {len(self.servers)} server(s) failed: {lines}")
        return results

    def _write(self, weights: FlatWeights) -> str:
        """The version as an HF folder every server loads (one write, whatever the number of servers)."""
        path = os.path.join(self._cell_dir, f"v{weights.version}")
        return write_weights(weights, path, dtype=_DTYPES[self.cfg.dtype], config_json=self._config_json)

    def _drop_old(self, path: str) -> None:
        if self._weights_path and self._weights_path != path:
            shutil.rmtree(self._weights_path, ignore_errors=True)
        self._weights_path = path


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return "(no log)"
