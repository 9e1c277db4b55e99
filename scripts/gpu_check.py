"""The GPU check: the real stack on one GPU in <= 8 minutes; the last stdout line is one JSON object.

A Qwen3-0.6B-shaped checkpoint folder (random init, ~0.6 B parameters, bf16, Qwen3's
tokenizer.json; written on the spot by ``cellrunner.make_checkpoint``, read as ``model.path``)
goes through what a Gyre cell does on a cluster, with the production classes:

1. SGLang serving (``cellrunner.engine_sglang.SGLangEngine``): start on the folder, load version 0
   from the Megatron trainer (which read the same folder), concurrent ``/generate`` calls with log-probs (tokens/s).
2. A role switch serve -> train, timed per phase (drain, release, trainer start).
3. One Megatron GSPO step (``cellrunner.megatron_trainer.MegatronTrainer``, bf16, DDP + Megatron
   optimizer) on the served samples; the served log-probs vs Megatron's recomputed ones on the
   same weights (the train/inference mismatch; goal: mean |delta| <= 0.02). Then the core's
   gradient on one shard before and after it offloads for serving and comes back: the same.
4. The core's long operations around serving (``trainer_cycle``): stop (offload), weights(),
   checkpoint, start, and a step whose gradient is not zero; each per billion parameters against
   the heartbeat and start limits. GPU 0's peak in a step with the Mooncake publisher's slots
   filled (``publisher_slots``: host memory, 0 bytes on the GPU). One-trajectory steps at 4k,
   8k, 16k and 32k tokens until the first out-of-memory (``long_context``).
5. A role switch train -> serve with the new version, timed; the served weight_version checked.
6. A weight update into the serving engine (``/update_weights_from_disk`` from /dev/shm).
7. The Mooncake Transfer Engine pull, GPU memory to GPU memory, between two processes with the
   installed build (the CUDA 13 one from ``make gpu-env``), over TCP and then RDMA: the time to
   register GPU memory, raw reads, and Gyre's own publisher/puller with ``cluster.mooncake.memory=cuda``.

Each stage runs in its own guard: a failure is recorded under ``errors`` and the check goes on
where it can, so one run gives every figure it can. Not a test: nothing is asserted but shapes.

    scripts/gpu_check.sh            # or: python scripts/gpu_check.py [--budget-s 450]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Qwen3-0.6B's shape (config.json of Qwen/Qwen3-0.6B); weights are a seeded random init.
VOCAB = 151936  # Qwen3's padded embedding rows
PARITY_GOAL = 0.02  # mean |served - Megatron| log-prob in bf16 on the same tokens (issue 23)
CHUNK_BYTES = 64 << 20


class TimeUp(Exception):
    """SIGTERM from scripts/gpu_check.sh's timeout: record it, skip the rest, still print the JSON."""


class Report:
    """Figures, per-stage errors and the time budget of one run."""

    def __init__(self, budget_s: float):
        self.t0 = time.monotonic()
        self.budget_s = budget_s
        self.figures: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.skipped: list[str] = []
        self.off: set[str] = set()
        """Stages this run leaves out on purpose (``--no-sglang``), said once in ``skipped``."""

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    @contextlib.contextmanager
    def stage(self, name: str, *, needs_s: float = 0.0, requires: bool = True) -> Iterator[bool]:
        if name in self.off:
            yield False
            return
        if not requires:
            self.skipped.append(f"{name}: an earlier stage failed")
            yield False
            return
        if self.left() < needs_s:
            self.skipped.append(f"{name}: out of time")
            yield False
            return
        t = time.monotonic()
        print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
        try:
            yield True
        except Exception as exc:  # record and go on: one run should give every figure it can
            self.errors[name] = f"{type(exc).__name__}: {exc}"[:2000]
            traceback.print_exc(file=sys.stderr)
        finally:
            self.figures.setdefault("stage_s", {})[name] = round(time.monotonic() - t, 3)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "sglang", "megatron-core", "mooncake-transfer-engine-cuda13", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def post_generate(url: str, prompt: list[int], max_new_tokens: int) -> dict:
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        reply = json.loads(r.read())
    if not isinstance(reply, dict) or not isinstance(reply.get("meta_info"), dict):
        raise ValueError(f"/generate: unexpected reply {str(reply)[:200]}")
    return reply


def serve_batch(url: str, n: int, prompt_len: int, new_tokens: int, seed: int) -> tuple[list[dict], float]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 100000) for _ in range(prompt_len)] for _ in range(n)]
    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n) as pool:
        replies = list(pool.map(lambda p: post_generate(url, p, new_tokens), prompts))
    wall = time.perf_counter() - t
    samples = []
    for prompt, reply in zip(prompts, replies):
        lp = reply["meta_info"].get("output_token_logprobs") or []
        # SGLang's entry: [logprob, token_id, text]; tokens are taken from it, as slime does
        samples.append({"prompt": prompt, "tokens": [int(e[1]) for e in lp], "logprobs": [float(e[0]) for e in lp],
                        "version": reply["meta_info"].get("weight_version")})
    return samples, wall


def shard_from(samples: list[dict], step: int) -> Any:
    from base import wire

    seqs = []
    for i, s in enumerate(samples):
        n_out = len(s["tokens"])
        tokens = s["prompt"] + s["tokens"]
        mask = [0] * len(s["prompt"]) + [1] * n_out
        blp = [0.0] * len(s["prompt"]) + s["logprobs"]
        seqs.append(wire.Sequence(execution_id=f"e{i}", tokens=tokens, target_mask=mask, behaviour_logprobs=blp,
                                  advantage=1.0 if i % 2 else -1.0, token_weight=1.0 / max(n_out, 1)))
    return wire.Shard(step=step, shard_id="gpu-check", num_executions=len(seqs), sequences=seqs)


def trainer_samples(trainer: Any, n: int, prompt_len: int, new_tokens: int, seed: int) -> list[dict]:
    """Without SGLang (``--no-sglang``): random completions, their behaviour log-probs scored by the
    trainer itself, so the GSPO step runs on real shapes (its first ratio is 1 up to bf16 noise)."""
    import torch

    from cellrunner.gspo import pack

    rng = random.Random(seed)
    samples = [{"prompt": [rng.randrange(1000, 100000) for _ in range(prompt_len)],
                "tokens": [rng.randrange(1000, 100000) for _ in range(new_tokens)], "logprobs": [0.0] * new_tokens}
               for _ in range(n)]
    batch = pack(list(shard_from(samples, 0).sequences))
    with torch.no_grad():
        ids = batch.input_ids.to(trainer.device)
        pos = torch.arange(ids.shape[1], device=trainer.device).expand_as(ids)
        lp = trainer.token_logprobs(trainer.model(ids, pos, None), batch.targets.to(trainer.device)).float().cpu()
    for row, s in enumerate(samples):
        cols = batch.target_mask[row].bool().nonzero().flatten().tolist()
        s["logprobs"] = [float(lp[row, c]) for c in cols]
        if len(s["logprobs"]) != new_tokens:
            raise ValueError(f"sample {row}: {len(s['logprobs'])} scored tokens, want {new_tokens}")
    return samples


def offload_roundtrip(trainer: Any, shard: Any) -> dict[str, Any]:
    """The core's gradient on one shard before and after it offloads for serving and comes back
    (``trainer.offload_when_serving``): the same weights and data must give the same gradient.
    Before cellrunner/param_offload.py it came back zero (DDP's hooks lost with the old storage)."""
    import numpy as np

    trainer.microstep(shard)
    before = trainer.take_grads()
    t = time.perf_counter()
    trainer.stop()
    offload_s = time.perf_counter() - t
    offloaded = trainer._offloaded
    t = time.perf_counter()
    trainer.start(None)
    restore_s = time.perf_counter() - t
    trainer.microstep(shard)
    after = trainer.take_grads()
    stray = [n for n, p in trainer.model.module.named_parameters() if p.grad is not None]
    scale = float(np.abs(before).max()) or 1.0
    return {"offloaded": offloaded, "offload_s": round(offload_s, 3), "restore_s": round(restore_s, 3),
            "grad_l2_before": float(np.linalg.norm(before)),
            "grad_l2_after": float(np.linalg.norm(after)),
            "max_abs_diff_rel": float(np.abs(after - before).max()) / scale,
            "params_with_stray_grad": len(stray), "same": bool(np.allclose(after, before, rtol=1e-3, atol=1e-6 * scale))
            and not stray}


def logprob_mismatch(trainer: Any, samples: list[dict], k: int) -> dict[str, float]:
    """Served log-probs vs Megatron's on the same weights (bf16 both sides)."""
    import torch

    from cellrunner.gspo import pack

    batch = pack(list(shard_from(samples[:k], 0).sequences))
    with torch.no_grad():
        ids = batch.input_ids.to(trainer.device)
        pos = torch.arange(ids.shape[1], device=trainer.device).expand_as(ids)
        lp = trainer.token_logprobs(trainer.model(ids, pos, None), batch.targets.to(trainer.device)).float().cpu()
    mask = batch.target_mask.bool()
    diff = (lp[mask] - batch.behaviour_logprobs[mask]).abs()
    mean = float(diff.mean())
    return {"mean_abs": mean, "max_abs": float(diff.max()), "tokens": int(mask.sum()),
            "goal_mean_abs": PARITY_GOAL, "meets_goal": mean <= PARITY_GOAL}


class TickWatch:
    """A thread that ticks every ``interval_s``, as the cell's heartbeat thread does
    (``cellrunner.main``'s ControlLink), and keeps the longest gap between two ticks: an operation
    that holds the GIL (or the process) longer than the controller's heartbeat timeout would get a
    healthy cell declared dead."""

    def __init__(self, interval_s: float = 0.5):
        import threading

        self.interval_s = interval_s
        self.max_gap_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tick-watch", daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            self.max_gap_s = max(self.max_gap_s, now - last)
            last = now

    def __enter__(self) -> "TickWatch":
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()


def cluster_limits() -> dict[str, float]:
    """The limits a long operation runs against on a cluster: the controller's heartbeat timeout
    (conf/cluster/local.yaml, which slurm.yaml inherits) and a cell's start (conf/cluster/slurm.yaml)."""
    import yaml

    local = yaml.safe_load(open(ROOT / "conf/cluster/local.yaml"))
    slurm = yaml.safe_load(open(ROOT / "conf/cluster/slurm.yaml"))
    return {"heartbeat_timeout_s": float(local["heartbeat_timeout_s"]), "start_timeout_s": float(slurm["start_timeout_s"])}


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def trainer_cycle(trainer: Any, shard: Any, ckpt_dir: str, limits: dict[str, float]) -> dict[str, Any]:
    """The core's long operations in the order a cell runs them around serving: ``stop`` (offload
    to the host), ``weights()`` (the export serving engines load, read from the offloaded copies),
    ``save_checkpoint``, ``start`` (back on the device), then one step, whose gradient must not be
    zero (an offload that lost DDP's hooks gave exactly 0). Each timed, per billion parameters, and
    how many billion parameters fit in each limit at that rate; a heartbeat-like thread's longest
    gap says whether any of them starves the cell's heartbeat."""
    import numpy as np

    n = sum(p.numel() for p in trainer.model.module.parameters())
    before = trainer.weights(everywhere=False)
    ops: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        ops[name] = time.perf_counter() - t
        return out

    with TickWatch() as watch:
        timed("stop", trainer.stop)
        offloaded = bool(getattr(trainer, "_offloaded", False))
        exported = timed("weights", lambda: trainer.weights(everywhere=False))
        path = timed("checkpoint", lambda: trainer.save_checkpoint(ckpt_dir))
        timed("start", lambda: trainer.start(None))
        res = timed("step", lambda: trainer.microstep(shard))
        grads = trainer.take_grads()
    grad_l2 = float(np.linalg.norm(grads))
    billions = n / 1e9
    return {
        "parameters": n, "offloaded": offloaded, "version": trainer.version,
        "weights_after_stop_equal": bool(np.array_equal(exported.data, before.data)),
        "checkpoint": path, "checkpoint_bytes": sum(f.stat().st_size for f in Path(path).iterdir()),
        "step_tokens": res.num_tokens, "grad_l2": grad_l2, "nonzero_grad": bool(np.isfinite(grad_l2) and grad_l2 > 0),
        "ops": {k: {"s": round(v, 4), "s_per_billion": round(v / billions, 4),
                    **{f"billion_within_{lim}": float(f"{limit / (v / billions):.3g}") if v > 0 else None
                       for lim, limit in limits.items()}} for k, v in ops.items()},
        "max_tick_gap_s": round(watch.max_gap_s, 3), "limits": limits,
        "heartbeat_kept": watch.max_gap_s < limits["heartbeat_timeout_s"],
    }


def one_trajectory(length: int, seed: int, vocab: int = VOCAB) -> Any:
    """One sequence of ``length`` tokens, its second half the completion, behaviour log-probs at a
    random init's level (log 1/vocab), so the GSPO ratio is near 1 and the step has a gradient."""
    import math

    from base import wire

    rng = random.Random(seed)
    prompt = length // 2
    mask = [0] * prompt + [1] * (length - prompt)
    level = -math.log(vocab)
    lo, hi = min(1000, vocab // 4), min(vocab, 100000)  # ordinary tokens, no specials
    seq = wire.Sequence(execution_id=f"long{length}", tokens=[rng.randrange(lo, hi) for _ in range(length)],
                        target_mask=mask, behaviour_logprobs=[level if m else 0.0 for m in mask], advantage=1.0,
                        token_weight=1.0 / (length - prompt))
    return wire.Shard(step=0, shard_id=f"long-{length}", num_executions=1, sequences=[seq])


def long_context(trainer: Any, lengths: list[int], vocab: int = VOCAB) -> dict[str, Any]:
    """One-trajectory steps (forward and backward of one sequence) at growing lengths until the
    first that runs out of GPU memory: the longest trajectory one GPU trains with this layout."""
    import torch

    out: dict[str, Any] = {}
    first_oom = None
    for length in lengths:
        shard = one_trajectory(length, seed=length, vocab=vocab)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            sync()
            t = time.perf_counter()
            res = trainer.microstep(shard)
            sync()
            dt = time.perf_counter() - t
            trainer.take_grads()
            out[str(length)] = {"fwd_bwd_s": round(dt, 3), "tokens_per_s": round(length / dt, 1),
                                "target_tokens": res.num_tokens, "loss_finite": bool(res.loss == res.loss),
                                **({"peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
                                   if torch.cuda.is_available() else {})}
        except torch.cuda.OutOfMemoryError as exc:
            first_oom = length
            out[str(length)] = {"oom": True, "error": str(exc).splitlines()[0][:300]}
            trainer.model.zero_grad_buffer()  # what the partial backward left
            trainer.num_microsteps = 0
            torch.cuda.empty_cache()
            break
    fit = [int(k) for k, v in out.items() if not v.get("oom")]
    return {"lengths": out, "first_oom": first_oom, "longest_fit": max(fit) if fit else None}


def publisher_slots_during_step(trainer: Any, weights: Any, shard: Any, *, memory: str, protocol: str,
                                dtypes: tuple[str, ...]) -> dict[str, Any]:
    """The core's whole-model Mooncake publisher as a cell makes it (``memory`` as configured), both
    slots filled, then a training step: GPU 0's peak with the slots in place, and where they live.
    Before the slots moved to host memory they added 12 bytes a parameter to GPU 0."""
    import torch
    import zmq

    from cellrunner.transfer_mooncake import MooncakeWeightPublisher

    cuda = torch.cuda.is_available()
    sync()
    used = (lambda: torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]) if cuda else (lambda: 0)
    base_used, base_alloc = used(), torch.cuda.memory_allocated() if cuda else 0
    pub = MooncakeWeightPublisher(zmq.Context.instance(), "tcp://127.0.0.1:0", host="127.0.0.1", protocol=protocol,
                                  memory=memory, dtypes=dtypes)
    try:
        t = time.perf_counter()
        for version in (weights.version, weights.version + 1):  # both slots
            pub.publish(type(weights)(version, weights.specs, weights.data))
        sync()
        publish_s = (time.perf_counter() - t) / 2
        slots_used = used() - base_used
        slots_alloc = (torch.cuda.memory_allocated() - base_alloc) if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        res = trainer.microstep(shard)
        grads = trainer.take_grads()
        footprint = pub.footprint()
    finally:
        pub.close()
    return {"footprint": footprint, "publish_s": round(publish_s, 4),
            "gpu_bytes_added_by_slots": slots_alloc, "device_bytes_added_by_slots": slots_used,
            "step_tokens": res.num_tokens, "step_grad_nonzero": bool(abs(grads).sum() > 0),
            **({"peak_gpu_gib_step_with_slots": round(torch.cuda.max_memory_allocated() / 2**30, 2)} if cuda else {})}


def mooncake_build() -> dict[str, str]:
    """Which Mooncake distribution is installed (they all install ``mooncake``) and torch's CUDA."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    out = {"torch_cuda": str(torch.version.cuda)}
    for dist in ("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def mooncake_pull(nbytes: int, protocols: list[str], report: Report) -> None:
    """A child process reads ``nbytes`` of this process's GPU memory into its own, per protocol."""
    import torch
    from mooncake.engine import TransferEngine

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    checksum = int(src.sum(dtype=torch.int64))
    results = {}
    for protocol in protocols:
        te = TransferEngine()
        rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            results[protocol] = {"error": f"initialize rc={rc}"}
            continue
        t = time.perf_counter()
        if te.register_memory(src.data_ptr(), nbytes) != 0:
            results[protocol] = {"error": "register_memory of GPU memory failed"}
            continue
        register_s = time.perf_counter() - t
        session = f"127.0.0.1:{te.get_rpc_port()}"
        cmd = [sys.executable, __file__, "--mooncake-reader", protocol, session, str(src.data_ptr()), str(nbytes),
               str(checksum)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30.0, min(120.0, report.left())))
            last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
            results[protocol] = json.loads(last) if last.startswith("{") else {
                "error": f"reader exited {out.returncode}: {out.stderr[-500:]}"}
            results[protocol]["register_gpu_s"] = round(register_s, 4)
        except subprocess.TimeoutExpired:
            results[protocol] = {"error": "reader timed out"}
        te.unregister_memory(src.data_ptr())
    report.figures["mooncake_pull"] = {"bytes": nbytes, "build": mooncake_build(), **results}


def mooncake_reader(protocol: str, session: str, remote: int, nbytes: int, checksum: int) -> None:
    import torch
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") != 0:
        print(json.dumps({"error": "reader initialize failed"}))
        return
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    te.register_memory(dst.data_ptr(), nbytes)
    offsets = list(range(0, nbytes, CHUNK_BYTES))
    lens = [min(CHUNK_BYTES, nbytes - o) for o in offsets]
    times = []
    for _ in range(3):
        dst.zero_()
        torch.cuda.synchronize()
        t = time.perf_counter()
        rc = te.batch_transfer_sync_read(session, [dst.data_ptr() + o for o in offsets],
                                         [remote + o for o in offsets], lens)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if rc != 0:
            print(json.dumps({"error": f"batch_transfer_sync_read rc={rc}"}))
            return
    ok = int(dst.sum(dtype=torch.int64)) == checksum
    best = min(times)
    print(json.dumps({"gib_per_s_best": round(nbytes / best / 2**30, 3),
                      "gib_per_s_median": round(nbytes / sorted(times)[1] / 2**30, 3),
                      "seconds": [round(t, 4) for t in times], "verified": ok}))


def gyre_cuda_pull(nbytes: int, protocol: str, report: Report) -> None:
    """Gyre's own transfer=mooncake path with ``cluster.mooncake.memory=cuda``: this process is the
    core (MooncakeWeightPublisher, slots in page-locked host memory, filled from the GPU), a child
    is a satellite (MooncakeWeightPuller, its receive buffer in GPU memory) that pulls, checks and times."""
    import torch
    import zmq

    from cellrunner.model import FlatWeights
    from cellrunner.transfer_mooncake import MooncakeWeightPublisher
    from base.wire import TensorSpec

    n = nbytes // 4
    data = torch.randn(n, device="cuda")
    checksum = float(data.double().sum())
    pub = MooncakeWeightPublisher(zmq.Context.instance(), "tcp://127.0.0.1:0", host="127.0.0.1", protocol=protocol,
                                  memory="cuda")
    pub.start()
    publish_s = -1.0
    slots: dict[str, Any] = {}
    try:
        t = time.perf_counter()
        pub.publish(FlatWeights(1, (TensorSpec(name="w", shape=[n], offset=0),), data))
        torch.cuda.synchronize()
        publish_s = time.perf_counter() - t
        slots = pub.footprint()
        cmd = [sys.executable, __file__, "--gyre-puller", protocol, pub.addr, str(nbytes), repr(checksum)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30.0, min(120.0, report.left())))
        last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
        res = json.loads(last) if last.startswith("{") else {"error": f"puller exited {out.returncode}: {out.stderr[-500:]}"}
    except subprocess.TimeoutExpired:
        res = {"error": "puller timed out"}
    finally:
        pub.close()
    report.figures.setdefault("gyre_cuda_pull", {})[protocol] = {"bytes": nbytes, "publish_s": round(publish_s, 4), "slots": slots,
                                                                  **res}


def gyre_puller(protocol: str, addr: str, nbytes: int, checksum: float) -> None:
    import torch
    import zmq

    from cellrunner.transfer_mooncake import MooncakeWeightPuller

    puller = MooncakeWeightPuller(zmq.Context.instance(), host="127.0.0.1", protocol=protocol, memory="cuda",
                                  chunk_bytes=CHUNK_BYTES)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        got = puller.pull(addr, 1, timeout_s=60)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    on_gpu = bool(getattr(got.data, "is_cuda", False))
    ok = on_gpu and abs(float(got.data.double().sum()) - checksum) <= 1e-6 * max(1.0, abs(checksum))
    puller.close()
    print(json.dumps({"gib_per_s_best": round(nbytes / min(times) / 2**30, 3),
                      "gib_per_s_median": round(nbytes / sorted(times)[1] / 2**30, 3),
                      "seconds": [round(t, 4) for t in times], "landed_on_gpu": on_gpu, "verified": ok}))


def stack_configs(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The algorithm, SGLang and Megatron configs of the check: the run's own YAML (conf/), on one
    GPU, so a field added there reaches the check too."""
    import yaml

    from cellrunner.config import MegatronConfig
    from cellrunner.engine_sglang import SGLangConfig
    from base.typed_config import build
    from base.algo_config import AlgoConfig

    algo = build(AlgoConfig, {**yaml.safe_load(open(ROOT / "conf/algo/gspo.yaml")),
                              "lr": 1e-6, "max_tokens_per_microstep": 8192, "tree_packing": False})
    # conf/engine/sglang.yaml as a run reads it, on one GPU (its interpolated keys set here).
    sg_cfg = build(SGLangConfig, {**yaml.safe_load(open(ROOT / "conf/engine/sglang.yaml")), **dict(
        python="", tp_size=1, dp_size=1, ep_size=1, nnodes=1, dist_init_port=0,
        mem_fraction_static=args.mem_fraction, dtype="bfloat16", context_length=2048,
        disable_cuda_graph=args.disable_cuda_graph, weight_update="disk", weight_dir=args.work_dir,
        startup_timeout_s=240.0, request_timeout_s=300.0, poll_interval_s=0.05, extra_args=[],
        flush_cache_timeout_s=120.0)})
    # conf/trainer/megatron.yaml as a run reads it (attention, recompute, ...), on one GPU in bf16.
    mg_cfg = build(MegatronConfig, {**yaml.safe_load(open(ROOT / "conf/trainer/megatron.yaml")),
                                    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                    "expert_model_parallel_size": 1, "params_dtype": "bfloat16",
                                    "layer_spec": "local", "offload_when_serving": True, "moe_aux_loss_coeff": 0.0})
    return algo, sg_cfg, mg_cfg


def run(args: argparse.Namespace) -> dict:
    report = Report(args.budget_s)
    figures = report.figures

    def time_up(*_: Any) -> None:
        report.budget_s = 0.0  # every later stage is skipped
        raise TimeUp("terminated by the time limit")

    signal.signal(signal.SIGTERM, time_up)
    figures["versions"] = versions()
    engine = trainer = None
    samples: list[dict] = []
    w = None
    try:
        import torch
        import yaml

        from cellrunner.config import ModelConfig
        from cellrunner.engine_sglang import SGLangEngine
        from cellrunner.make_checkpoint import write_checkpoint
        from cellrunner.megatron_trainer import MegatronTrainer
        from base.typed_config import build

        figures["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        # Version 0 is a checkpoint folder, as on a cluster (model=qwen3_hf model.path=...): a
        # Qwen3-0.6B-shaped random init in bf16 with Qwen3's tokenizer, written here, read by SGLang
        # (its own loader) and by Megatron (the core's), which must then agree on log-probs.
        t = time.perf_counter()
        folder = write_checkpoint(Path(args.work_dir) / f"qwen3-{args.shape}-random", shape=args.shape, dtype="bfloat16")
        figures["checkpoint_write_s"] = round(time.perf_counter() - t, 2)
        model_cfg = build(ModelConfig, {**yaml.safe_load(open(ROOT / "conf/model/qwen3_hf.yaml")), "path": str(folder)})
        algo, sg_cfg, mg_cfg = stack_configs(args)

        if args.no_sglang:
            report.off = {"sglang_start", "load_v0", "serve", "serve_to_train", "train_to_serve", "weight_update"}
            report.skipped.append(", ".join(sorted(report.off)) + ": --no-sglang")
        if args.skip_mooncake:
            report.off.add("publisher_slots")
            report.skipped.append("publisher_slots, mooncake_pull: --skip-mooncake")
        with report.stage("sglang_start", needs_s=120) as go:
            if go:
                t = time.perf_counter()
                engine = SGLangEngine(sg_cfg, model_cfg=model_cfg, vocab_size=VOCAB, host="127.0.0.1", port=0,
                                      cell_id=0, max_running=args.requests, seed=0,
                                      log_dir=os.path.join(args.work_dir, "logs"))
                engine.start()
                figures["sglang_start_s"] = round(time.perf_counter() - t, 2)

        with report.stage("megatron_start", needs_s=60) as go:
            if go:
                t = time.perf_counter()
                trainer = MegatronTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=True, megatron=mg_cfg)
                trainer.start(None)
                figures["megatron_start_s"] = round(time.perf_counter() - t, 2)
                figures["parameters"] = sum(p.numel() for p in trainer.model.module.parameters())
                t = time.perf_counter()
                w = trainer.weights()
                figures["hf_gather_s"] = round(time.perf_counter() - t, 3)
                t = time.perf_counter()
                trainer.stop()  # the core offloads while it serves
                figures["first_offload_s"] = round(time.perf_counter() - t, 3)

        with report.stage("load_v0", needs_s=30, requires=engine is not None and w is not None) as go:
            if go:
                t = time.perf_counter()
                engine.resume(w)
                figures["load_v0_s"] = round(time.perf_counter() - t, 3)
                figures["weights_bytes_bf16"] = w.data.size * 2

        with report.stage("serve", needs_s=30, requires=engine is not None and engine.weight_version == 0) as go:
            if go:
                samples, wall = serve_batch(engine.url, args.requests, args.prompt_len, args.new_tokens, seed=1)
                n_tok = sum(len(s["tokens"]) for s in samples)
                figures["serve"] = {"requests": len(samples), "output_tokens": n_tok, "wall_s": round(wall, 3),
                                    "output_tokens_per_s": round(n_tok / wall, 1),
                                    "logprobs_complete": all(len(s["logprobs"]) == args.new_tokens for s in samples),
                                    "weight_versions": sorted({str(s["version"]) for s in samples})}

        with report.stage("serve_to_train", needs_s=30, requires=engine is not None and trainer is not None) as go:
            if go:
                phases: dict[str, float] = {}
                t = time.perf_counter()
                figures["drain_aborted"] = engine.drain(5.0)
                phases["drain"] = time.perf_counter() - t
                t1 = time.perf_counter()
                engine.release()
                phases["release"] = time.perf_counter() - t1
                t2 = time.perf_counter()
                trainer.start(None)
                phases["start_trainer"] = time.perf_counter() - t2
                figures["serve_to_train"] = {"total_s": round(time.perf_counter() - t, 3),
                                             **{k: round(v, 3) for k, v in phases.items()}}

        if args.no_sglang:
            with report.stage("trainer_samples", needs_s=30, requires=trainer is not None) as go:
                if go:
                    trainer.start(None)
                    samples = trainer_samples(trainer, args.requests, args.prompt_len, args.new_tokens, seed=1)

        with report.stage("gspo_step", needs_s=30, requires=trainer is not None and bool(samples)) as go:
            if go:
                key = "logprob_recompute_megatron" if args.no_sglang else "logprob_mismatch_served_vs_megatron"
                figures[key] = logprob_mismatch(trainer, samples, k=8)
                shard = shard_from(samples, step=0)
                torch.cuda.synchronize()
                t = time.perf_counter()
                res = trainer.microstep(shard)
                torch.cuda.synchronize()
                fb = time.perf_counter() - t
                t = time.perf_counter()
                w, norm = trainer.apply([], num_executions=shard.num_executions)
                apply_s = time.perf_counter() - t
                figures["gspo_step"] = {"tokens": sum(len(s.tokens) for s in shard.sequences),
                                        "target_tokens": res.num_tokens, "loss": res.loss, "mean_ratio": res.mean_ratio,
                                        "clip_fraction": res.clip_fraction, "grad_norm": norm,
                                        "fwd_bwd_s": round(fb, 3), "apply_and_gather_s": round(apply_s, 3),
                                        "version": w.version,
                                        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}

        with report.stage("offload_roundtrip", needs_s=30,
                          requires=trainer is not None and bool(samples) and w is not None and w.version == 1) as go:
            if go:
                figures["offload_roundtrip"] = offload_roundtrip(trainer, shard_from(samples, step=1))

        trained = trainer is not None and bool(samples) and w is not None and w.version == 1
        with report.stage("trainer_cycle", needs_s=45, requires=trained) as go:
            if go:
                ckpt_dir = Path(args.work_dir) / "checkpoints"
                figures["trainer_cycle"] = trainer_cycle(trainer, shard_from(samples, step=1), str(ckpt_dir),
                                                         cluster_limits())
                shutil.rmtree(ckpt_dir, ignore_errors=True)  # 14 bytes a parameter in /dev/shm

        with report.stage("publisher_slots", needs_s=30, requires=trained) as go:
            if go:
                # The core's whole-model publisher of a single-rank cell serving in bf16: both dtypes,
                # the most it keeps (a multi-rank core keeps bf16 only).
                figures["publisher_slots"] = publisher_slots_during_step(
                    trainer, w, shard_from(samples, step=1), memory="cuda", protocol="tcp",
                    dtypes=("float32", "bfloat16"))

        with report.stage("long_context", needs_s=60, requires=trained) as go:
            if go:
                figures["long_context"] = long_context(trainer, [int(x) for x in args.long_context.split(",")])

        ready = engine is not None and trainer is not None and w is not None and w.version == 1
        with report.stage("train_to_serve", needs_s=30, requires=ready) as go:
            if go:
                phases = {}
                t = time.perf_counter()
                trainer.stop()
                phases["stop_trainer"] = time.perf_counter() - t
                t1 = time.perf_counter()
                engine.resume(w)
                phases["resume_engine"] = time.perf_counter() - t1
                figures["train_to_serve"] = {"total_s": round(time.perf_counter() - t, 3),
                                             **{k: round(v, 3) for k, v in phases.items()}}
                reply = post_generate(engine.url, [1000, 2000, 3000], 4)
                figures["served_version_after_switch"] = reply["meta_info"].get("weight_version")

        ready = engine is not None and w is not None and engine.weight_version is not None
        with report.stage("weight_update", needs_s=20, requires=ready) as go:
            if go:
                from cellrunner.model import FlatWeights

                w2 = FlatWeights(w.version + 1, w.specs, w.data)
                t = time.perf_counter()
                engine.update_weights(w2)
                dt = time.perf_counter() - t
                figures["weight_update"] = {"method": "update_weights_from_disk (/dev/shm, bf16)", "s": round(dt, 3),
                                            "gib_per_s": round(w.data.size * 2 / dt / 2**30, 2)}

        with report.stage("mooncake_pull", needs_s=20, requires=True) if not args.skip_mooncake \
                else contextlib.nullcontext(False) as go:
            if go:
                if engine is not None:  # give the GPU memory back before the big buffers
                    engine.stop()
                    engine = None
                mooncake_pull(args.mooncake_mib << 20, args.mooncake_protocols.split(","), report)
                for protocol in args.mooncake_protocols.split(","):
                    try:
                        gyre_cuda_pull(args.mooncake_mib << 20, protocol, report)
                    except Exception as exc:  # noqa: BLE001 - reported, the other protocol still runs
                        report.figures.setdefault("gyre_cuda_pull", {})[protocol] = {"error": f"{type(exc).__name__}: {exc}"}
    except TimeUp as exc:  # raised between stages
        report.errors["time_limit"] = str(exc)
    finally:
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.stop()
    figures["wall_s"] = round(time.monotonic() - report.t0, 1)
    return {"ok": not report.errors and not report.skipped, "errors": report.errors, "skipped": report.skipped,
            **figures}


def main() -> None:
    if len(sys.argv) == 7 and sys.argv[1] == "--mooncake-reader":
        _, _, protocol, session, remote, nbytes, checksum = sys.argv
        mooncake_reader(protocol, session, int(remote), int(nbytes), int(checksum))
        return
    if len(sys.argv) == 6 and sys.argv[1] == "--gyre-puller":
        _, _, protocol, addr, nbytes, checksum = sys.argv
        gyre_puller(protocol, addr, int(nbytes), float(checksum))
        return
    result = run(parser().parse_args())
    sys.stdout.flush()
    print(json.dumps(result, default=str), flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=450.0, help="stages that would not fit are skipped")
    ap.add_argument("--work-dir", default="/dev/shm/gyre-gpu-check")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--mem-fraction", type=float, default=0.45)
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--mooncake-mib", type=int, default=1024)
    ap.add_argument("--mooncake-protocols", default="tcp,rdma", help="tried in order; each reported")
    ap.add_argument("--long-context", default="4096,8192,16384,32768",
                    help="one-trajectory step lengths, tried in order until the first out-of-memory")
    ap.add_argument("--skip-mooncake", action="store_true")
    ap.add_argument("--shape", default="0.6b", help="cellrunner.make_checkpoint's shape (tiny: a CPU smoke run)")
    ap.add_argument("--no-sglang", action="store_true",
                    help="no SGLang on this machine: the Megatron stages on samples the trainer scores itself")
    return ap


if __name__ == "__main__":
    main()
