"""Weights core -> satellites through the Mooncake Transfer Engine (``transfer=mooncake``).

The core registers its weight buffers with Mooncake once and copies each new version into them;
a satellite registers one receive buffer once and reads the core's memory into it (TCP here,
RDMA on clusters). Only a small control exchange goes over ZeroMQ (a ROUTER on the core, a
DEALER per pull), as validated MessagePack frames:

    puller -> PullWeights{min_version}
    core   -> WeightsOffer{version, manifest, Mooncake session id, address, slot, generation}
    puller    reads the bytes with Mooncake (batched chunks)
    puller -> CheckSlot{slot, generation}
    core   -> SlotChecked{unchanged}

Torn reads: the core keeps two slots and writes a new version into the one not offered last,
bumping that slot's generation *before* it writes. A read is kept only if its slot's generation
is unchanged and no write is running when the read has finished; otherwise the puller asks
again (a seqlock whose check runs over the control socket). The satellite never trusts bytes a
write could have touched, and the core never waits for a slow reader.

Mooncake runs in P2PHANDSHAKE mode: no metadata server; a peer is named ``host:rpc_port``.
The API calls used are the ones verified on this stack (``shared/notes/cpu-stack.md`` §5).

Memory. The core's slots are host memory, page-locked (``cudaHostRegister``) where the process
sees a CUDA device, plain pages otherwise: never GPU memory. Two slots of the whole model in GPU 0
cost the core 12 bytes a parameter (two float32 and two bf16) beside its training state; the
trainer hands over host weights anyway (the HF export is assembled on the host), and the NIC reads
page-locked host memory as directly as GPU memory. The core keeps a dtype's slots only where some
puller asks for it: bf16 for engines serving in bf16, float32 for trainers that start from the
whole model (single-rank cells; multi-rank satellites pull each rank's own shard instead).
``cluster.mooncake.memory`` is where a *puller* receives: ``cpu`` a numpy buffer, ``cuda`` a torch
tensor on the process's current CUDA device (the CUDA build of Mooncake finds the device from the
address, and with ``protocol=rdma`` the NIC writes into GPU memory by GPUDirect RDMA). A pull then
returns FlatWeights whose ``data`` is that CUDA tensor; ``FlatWeights.tensor()`` reads either.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import zmq

from cellrunner.errors import BackendUnavailable
from cellrunner.model import FlatWeights, to_bf16
from cellrunner.transfer import TransferError
from base import curve
from base.wire import (
    WEIGHT_ITEMSIZE, WEIGHT_NUMPY_DTYPE, CheckSlot, ErrorReply, Message, ProtocolError, PullWeights, SlotChecked, TensorSpec,
    WeightsDtype, WeightsOffer, decode, encode,
)

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "transfer=mooncake needs the Mooncake Transfer Engine: on CPU hosts "
    "`pip install mooncake-transfer-engine-non-cuda==0.3.13.post1` plus "
    "`apt-get install -y libibverbs1 ibverbs-providers`; on CUDA 13 hosts `make gpu-env` "
    "(mooncake-transfer-engine-cuda13, scripts/gpu_requirements.py)"
)
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024
"""One pull is cut into reads of this size, all submitted at once (``python -m bench.transfer``
compares sizes; 4-64 MiB measured alike on loopback)."""
POLL_INTERVAL_S = 0.001
"""Sleep between completion checks. Mooncake's own sync calls spin on the status without a
pause, taking a whole core from its I/O threads: on 2 cores that cost ~40% of the throughput."""
MAX_TORN_RETRIES = 8
"""Reads thrown away because the core rewrote the slot meanwhile, before a pull gives up. The
core publishes once a step, so more than one retry in a row means the core is stuck writing."""
MAX_CONTROL_BYTES = 16 * 1024 * 1024
MooncakeProtocol = Literal["tcp", "rdma"]
MooncakeMemory = Literal["cpu", "cuda"]


class MooncakeUnavailable(BackendUnavailable):
    """``transfer=mooncake`` was chosen but the ``mooncake`` package cannot be imported."""


# ---------------------------------------------------------------- control messages


def decode_control(frame: bytes, *, expect: tuple[type[Message], ...]) -> Message:
    """Decode one control frame (``base.wire``) into one of ``expect``; ProtocolError otherwise."""
    if len(frame) > MAX_CONTROL_BYTES:
        raise ProtocolError(f"frame: {len(frame)} bytes is over the {MAX_CONTROL_BYTES} limit")
    return decode(frame, expect=expect)


# ---------------------------------------------------------------- the engine and its buffers


def transfer_engine_class() -> Any:
    """``mooncake.engine.TransferEngine``, or MooncakeUnavailable saying what to install."""
    with contextlib.suppress(ImportError):
        # torch first: it loads its CUDA runtime (libcudart.so.13), which the CUDA build's engine.so
        # links and would not find on the loader's path alone.
        import torch  # noqa: F401
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # also a missing libibverbs.so.1, which surfaces as ImportError
        raise MooncakeUnavailable(f"{INSTALL_HINT} (import failed: {exc})") from None
    return TransferEngine


def start_engine(host: str, protocol: MooncakeProtocol, device_name: str = "") -> tuple[Any, str]:
    """A P2P-handshake engine listening on ``host``; returns it and its session id.

    ``device_name``: the RDMA NICs to use (``mlx5_0,mlx5_1``), empty for Mooncake's own choice."""
    engine = transfer_engine_class()()
    nics = device_name if protocol == "rdma" else ""
    rc = engine.initialize(host, "P2PHANDSHAKE", protocol, nics)
    if rc != 0:
        raise TransferError(f"mooncake: initialize({host!r}, P2PHANDSHAKE, {protocol!r}, {nics!r}) returned {rc}")
    return engine, f"{host}:{engine.get_rpc_port()}"


class CudaMemoryUnavailable(BackendUnavailable):
    """``cluster.mooncake.memory=cuda`` in a process that sees no CUDA device."""


def require_cuda() -> None:
    """Checked when a publisher or puller is made, so a misconfigured cell stops at start-up."""
    import torch

    if not torch.cuda.is_available():
        raise CudaMemoryUnavailable("cluster.mooncake.memory=cuda: this process sees no CUDA device "
                                    "(set cluster.mooncake.memory=cpu, or run the cell on a GPU node "
                                    "with the [gpu] install)")


def cuda_zeros(num_elements: int, dtype: WeightsDtype = "float32") -> Any:
    """A float32 (or bfloat16) tensor on this process's current CUDA device."""
    import torch

    require_cuda()
    return torch.zeros(num_elements, dtype=getattr(torch, dtype), device=torch.device("cuda", torch.cuda.current_device()))


def pin_host(addr: int, nbytes: int) -> bool:
    """Page-lock host memory for CUDA (``cudaHostRegister``) where this process sees a device: copies
    from the GPU then run at full speed. False where there is no device or the driver refuses (the
    memory still works, pageable)."""
    import torch

    if not torch.cuda.is_available():
        return False
    rc = torch.cuda.cudart().cudaHostRegister(addr, nbytes, 0)
    if int(rc) != 0:
        log.warning("mooncake: cudaHostRegister of %d bytes failed (%s); the slot stays pageable", nbytes, rc)
        return False
    return True


class RegisteredBuffer:
    """``num_elements`` float32 (or bfloat16) values registered with one engine until ``release``:
    host memory held as numpy (bfloat16 as raw uint16 bits), page-locked with ``pin=True`` where a
    CUDA device is seen; or a torch tensor on the current CUDA device (``memory="cuda"``)."""

    def __init__(self, engine: Any, num_elements: int, memory: MooncakeMemory = "cpu", dtype: WeightsDtype = "float32",
                 *, pin: bool = False):
        self.num_elements = num_elements
        self.dtype: WeightsDtype = dtype
        self.nbytes = num_elements * WEIGHT_ITEMSIZE[dtype]
        self.pinned = False
        self.data: Any
        if memory == "cuda":
            self.data = cuda_zeros(num_elements, dtype)  # zeroed on the device: its pages are mapped now
            self.addr = int(self.data.data_ptr())
        else:
            # An anonymous mapping: page-aligned and exactly this size (cudaHostRegister pins whole
            # pages; torch's pinned allocator would round a 240 GB slot up to 256).
            self._map = mmap.mmap(-1, max(self.nbytes, 1))
            self.data = np.frombuffer(self._map, dtype=WEIGHT_NUMPY_DTYPE[dtype], count=num_elements)
            # Touch every page now: first-touch faults would otherwise land inside the first transfer.
            self.data.fill(0)
            self.addr = int(self.data.ctypes.data)
            self.pinned = pin and pin_host(self.addr, self.nbytes)
        rc = engine.register_memory(self.addr, self.nbytes)
        if rc != 0:
            self._unpin()
            raise TransferError(f"mooncake: register_memory of {self.nbytes} bytes ({memory}) returned {rc}")

    @property
    def placement(self) -> str:
        if not isinstance(self.data, np.ndarray):
            return str(self.data.device)
        return "host (page-locked)" if self.pinned else "host"

    def write(self, src: Any) -> None:
        """Copy ``src`` (a numpy array or a torch tensor, CPU or CUDA) into the buffer, as it is:
        a float32 into a bf16 slot is refused, not cast."""
        import torch

        if isinstance(self.data, np.ndarray) and isinstance(src, np.ndarray):
            if src.dtype != self.data.dtype or src.size != self.data.size:
                raise ValueError(f"slot of {self.data.size} {self.dtype}: refused {src.size} values of {src.dtype}")
            np.copyto(self.data, src.reshape(-1), casting="no")
            return
        dst = self.tensor()
        if isinstance(src, np.ndarray):  # bf16 travels as raw uint16 bits: view them, never convert
            src = torch.from_numpy(src.view(np.int16)).view(torch.bfloat16) if src.dtype == np.uint16 \
                else torch.from_numpy(src)
        if src.dtype != dst.dtype or src.numel() != dst.numel():
            raise ValueError(f"slot of {dst.numel()} {self.dtype}: refused {src.numel()} values of {src.dtype}")
        dst.copy_(src.reshape(-1))  # from the GPU into page-locked memory: a DMA at full speed

    def tensor(self) -> Any:
        """The buffer as a torch tensor of its dtype, sharing its memory."""
        import torch

        if not isinstance(self.data, np.ndarray):
            return self.data
        if self.dtype == "bfloat16":
            return torch.from_numpy(self.data.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(self.data)

    def release(self, engine: Any) -> None:
        engine.unregister_memory(self.addr)
        self._unpin()

    def _unpin(self) -> None:
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.addr)
            self.pinned = False


# ---------------------------------------------------------------- the core's side


@dataclass
class _Slot:
    buffer: RegisteredBuffer
    generation: int = 0  # bumped before every write into the slot
    writing: bool = False
    version: int = -1
    specs: tuple[TensorSpec, ...] = ()


class MooncakeWeightPublisher:
    """The core's ``WeightPublisher``: two registered host-memory slots per dtype it publishes, a
    control ROUTER on its own thread.

    ``dtypes``: what pullers ask for; by default float32 (trainers start from it), plus the bf16
    serving copy with ``serve_bf16``. A serving-only publisher (``dtypes=("bfloat16",)``) holds 4
    bytes a parameter. ``memory="cuda"`` (pullers receive in GPU memory) requires a CUDA device
    here too; the slots are page-locked host memory whenever one is seen."""

    def __init__(self, ctx: zmq.Context, bind_addr: str, *, host: str, protocol: MooncakeProtocol = "tcp",
                 device_name: str = "", memory: MooncakeMemory = "cpu", serve_bf16: bool = False,
                 dtypes: tuple[WeightsDtype, ...] | None = None):
        if memory == "cuda":
            require_cuda()
        if dtypes is None:
            dtypes = ("float32", "bfloat16") if serve_bf16 else ("float32",)
        if not dtypes or len(set(dtypes)) != len(dtypes) or not set(dtypes) <= set(WEIGHT_ITEMSIZE):
            raise ValueError(f"dtypes: want one or more distinct of {sorted(WEIGHT_ITEMSIZE)}, got {dtypes!r}")
        self._dtypes: tuple[WeightsDtype, ...] = tuple(dtypes)
        self._engine, self.session_id = start_engine(host, protocol, device_name)
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        curve.server(self._sock)
        self._sock.bind(bind_addr)
        self.addr = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._slots: dict[str, list[_Slot]] = {d: [] for d in self._dtypes}
        self._latest: int | None = None  # the slot index offered to pullers (the same in every dtype)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="mooncake-weights", daemon=True)

    def publish(self, weights: FlatWeights) -> None:
        """Copy ``weights`` (and its bf16 copy) into the slots not offered now, then offer them. One thread only."""
        if weights.dtype == "bfloat16" and "float32" in self._dtypes:
            raise ValueError("publish: bf16 weights cannot fill float32 slots without inventing bits; the core "
                             "exports float32 where anyone pulls it (cellrunner.backends.core_export_dtype)")
        target = 0 if self._latest is None else 1 - self._latest
        for dtype in self._dtypes:
            slot = self._slot(dtype, target, weights.num_elements)
            with self._lock:
                slot.generation += 1  # before the first byte changes: readers of the old bytes fail their check
                slot.writing = True
            slot.buffer.write((to_bf16(weights) if dtype == "bfloat16" and weights.dtype != "bfloat16" else weights).data)
            with self._lock:
                slot.writing = False
                slot.version, slot.specs = weights.version, weights.specs
        with self._lock:
            self._latest = target

    def start(self) -> None:
        self._thread.start()

    def footprint(self) -> dict[str, Any]:
        """What the slots registered so far hold: bytes, bytes a parameter, where they live."""
        with self._lock:
            buffers = [slot.buffer for slots in self._slots.values() for slot in slots]
        n = buffers[0].num_elements if buffers else 0
        total = sum(b.nbytes for b in buffers)
        return {"dtypes": list(self._dtypes), "slots": len(buffers), "bytes": total,
                "bytes_per_parameter": total / n if n else 0.0,
                "placement": sorted({b.placement for b in buffers})}

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        else:
            self._sock.close(0)
        for slots in self._slots.values():
            for slot in slots:
                slot.buffer.release(self._engine)
            slots.clear()
        self._engine = None  # the engine's own threads and ports go with the object

    def _slot(self, dtype: WeightsDtype, index: int, num_elements: int) -> _Slot:
        slots = self._slots[dtype]
        held = slots[0].buffer.num_elements if slots else num_elements
        if held != num_elements:
            raise ValueError(f"publish: {num_elements} elements, the registered slots hold {held}")
        if index == len(slots):  # registered once, on the first version that needs it
            slots.append(_Slot(RegisteredBuffer(self._engine, num_elements, "cpu", dtype, pin=True)))
        return slots[index]

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            parts = self._sock.recv_multipart()
            if len(parts) != 2:
                log.warning("mooncake publisher: rejected a request of %d frames", len(parts))
                self._reply(parts[0], ErrorReply(where="mooncake_weights", message="want one frame per request"))
                continue
            self._reply(parts[0], self._answer(parts[1]))
        self._sock.close(0)

    def _answer(self, frame: bytes) -> Message:
        try:
            req = decode_control(frame, expect=(PullWeights, CheckSlot))
        except ProtocolError as exc:
            log.warning("mooncake publisher: rejected request: %s", exc)
            return ErrorReply(where="mooncake_weights", message=str(exc))
        with self._lock:
            slots = self._slots.get(req.dtype)
            if slots is None:
                return ErrorReply(where=req.TAG, message=f"{req.dtype} is not published here (it keeps "
                                                         f"{', '.join(self._dtypes)}: what its pullers ask for)")
            if isinstance(req, CheckSlot):
                if req.slot >= len(slots):
                    return ErrorReply(where="check_slot", message=f"slot {req.slot} was never offered")
                slot = slots[req.slot]
                return SlotChecked(unchanged=slot.generation == req.generation and not slot.writing)
            if self._latest is None or slots[self._latest].version < req.min_version:
                have = -1 if self._latest is None else slots[self._latest].version
                return ErrorReply(where="pull_weights", message=f"have version {have}, asked for >= {req.min_version}")
            slot = slots[self._latest]
            return WeightsOffer(
                weight_version=slot.version, num_elements=slot.buffer.num_elements, tensors=list(slot.specs),
                session_id=self.session_id, remote_addr=slot.buffer.addr, slot=self._latest,
                generation=slot.generation, dtype=req.dtype,
            )

    def _reply(self, ident: bytes, msg: Message) -> None:
        self._sock.send_multipart([ident, encode(msg)])


# ---------------------------------------------------------------- a satellite's side


class MooncakeWeightPuller:
    """A satellite's ``WeightPuller``: one registered receive buffer, reused by every pull.

    The FlatWeights a pull returns is a view of that buffer (a CUDA tensor with ``memory="cuda"``):
    load it before the next pull.
    """

    def __init__(
        self, ctx: zmq.Context, *, host: str, protocol: MooncakeProtocol = "tcp", device_name: str = "",
        memory: MooncakeMemory = "cpu", chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_torn_retries: int = MAX_TORN_RETRIES,
    ):
        if chunk_bytes < 4096 or chunk_bytes % 4:
            raise ValueError(f"chunk_bytes: want a multiple of 4 >= 4096, got {chunk_bytes}")
        if memory == "cuda":
            require_cuda()
        self._ctx = ctx
        self._memory: MooncakeMemory = memory
        self._engine, self.session_id = start_engine(host, protocol, device_name)
        self.chunk_bytes = chunk_bytes
        """Size of each read in a pull's batch; may be changed between pulls (bench.transfer does)."""
        self._max_torn_retries = max_torn_retries
        # One receive buffer per dtype, each registered once: a satellite's engine pulls bf16 and its
        # trainer float32, and alternating would register a model-sized buffer on every pull.
        self._buffers: dict[str, RegisteredBuffer] = {}
        # Buffers a timed-out read may still be writing into: kept alive, never reused.
        self._abandoned: list[RegisteredBuffer] = []
        self.num_torn = 0
        """Reads thrown away because the core rewrote their slot meanwhile (for tests and logs)."""

    def pull(self, addr: str, min_version: int, timeout_s: float, dtype: WeightsDtype = "float32") -> FlatWeights:
        if self._engine is None:
            raise TransferError("mooncake puller: pull after close")
        deadline = time.monotonic() + timeout_s
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        curve.client(sock, "core")  # weights are served by the core only
        sock.connect(addr)
        try:
            for _ in range(self._max_torn_retries + 1):
                offer = self._ask(sock, addr, PullWeights(min_version=min_version, dtype=dtype), WeightsOffer, deadline)
                if offer.weight_version < min_version:
                    raise TransferError(f"weights from {addr}: offered version {offer.weight_version} < {min_version}")
                if offer.dtype != dtype:
                    raise TransferError(f"weights from {addr}: offered {offer.dtype}, asked for {dtype}")
                buffer = self._receive_buffer(offer.num_elements, dtype)
                self._read(offer, buffer, deadline)
                check = CheckSlot(slot=offer.slot, generation=offer.generation, dtype=dtype)
                if self._ask(sock, addr, check, SlotChecked, deadline).unchanged:
                    return FlatWeights(offer.weight_version, tuple(offer.tensors), buffer.data)
                self.num_torn += 1
                log.info("mooncake pull: version %d was rewritten during the read; asking again", offer.weight_version)
        finally:
            sock.close(0)
        raise TransferError(f"weights from {addr}: {self._max_torn_retries + 1} reads in a row overlapped a publish")

    def close(self) -> None:
        for dtype in list(self._buffers):
            self._drop_buffer(dtype)
        self._engine = None  # the engine's own threads and ports go with the object

    def _ask(self, sock: zmq.Socket, addr: str, msg: Message, want: type[Message], deadline: float) -> Any:
        sock.send(encode(msg))
        if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            raise TransferError(f"no answer to {msg.TAG} from {addr} in time")
        parts = sock.recv_multipart()
        if len(parts) != 1:
            raise TransferError(f"bad reply from {addr}: {len(parts)} frames, want 1")
        try:
            reply = decode_control(parts[0], expect=(want, ErrorReply))
        except ProtocolError as exc:
            raise TransferError(f"bad reply from {addr}: {exc}") from None
        if isinstance(reply, ErrorReply):
            raise TransferError(f"weight publisher {addr}: {reply.message}")
        return reply

    def _receive_buffer(self, num_elements: int, dtype: WeightsDtype) -> RegisteredBuffer:
        buf = self._buffers.get(dtype)
        if buf is None or buf.num_elements != num_elements:
            self._drop_buffer(dtype)  # only when the model changes size: registration is once per size
            buf = self._buffers[dtype] = RegisteredBuffer(self._engine, num_elements, self._memory, dtype)
        return buf

    def _drop_buffer(self, dtype: WeightsDtype) -> None:
        buf = self._buffers.pop(dtype, None)
        if buf is not None:
            buf.release(self._engine)

    def _read(self, offer: WeightsOffer, buffer: RegisteredBuffer, deadline: float) -> None:
        """Submit every chunk as its own asynchronous read, then wait for all of them.

        The chunks spread over Mooncake's connections to the peer and run at once; the wait
        polls each chunk's status with a short sleep in between (see POLL_INTERVAL_S).
        """
        nbytes = offer.num_elements * WEIGHT_ITEMSIZE[offer.dtype]
        pending = []
        for start in range(0, nbytes, self.chunk_bytes):
            length = min(self.chunk_bytes, nbytes - start)
            batch = self._engine.batch_transfer_async_read(
                offer.session_id, [buffer.addr + start], [offer.remote_addr + start], [length],
            )
            if batch in (0, 2**64 - 1):  # Mooncake's two ways of saying the submit failed
                self._abandon(buffer)
                raise TransferError(f"mooncake: could not submit a read from {offer.session_id}")
            pending.append(batch)
        while True:
            still = []
            for batch in pending:
                rc = self._engine.transfer_check_status(batch)  # 1 done, 0 running, <0 failed
                if rc < 0:
                    self._abandon(buffer)
                    raise TransferError(f"mooncake read of {nbytes} bytes from {offer.session_id} failed (rc {rc})")
                if rc == 0:
                    still.append(batch)
            pending = still
            if not pending:
                return
            if time.monotonic() > deadline:
                self._abandon(buffer)
                raise TransferError(f"mooncake read from {offer.session_id}: {len(pending)} chunks unfinished in time")
            time.sleep(POLL_INTERVAL_S)

    def _abandon(self, buffer: RegisteredBuffer) -> None:
        """Reads of this buffer may still land: never hand it out again, never free it."""
        self._abandoned.append(buffer)
        self._buffers.pop(buffer.dtype, None)
