"""A satellite's pull of the full weights: Mooncake Transfer Engine vs ZeroMQ, same processes, same bytes.

    .venv/bin/python -m bench.transfer [--quick] [--repeats 7] [--chunk-mib 4,32,128]

Two processes on this machine, loopback TCP for both paths. A child process plays the core: it
builds the model, flattens its weights (``cellrunner.model.flatten_params``) and publishes the
same FlatWeights twice, on the ``WeightServer`` (ZeroMQ) and on a ``MooncakeWeightPublisher``.
This process is the satellite and pulls, interleaving the methods in every repeat so that load
from other jobs on the shared cores hits them alike:

- ``zmq``: ``ZmqWeightPuller`` = today's ``pull_weights`` (one DEALER request, the bytes in one
  frame, copied into a fresh array), i.e. what ``transfer=zmq`` does in a cell;
- ``zmq_nocopy``: the same request, the frame's bytes used in place (nothing after the transfer);
- ``zmq_curve``: ``zmq`` with CURVE on, as every run has it by default (base.curve): the core's
  server holds cell 0's key and admits the run's members through ZAP, the satellite holds cell 1's,
  a new connection (handshake included) per pull as in a cell; ``curve_cost`` in the JSON is its
  median over ``zmq``'s;
- ``zmq_stream@<chunk>``: a plain ZeroMQ transfer done well: the core sends the buffer as one
  message per chunk (zero-copy from its array), the satellite ``recv_into``s each chunk at its
  offset in one preallocated, reused array: no allocation, no copy after the socket;
- ``mooncake@<chunk>``: ``MooncakeWeightPuller`` with that read size: offer over ZeroMQ, every
  chunk submitted as an asynchronous read at once, completion polled with 1 ms naps, the slot
  check; its registered receive buffer is reused by every pull (what ``transfer=mooncake`` does
  in a cell);
- ``mooncake_sync@<default chunk>``: the same chunks through Mooncake's own
  ``batch_transfer_sync_read``, which spins on the status while it waits (kept to show why the
  puller polls instead);
- ``zmq_bf16``, ``mooncake_bf16``: a serving cell's pull of the version's bf16 copy (what an
  engine serving in bf16 loads; the core makes it once per version), half the bytes. ``update`` in
  the JSON is what one new version costs a serving cell in bytes and seconds, float32 against bf16.

Every method's bytes are compared with the published ones once, outside the timing. One warm-up
pull per method is not timed (TCP connections, Mooncake's handshake, first-touch page faults).
Rates are bytes / median seconds in GiB/s (2**30). The last line is JSON: ``gb_per_s``
(Mooncake at the default chunk, what cells use), ``zmq_gb_per_s`` (the *fastest* ZeroMQ method,
so the ratio is not flattered by a weak baseline), ``fraction_of_zmq`` (their ratio),
``fraction_of_pull_weights`` (against the ``zmq`` method cells use today), ``bytes``, every
method's median and repeats.

The full model is Qwen3-architecture with the full Qwen vocabulary (151,669 rows), hidden 512,
6 layers: 101 M float32 parameters, 405 MB; ``--shape 0.6b`` is Qwen3-0.6B's sizes (596 M, 2.4 GB).
``--quick`` pulls the tiny default model (1.6 MB),
twice per method; it is the smoke test, its rates mean nothing.

Left out: RDMA (none here), the core's copy into its registered slot at publish time (once per
weight version, not per pull), loading the pulled weights into a model (the same for both).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import yaml
import zmq

from bench.fixtures import CONF, median, run_info
from cellrunner.config import ModelConfig
from cellrunner.make_checkpoint import SHAPES
from cellrunner.model import FlatWeights, build_model, flatten_params, to_bf16
from cellrunner.transfer import TransferError, WeightServer, ZmqWeightPuller
from cellrunner.transfer_mooncake import (
    DEFAULT_CHUNK_BYTES, MooncakeWeightPublisher, MooncakeWeightPuller, RegisteredBuffer,
)
from base import curve
from base.typed_config import build
from base.wire import WEIGHT_ITEMSIZE, ErrorReply, PullWeights, WeightsHeader, WeightsOffer, decode, encode
from base.tokenizer import get_tokenizer

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent
# A model whose weights are a few hundred MB, so a pull takes long enough to time (~0.3 s).
FULL_MODEL = {
    "name": "bench-transfer-qwen3", "tokenizer": "qwen", "hidden_size": 512, "intermediate_size": 2048,
    "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
}
TIMEOUT_S = 120.0
SHAPE_0_6B = {"name": "bench-transfer-qwen3-0.6b", "tokenizer": "qwen",
              **{k: v for k, v in SHAPES["0.6b"].items() if k != "tie_word_embeddings"}}
"""``--shape 0.6b``: Qwen3-0.6B's sizes (596 M parameters with the 151,669-row vocabulary, tied)."""


def model_config(quick: bool, shape: str = "bench") -> ModelConfig:
    tiny = yaml.safe_load((CONF / "model" / "tiny.yaml").read_text())
    if quick:
        return build(ModelConfig, tiny)
    return build(ModelConfig, {**tiny, **(SHAPE_0_6B if shape == "0.6b" else FULL_MODEL)})


def model_weights(cfg: ModelConfig) -> FlatWeights:
    vocab_size = get_tokenizer(cfg.tokenizer, cfg.compact_ranks).vocab_size
    return flatten_params(build_model(cfg, vocab_size), 1)


# ---------------------------------------------------------------- the core (child process)


def parse_stream_request(frame: bytes) -> int:
    """``{"chunk_bytes": n}`` as MessagePack -> n; ValueError on anything else."""
    try:
        req = msgpack.unpackb(frame, raw=False)
    except Exception as exc:
        raise ValueError(f"stream request: not MessagePack ({exc})") from None
    if not (isinstance(req, dict) and set(req) == {"chunk_bytes"} and type(req["chunk_bytes"]) is int
            and 4096 <= req["chunk_bytes"] <= 1 << 30):
        raise ValueError(f"stream request: want {{'chunk_bytes': 4096..2**30}}, got {req!r}")
    return req["chunk_bytes"]


def stream_server(sock: zmq.Socket, data: np.ndarray, stop: threading.Event) -> None:
    """Answer each request with the buffer as consecutive messages of the asked size."""
    view = memoryview(data).cast("B")
    while not stop.is_set():
        if not sock.poll(100):
            continue
        ident, frame = sock.recv_multipart()
        try:
            chunk = parse_stream_request(frame)
        except ValueError as exc:
            print(f"bench.transfer core: {exc}", file=sys.stderr, flush=True)
            continue
        for start in range(0, len(view), chunk):
            sock.send_multipart([ident, view[start : start + chunk]], copy=False)
    sock.close(0)


def serve_core(quick: bool, keys_dir: str, shape: str) -> None:
    """Publish one weight version on every path, print where, serve until stdin closes."""
    weights = model_weights(model_config(quick, shape))
    ctx = zmq.Context.instance()
    zmq_server = WeightServer(ctx, f"tcp://{HOST}:0")
    # serve_bf16: the core's publisher when the run's engines serve in bf16 (SGLang): both copies
    mooncake = MooncakeWeightPublisher(ctx, f"tcp://{HOST}:0", host=HOST, serve_bf16=True)
    curve.install(keys_dir, "cell-0", core="cell-0")  # only the next server is CURVE's
    curve_server = WeightServer(ctx, f"tcp://{HOST}:0")
    curve.install(None, "")
    for publisher in (zmq_server, mooncake, curve_server):
        publisher.publish(weights)
        publisher.start()
    stream = ctx.socket(zmq.ROUTER)
    stream.setsockopt(zmq.LINGER, 0)
    stream.bind(f"tcp://{HOST}:0")
    stop = threading.Event()
    streamer = threading.Thread(target=stream_server, args=(stream, weights.data, stop), daemon=True)
    streamer.start()
    print(json.dumps({"zmq": zmq_server.addr, "mooncake": mooncake.addr, "zmq_curve": curve_server.addr,
                      "zmq_stream": stream.getsockopt_string(zmq.LAST_ENDPOINT), "bytes": weights.nbytes,
                      "num_params": int(weights.data.size), "num_tensors": len(weights.specs)}), flush=True)
    sys.stdin.read()
    stop.set()
    streamer.join(timeout=5)
    zmq_server.close()
    curve_server.close()
    mooncake.close()
    curve.stop()


class CoreProcess:
    def __init__(self, quick: bool, log_path: Path, keys_dir: Path, shape: str = "bench"):
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.transfer", "--serve-core", "--curve-keys", str(keys_dir), "--shape", shape]
            + (["--quick"] if quick else []),
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=10)
            raise RuntimeError(f"core process exited ({self.proc.returncode}):\n{log_path.read_text()[-3000:]}")
        self.ready = json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


# ---------------------------------------------------------------- the satellite (this process)


def pull_zmq_nocopy(ctx: zmq.Context, addr: str) -> np.ndarray:
    """The ZeroMQ exchange of ``pull_weights`` without the copy into a fresh array."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        sock.send(encode(PullWeights(min_version=0)))
        if not sock.poll(int(TIMEOUT_S * 1000)):
            raise TransferError(f"no weights from {addr}")
        header_frame, payload = sock.recv_multipart(copy=False)
    finally:
        sock.close(0)
    header = decode(header_frame.bytes, expect=(WeightsHeader, ErrorReply))
    if isinstance(header, ErrorReply) or len(payload.buffer) != header.num_elements * 4:
        raise TransferError(f"bad weights from {addr}: {header}")
    return np.frombuffer(payload.buffer, dtype="<f4")


class StreamPuller:
    """The satellite's end of ``zmq_stream``: chunks land in place in one reused array."""

    def __init__(self, ctx: zmq.Context, addr: str, nbytes: int):
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(addr)
        self.data = np.zeros(nbytes // 4, dtype="<f4")
        self._view = memoryview(self.data).cast("B")

    def pull(self, chunk: int) -> np.ndarray:
        self._sock.send(msgpack.packb({"chunk_bytes": chunk}))
        for start in range(0, len(self._view), chunk):
            if not self._sock.poll(int(TIMEOUT_S * 1000)):
                raise TransferError("zmq_stream: core went quiet")
            want = min(chunk, len(self._view) - start)
            got = self._sock.recv_into(self._view[start : start + want])
            if got != want:
                raise TransferError(f"zmq_stream: a chunk of {got} bytes, want {want}")
        return self.data

    def close(self) -> None:
        self._sock.close(0)


def with_curve(keys_dir: Path, pull: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
    """``pull`` as cell 1 of a CURVE run (the satellite's sockets authenticate while it runs)."""
    def pulled() -> np.ndarray:
        curve.install(keys_dir, "cell-1", core="cell-0")
        try:
            return pull()
        finally:
            curve.install(None, "")
    return pulled


def methods(
    ctx: zmq.Context, ready: dict, chunks: list[int], zmq_chunks: list[int], keys_dir: Path,
) -> tuple[dict[str, Callable[[], np.ndarray]], list]:
    zmq_puller = ZmqWeightPuller(ctx)
    mooncake = SpinOrPollPuller(ctx, host=HOST)
    stream = StreamPuller(ctx, ready["zmq_stream"], int(ready["bytes"]))
    table: dict[str, Callable[[], np.ndarray]] = {
        "zmq": lambda: zmq_puller.pull(ready["zmq"], 0, TIMEOUT_S).data,
        "zmq_bf16": lambda: zmq_puller.pull(ready["zmq"], 0, TIMEOUT_S, "bfloat16").data,
        "zmq_nocopy": lambda: pull_zmq_nocopy(ctx, ready["zmq"]),
        "zmq_curve": with_curve(keys_dir, lambda: zmq_puller.pull(ready["zmq_curve"], 0, TIMEOUT_S).data),
    }
    for chunk in zmq_chunks:
        table[f"zmq_stream@{chunk_name(chunk)}"] = lambda chunk=chunk: stream.pull(chunk)

    def mooncake_at(chunk: int, spin: bool) -> Callable[[], np.ndarray]:
        def pull() -> np.ndarray:
            mooncake.chunk_bytes, mooncake.spin = chunk, spin
            return mooncake.pull(ready["mooncake"], 0, TIMEOUT_S).data
        return pull

    for chunk in chunks:
        table[f"mooncake@{chunk_name(chunk)}"] = mooncake_at(chunk, spin=False)
    table[f"mooncake_sync@{chunk_name(DEFAULT_CHUNK_BYTES)}"] = mooncake_at(DEFAULT_CHUNK_BYTES, spin=True)
    # A serving cell's pull of the bf16 copy, on a plain puller at the default read size.
    bf16 = MooncakeWeightPuller(ctx, host=HOST)
    table["mooncake_bf16"] = lambda: bf16.pull(ready["mooncake"], 0, TIMEOUT_S, "bfloat16").data
    return table, [zmq_puller, mooncake, stream, bf16]


class SpinOrPollPuller(MooncakeWeightPuller):
    """The cells' puller, or (``spin``) the same reads through Mooncake's spinning sync call."""

    spin = False

    def _read(self, offer: WeightsOffer, buffer: RegisteredBuffer, deadline: float) -> None:
        if not self.spin:
            return super()._read(offer, buffer, deadline)
        nbytes = offer.num_elements * WEIGHT_ITEMSIZE[offer.dtype]
        starts = range(0, nbytes, self.chunk_bytes)
        rc = self._engine.batch_transfer_sync_read(
            offer.session_id, [buffer.addr + s for s in starts], [offer.remote_addr + s for s in starts],
            [min(self.chunk_bytes, nbytes - s) for s in starts],
        )
        if rc != 0:
            raise TransferError(f"mooncake sync read failed (rc {rc})")


def chunk_name(chunk: int) -> str:
    return f"{chunk >> 20}MiB" if chunk >= 1 << 20 else f"{chunk >> 10}KiB"


def measure(table: dict[str, Callable[[], np.ndarray]], expected: bytes, expected_bf16: bytes,
            repeats: int) -> dict[str, list[float]]:
    names = list(table)
    for name in names:  # warm-up and the byte check, untimed
        if table[name]().tobytes() != (expected_bf16 if "bf16" in name else expected):
            raise SystemExit(f"bench.transfer: {name} pulled bytes that differ from the published weights")
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate who goes first
            t0 = time.perf_counter()
            table[name]()
            times[name].append(time.perf_counter() - t0)
        print(f"repeat {r}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in names), file=sys.stderr, flush=True)
    return times


def method_bytes(name: str, nbytes: int) -> int:
    """What a method moves: the float32 weights, or half as much for a bf16 copy."""
    return nbytes // 2 if "bf16" in name else nbytes


def print_table(nbytes: int, med: dict[str, float], zmq_name: str) -> None:
    print(f"\nweights: {nbytes / 1e6:.1f} MB float32 (bf16 copies half); GiB/s = bytes moved / median s / 2**30",
          flush=True)
    print(f"{'method':<20} {'median s':>9} {'GiB/s':>7} {'time vs ' + zmq_name:>22}")
    for name, s in med.items():
        print(f"{name:<20} {s:>9.4f} {method_bytes(name, nbytes) / s / 2**30:>7.2f} {med[zmq_name] / s:>22.2f}")


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model, 2 repeats (smoke test)")
    ap.add_argument("--shape", choices=["bench", "0.6b"], default="bench",
                    help="bench: hidden 512, 6 layers (405 MB); 0.6b: Qwen3-0.6B's sizes (2.4 GB float32)")
    ap.add_argument("--repeats", type=int, default=None, help="default 7 (2 with --quick)")
    ap.add_argument("--chunk-mib", default="4,64", help="Mooncake read sizes to try, MiB, comma-separated")
    ap.add_argument("--zmq-chunk-mib", default="1,8", help="zmq_stream message sizes to try, MiB, comma-separated")
    ap.add_argument("--serve-core", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--curve-keys", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # Mooncake's INFO lines would bury the table
    if args.serve_core:
        serve_core(args.quick, args.curve_keys, args.shape)
        return {}
    repeats = args.repeats or (2 if args.quick else 7)
    chunks = sorted({int(float(c) * 2**20) for c in args.chunk_mib.split(",")} | {DEFAULT_CHUNK_BYTES})
    zmq_chunks = sorted({int(float(c) * 2**20) for c in args.zmq_chunk_mib.split(",")})
    published = model_weights(model_config(args.quick, args.shape))  # same seed: the core's bytes
    expected, expected_bf16 = published.data.tobytes(), to_bf16(published).data.tobytes()
    del published
    ctx = zmq.Context.instance()
    with tempfile.TemporaryDirectory() as tmp:
        keys_dir = Path(tmp) / "keys"
        curve.create_keys(keys_dir, ["cell-0", "cell-1"])
        core = CoreProcess(args.quick, Path(tmp) / "core.log", keys_dir, args.shape)
        try:
            table, pullers = methods(ctx, core.ready, chunks, zmq_chunks, keys_dir)
            times = measure(table, expected, expected_bf16, repeats)
            for p in pullers:
                p.close()
        finally:
            core.close()
    nbytes = int(core.ready["bytes"])
    med = {n: median(t) for n, t in times.items()}
    rate = {n: method_bytes(n, nbytes) / s / 2**30 for n, s in med.items()}
    best_zmq = max((n for n in rate if n.startswith("zmq") and n not in ("zmq_curve", "zmq_bf16")), key=rate.__getitem__)
    print_table(nbytes, med, best_zmq)
    default = f"mooncake@{chunk_name(DEFAULT_CHUNK_BYTES)}"
    # What one new version costs a serving cell: the float32 a trainer starts from, or the bf16 copy.
    update = {"float32": {"bytes": nbytes, "zmq_s": med["zmq"], "mooncake_s": med[default]},
              "bfloat16": {"bytes": len(expected_bf16), "zmq_s": med["zmq_bf16"], "mooncake_s": med["mooncake_bf16"]}}
    result: dict[str, object] = {
        "update": update,
        "bf16_time_fraction": med["mooncake_bf16"] / med[default],
        "gb_per_s": rate[default],
        "fraction_of_zmq": rate[default] / rate[best_zmq],
        "zmq_gb_per_s": rate[best_zmq],
        "zmq_method": best_zmq,
        "fraction_of_pull_weights": rate[default] / rate["zmq"],
        "curve_cost": med["zmq_curve"] / med["zmq"],
        "bytes": nbytes,
        "unit": "GiB/s",
        "gib_per_s": rate,
        "median_s": med,
        "times_s": times,
        "config": {"quick": args.quick, "shape": args.shape, "repeats": repeats, "chunk_bytes": chunks,
                   "default_chunk_bytes": DEFAULT_CHUNK_BYTES, "zmq_chunk_bytes": zmq_chunks,
                   "num_params": core.ready["num_params"], "num_tensors": core.ready["num_tensors"],
                   "model": dataclasses.asdict(model_config(args.quick, args.shape)), "transport": "tcp over loopback, P2PHANDSHAKE",
                   "mc_env": {k: v for k, v in os.environ.items() if k.startswith("MC_")}},
        **run_info(),
    }
    result["versions"]["mooncake-transfer-engine"] = mooncake_version()
    print(json.dumps(result, sort_keys=True), flush=True)
    return result


def mooncake_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "unknown"


if __name__ == "__main__":
    main()
