"""Weights and gradients between cells over ZeroMQ: raw buffers behind a wire header.

Weights go out in the dtype the core exported them in (``backends.core_export_dtype``: float32, or
bf16 where nobody needs more) or, asked for ``bfloat16``, as the serving copy an engine that
serves in bf16 loads: half the bytes, made once per version on the core. A bf16 export is never
widened: a float32 ask of one is refused, as no float32 copy of the model exists to send.

The core serves its current weights to any cell that asks (satellites joining a step, serving
cells loading a new version); satellites push gradient sums to the core. Frames are
``[header, raw bytes]``: the header is a validated wire message, the raw part is checked against
it, and nothing is unpickled. The Mooncake Transfer Engine path (``transfer=mooncake``,
``cellrunner.transfer_mooncake``) sits behind the same two small interfaces below: a
``WeightPublisher`` on the core and a ``WeightPuller`` on every other cell.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

import numpy as np
import zmq

from cellrunner.model import FlatWeights, to_bf16
from base import curve
from base.wire import (
    WEIGHT_ITEMSIZE, WEIGHT_NUMPY_DTYPE, ErrorReply, GradsHeader, ProtocolError, PullWeights, WeightsDtype, WeightsHeader, decode, encode,
)

log = logging.getLogger(__name__)


class WeightPublisher(Protocol):
    """The core's side: makes the newest weight version pullable at ``addr``."""

    addr: str

    def publish(self, weights: FlatWeights) -> None:
        """Make ``weights`` the version pullers get; called from one thread only."""

    def start(self) -> None: ...

    def close(self) -> None: ...


class WeightPuller(Protocol):
    """A satellite's side: fetches a weight version >= ``min_version`` from a publisher's ``addr``."""

    def pull(self, addr: str, min_version: int, timeout_s: float, dtype: WeightsDtype = "float32") -> FlatWeights:
        """Raise ``TransferError`` on timeout, a refusal or a malformed reply. The returned
        ``data`` may be the puller's reused receive buffer: load it before the next ``pull``."""

    def close(self) -> None: ...


class WeightServer:
    """Answers PullWeights with the newest FlatWeights, on its own thread."""

    def __init__(self, ctx: zmq.Context, bind_addr: str):
        self._ctx = ctx
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        curve.server(self._sock)
        self._sock.bind(bind_addr)
        self.addr = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._weights: FlatWeights | None = None
        self._serving: FlatWeights | None = None  # the bf16 copy of _weights, made on the first ask
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="weight-server", daemon=True)

    def publish(self, weights: FlatWeights) -> None:
        with self._lock:
            self._weights, self._serving = weights, None

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, frame = self._sock.recv_multipart()[:2]
            try:
                req = decode(frame, expect=(PullWeights,))
            except ProtocolError as exc:
                log.warning("weight server: rejected request: %s", exc)
                self._sock.send_multipart([ident, encode(ErrorReply(where="pull_weights", message=str(exc)))])
                continue
            with self._lock:
                w = self._weights
            if w is None or w.version < req.min_version:
                have = -1 if w is None else w.version
                msg = f"have version {have}, asked for >= {req.min_version}"
                self._sock.send_multipart([ident, encode(ErrorReply(where="pull_weights", message=msg))])
                continue
            if req.dtype != w.dtype:
                if req.dtype == "float32":
                    msg = f"the core publishes {w.dtype} weights; asked for {req.dtype}"
                    self._sock.send_multipart([ident, encode(ErrorReply(where="pull_weights", message=msg))])
                    continue
                w = self._serving_copy(w)
            header = WeightsHeader(weight_version=w.version, num_elements=int(w.data.size), tensors=list(w.specs),
                                   dtype=w.dtype)
            self._sock.send_multipart([ident, encode(header), memoryview(w.data)], copy=False)
        self._sock.close(0)

    def _serving_copy(self, w: FlatWeights) -> FlatWeights:
        """The bf16 copy of ``w``, made once per version (every serving cell asks for the same)."""
        with self._lock:
            cached = self._serving
        if cached is not None and cached.version == w.version:
            return cached
        copy = to_bf16(w)
        with self._lock:
            if self._weights is w:
                self._serving = copy
        return copy


class TransferError(RuntimeError):
    pass


def pull_weights(ctx: zmq.Context, addr: str, min_version: int, timeout_s: float,
                 dtype: WeightsDtype = "float32") -> FlatWeights:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        curve.client(sock, "core")  # weights are served by the core only
        sock.connect(addr)
        sock.send(encode(PullWeights(min_version=min_version, dtype=dtype)))
        if not sock.poll(int(timeout_s * 1000)):
            raise TransferError(f"no weights from {addr} within {timeout_s}s")
        parts = sock.recv_multipart(copy=False)
    finally:
        sock.close(0)
    try:
        header = decode(parts[0].bytes, expect=(WeightsHeader, ErrorReply))
    except ProtocolError as exc:
        raise TransferError(f"bad weights header from {addr}: {exc}") from None
    if isinstance(header, ErrorReply):
        raise TransferError(f"weight server {addr}: {header.message}")
    if header.dtype != dtype:
        raise TransferError(f"weights from {addr}: {header.dtype}, asked for {dtype}")
    if len(parts) != 2 or len(parts[1].buffer) != header.num_elements * WEIGHT_ITEMSIZE[dtype]:
        raise TransferError(f"weights from {addr}: payload does not match header ({header.num_elements} x {dtype})")
    data = np.frombuffer(parts[1].buffer, dtype=WEIGHT_NUMPY_DTYPE[dtype]).copy()
    return FlatWeights(header.weight_version, tuple(header.tensors), data)


class ZmqWeightPuller:
    """``pull_weights`` behind the ``WeightPuller`` interface; every pull gets a fresh array."""

    def __init__(self, ctx: zmq.Context):
        self._ctx = ctx

    def pull(self, addr: str, min_version: int, timeout_s: float, dtype: WeightsDtype = "float32") -> FlatWeights:
        return pull_weights(self._ctx, addr, min_version, timeout_s, dtype)

    def close(self) -> None:
        pass


def send_grads(sock: zmq.Socket, *, cell_id: int, step: int, grads: np.ndarray, rank: int = 0) -> None:
    header = GradsHeader(cell_id=cell_id, step=step, rank=rank, num_elements=int(grads.size))
    sock.send_multipart([encode(header), memoryview(np.ascontiguousarray(grads, dtype="<f4"))], copy=False)


def recv_grads(parts: list[bytes]) -> tuple[GradsHeader, np.ndarray]:
    """Validate one gradient frame from a core rank's PULL socket; ProtocolError if malformed."""
    if len(parts) != 2:
        raise ProtocolError("grads: want [header, payload]")
    header = decode(parts[0], expect=(GradsHeader,))
    if len(parts[1]) != header.num_elements * 4:
        raise ProtocolError(f"grads: payload is {len(parts[1])} bytes, header says {header.num_elements} floats")
    return header, np.frombuffer(parts[1], dtype="<f4").copy()
