"""The Mooncake weight pull between two real processes over loopback TCP.

A child process plays the core (a ``MooncakeWeightPublisher`` driven by JSON lines on its stdin);
this process is the satellite. Pulled bytes must equal the published ones bit for bit, a version
published while a pull runs must never come back torn, and bad control frames are refused in
words on both sides.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import yaml
import zmq

from cellrunner.config import ModelConfig
from cellrunner.model import FlatWeights, build_model, flatten_params, load_flat
from cellrunner.transfer import TransferError
from cellrunner.transfer_mooncake import (
    CudaMemoryUnavailable, MooncakeUnavailable, MooncakeWeightPublisher, MooncakeWeightPuller, decode_control,
    transfer_engine_class,
)
from base.typed_config import build
from base.wire import (
    PROTOCOL_VERSION, CheckSlot, ErrorReply, ProtocolError, PullWeights, SlotChecked, TensorSpec, WeightsOffer, encode,
)
from base.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"

# The core: publishes what stdin asks for and answers each command with one JSON line. One
# publisher per buffer size (a publisher registers its slots once, for one size).
CORE = r"""
import json, sys, time
import numpy as np, yaml, zmq
from cellrunner.config import ModelConfig
from cellrunner.model import FlatWeights, build_model, flatten_params
from cellrunner.transfer_mooncake import MooncakeWeightPublisher
from base.typed_config import build
from base.wire import TensorSpec
from base.tokenizer import get_tokenizer

def model_weights(version):
    cfg = build(ModelConfig, yaml.safe_load(open("conf/model/tiny.yaml")))
    w = flatten_params(build_model(cfg, get_tokenizer(cfg.tokenizer, cfg.compact_ranks).vocab_size), version)
    if version:  # a later version: the init moved by seeded noise, so equal bytes prove the transfer
        w = FlatWeights(version, w.specs, w.data + np.random.default_rng(version).standard_normal(w.data.size, dtype=np.float32))
    return w

def flat(version, n, fill=None):
    data = np.full(n, float(version), np.float32) if fill else np.random.default_rng(version).standard_normal(n, dtype=np.float32)
    return FlatWeights(version, (TensorSpec(name="w", shape=[n], offset=0),), data)

publishers = {}
def publisher(num_elements):
    if num_elements not in publishers:
        publishers[num_elements] = MooncakeWeightPublisher(zmq.Context.instance(), "tcp://127.0.0.1:0", host="127.0.0.1")
        publishers[num_elements].start()
    return publishers[num_elements]

print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["kind"] == "model":
        w = model_weights(cmd["version"])
        pub = publisher(w.data.size)
        pub.publish(w)
    elif cmd["kind"] == "random":
        pub = publisher(cmd["num_elements"])
        pub.publish(flat(cmd["version"], cmd["num_elements"]))
    elif cmd["kind"] == "churn":  # versions back to back, each all one value, until the deadline
        pub = publisher(cmd["num_elements"])
        v, end, rng = cmd["version"], time.monotonic() + cmd["seconds"], np.random.default_rng(0)
        while time.monotonic() < end:
            pub.publish(flat(v, cmd["num_elements"], fill=True))
            v += 1
            time.sleep(float(rng.uniform(0.0, 0.02)))
        cmd["version"] = v - 1
    print(json.dumps({"published": cmd["version"], "addr": pub.addr}), flush=True)
for pub in publishers.values():
    pub.close()
"""


class Core:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CORE], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        )
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def send(self, **cmd: object) -> tuple[str, int]:
        """Run one command; return the publisher's control address and the last version published."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return answer["addr"], answer["published"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture(scope="module")
def core() -> Iterator[Core]:
    """One core process for the module: starting Python with torch costs several seconds."""
    c = Core()
    yield c
    c.close()
    assert c.proc.returncode == 0


@pytest.fixture
def ctx() -> zmq.Context:
    return zmq.Context.instance()


def tiny_weights(version: int) -> FlatWeights:
    cfg = build(ModelConfig, yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text()))
    vocab = get_tokenizer(cfg.tokenizer, cfg.compact_ranks).vocab_size
    w = flatten_params(build_model(cfg, vocab), version)
    if version:
        noise = np.random.default_rng(version).standard_normal(w.data.size, dtype=np.float32)
        w = FlatWeights(version, w.specs, w.data + noise)
    return w


# ---------------------------------------------------------------- two processes, real bytes


def test_pulls_real_weights_bit_identical_into_one_reused_buffer(core: Core, ctx: zmq.Context) -> None:
    puller = MooncakeWeightPuller(ctx, host=HOST, chunk_bytes=64 * 1024)  # many chunks, a short last one
    try:
        addr, _ = core.send(kind="model", version=0)
        got = puller.pull(addr, 0, timeout_s=30)
        want = tiny_weights(0)
        assert got.version == 0 and got.specs == want.specs
        assert got.data.tobytes() == want.data.tobytes()
        first_buffer = got.data.ctypes.data

        core.send(kind="model", version=1)
        got = puller.pull(addr, 1, timeout_s=30)
        want = tiny_weights(1)
        assert got.version == 1 and got.data.tobytes() == want.data.tobytes()
        assert got.data.ctypes.data == first_buffer  # registered once, reused
        model = build_model(build(ModelConfig, yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text())),
                            get_tokenizer("qwen_compact", 1024).vocab_size)
        load_flat(model, got)  # the manifest came along intact
        assert flatten_params(model, 1).data.tobytes() == want.data.tobytes()

        with pytest.raises(TransferError, match=r"have version 1, asked for >= 2"):
            puller.pull(addr, 2, timeout_s=30)
    finally:
        puller.close()


def test_large_pull_in_default_chunks(core: Core, ctx: zmq.Context) -> None:
    n = 20_000_000 + 3  # 80 MB: three 32 MiB chunks, the last one short and not page-aligned
    addr, _ = core.send(kind="random", version=5, num_elements=n)
    puller = MooncakeWeightPuller(ctx, host=HOST)
    try:
        got = puller.pull(addr, 5, timeout_s=60)
    finally:
        puller.close()
    want = np.random.default_rng(5).standard_normal(n, dtype=np.float32)
    assert got.version == 5 and got.data.tobytes() == want.tobytes()


def test_publishing_during_pulls_never_yields_a_torn_read(core: Core, ctx: zmq.Context) -> None:
    n = 4_000_000  # 16 MB: a read takes about as long as the core's pause between publishes
    addr, _ = core.send(kind="random", version=0, num_elements=n)
    puller = MooncakeWeightPuller(ctx, host=HOST, chunk_bytes=1 << 20, max_torn_retries=200)
    churn = InBackground(core, kind="churn", version=1, num_elements=n, seconds=6.0)
    versions: list[int] = []
    try:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            w = puller.pull(addr, 0, timeout_s=30)
            lo, hi = float(w.data.min()), float(w.data.max())
            assert lo == hi == float(w.version) or w.version == 0, f"torn: version {w.version} holds {lo}..{hi}"
            versions.append(w.version)
    finally:
        last = churn.join_result()
        puller.close()
    print(f"torn-read test: {len(versions)} pulls, {len(set(versions))} versions, {puller.num_torn} torn reads retried")
    assert len(set(versions)) >= 5, versions  # pulls really ran while versions changed under them
    assert puller.num_torn >= 1, "no read overlapped a publish: the test did not exercise the race"
    assert last > max(versions)


class InBackground:
    """Send one long command to the core on a thread and collect its answer later."""

    def __init__(self, core: Core, **cmd: object):
        self._result: list[tuple[str, int]] = []
        self._thread = threading.Thread(target=lambda: self._result.append(core.send(**cmd)), daemon=True)
        self._thread.start()

    def join_result(self) -> int:
        self._thread.join(timeout=60)
        return self._result[0][1]


# ---------------------------------------------------------------- bad control frames


def ask(ctx: zmq.Context, addr: str, *frames: bytes) -> object:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    try:
        sock.send_multipart(list(frames))
        assert sock.poll(10_000), "no answer"
        (reply,) = sock.recv_multipart()
        return decode_control(reply, expect=(ErrorReply, WeightsOffer, SlotChecked))
    finally:
        sock.close(0)


def test_publisher_refuses_bad_requests_and_keeps_serving(ctx: zmq.Context) -> None:
    pub = MooncakeWeightPublisher(ctx, f"tcp://{HOST}:0", host=HOST)
    pub.start()
    try:
        pub.publish(FlatWeights(2, (TensorSpec(name="w", shape=[1024], offset=0),), np.ones(1024, np.float32)))
        with pytest.raises(ValueError, match="registered slots hold 1024"):  # before the 2nd slot exists
            pub.publish(FlatWeights(3, (TensorSpec(name="w", shape=[8], offset=0),), np.zeros(8, np.float32)))
        cases = {
            b"\xc1 not msgpack": "not MessagePack",
            msgpack.packb([PROTOCOL_VERSION, "bogus", {}]): "unknown tag 'bogus'",
            msgpack.packb([PROTOCOL_VERSION + 7, "pull_weights", {"min_version": 0}]): "protocol version",
            msgpack.packb([PROTOCOL_VERSION, "pull_weights", {"min_version": "0"}]): "pull_weights.min_version: want int",
            msgpack.packb([PROTOCOL_VERSION, "pull_weights", {"min_version": 0, "x": 1}]): "unknown field",
            msgpack.packb([PROTOCOL_VERSION, "check_slot", {"slot": 7, "generation": 1}]): "check_slot.slot: want 0 or 1",
            encode(WeightsOffer(weight_version=0, num_elements=1, tensors=[], session_id="h:1", remote_addr=1,
                                slot=0, generation=1)): "not expected here",
            encode(CheckSlot(slot=1, generation=1)): "slot 1 was never offered",
            encode(PullWeights(min_version=3)): "have version 2, asked for >= 3",
        }
        for frame, words in cases.items():
            reply = ask(ctx, pub.addr, frame)
            assert isinstance(reply, ErrorReply) and words in reply.message, (words, reply)
        reply = ask(ctx, pub.addr, encode(PullWeights(min_version=0)), b"extra")
        assert isinstance(reply, ErrorReply) and "one frame" in reply.message
        offer = ask(ctx, pub.addr, encode(PullWeights(min_version=2)))
        assert isinstance(offer, WeightsOffer) and offer.weight_version == 2 and offer.num_elements == 1024
        assert ask(ctx, pub.addr, encode(CheckSlot(slot=offer.slot, generation=offer.generation))) == SlotChecked(unchanged=True)
        pub.publish(FlatWeights(3, offer_specs(offer), np.zeros(1024, np.float32)))
        pub.publish(FlatWeights(4, offer_specs(offer), np.zeros(1024, np.float32)))  # rewrites the offered slot
        assert ask(ctx, pub.addr, encode(CheckSlot(slot=offer.slot, generation=offer.generation))) == SlotChecked(unchanged=False)
        with pytest.raises(ValueError, match="registered slots hold 1024"):
            pub.publish(FlatWeights(5, (TensorSpec(name="w", shape=[8], offset=0),), np.zeros(8, np.float32)))
    finally:
        pub.close()


def offer_specs(offer: WeightsOffer) -> tuple[TensorSpec, ...]:
    return tuple(offer.tensors)


GOOD_OFFER = dict(weight_version=1, num_elements=6, session_id="127.0.0.1:1", remote_addr=4096, slot=0, generation=1,
                  tensors=[{"name": "a", "shape": [2, 2], "offset": 0}, {"name": "b", "shape": [2], "offset": 4}])


@pytest.mark.parametrize(("reply", "words"), [
    (b"garbage", "bad reply from .*not MessagePack"),
    (msgpack.packb([PROTOCOL_VERSION, "weights_offer", {**GOOD_OFFER, "num_elements": 9}]),
     "tensors: cover 6 elements, num_elements says 9"),
    (msgpack.packb([PROTOCOL_VERSION, "weights_offer", {**GOOD_OFFER, "tensors": [
        {"name": "a", "shape": [2, 2], "offset": 1}, {"name": "b", "shape": [2], "offset": 4}]}]),
     "tensors: a starts at 1, want 0"),
    (msgpack.packb([PROTOCOL_VERSION, "weights_offer", {**GOOD_OFFER, "session_id": "nohost"}]),
     "session_id: want host:port"),
    (msgpack.packb([PROTOCOL_VERSION, "weights_offer", {**GOOD_OFFER, "remote_addr": -5}]),
     "remote_addr: want a positive address"),
    (msgpack.packb([PROTOCOL_VERSION, "weights_offer", {**GOOD_OFFER, "slot": 2}]), "slot: want 0 or 1"),
    (encode(SlotChecked(unchanged=True)), "slot_checked: not expected here"),
    (encode(ErrorReply(where="pull_weights", message="core is busy")), "weight publisher .*: core is busy"),
])
def test_puller_refuses_bad_offers(ctx: zmq.Context, reply: bytes, words: str) -> None:
    fake_core = ctx.socket(zmq.ROUTER)  # answers the first request with `reply`, whatever it was
    fake_core.setsockopt(zmq.LINGER, 0)
    fake_core.bind(f"tcp://{HOST}:0")
    addr = fake_core.getsockopt_string(zmq.LAST_ENDPOINT)
    puller = MooncakeWeightPuller(ctx, host=HOST)
    def answer() -> None:
        if fake_core.poll(10_000):
            ident, _ = fake_core.recv_multipart()
            fake_core.send_multipart([ident, reply])

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        with pytest.raises(TransferError, match=words):
            puller.pull(addr, 0, timeout_s=10)
    finally:
        t.join(timeout=15)
        puller.close()
        fake_core.close(0)


def test_control_frames_round_trip_and_reject_wrong_types() -> None:
    offer = WeightsOffer(**{**GOOD_OFFER, "tensors": [TensorSpec(**t) for t in GOOD_OFFER["tensors"]]})
    assert decode_control(encode(offer), expect=(WeightsOffer,)) == offer
    with pytest.raises(ProtocolError, match="weights_offer.generation: want int"):
        decode_control(msgpack.packb([PROTOCOL_VERSION, "weights_offer", {**GOOD_OFFER, "generation": 1.5}]),
                       expect=(WeightsOffer,))
    with pytest.raises(ProtocolError, match="over the"):
        decode_control(b"\x00" * (17 * 1024 * 1024), expect=(WeightsOffer,))


def test_a_missing_package_is_named_with_the_apt_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # what a failed import of the wheel looks like
    with pytest.raises(MooncakeUnavailable) as err:
        transfer_engine_class()
    text = str(err.value)
    assert "mooncake-transfer-engine-non-cuda" in text and "apt-get install -y libibverbs1" in text
    with pytest.raises(MooncakeUnavailable):
        MooncakeWeightPuller(zmq.Context.instance(), host=HOST)


def test_a_cell_without_the_package_exits_saying_what_to_install(tmp_path: Path) -> None:
    """A real cellrunner with ``transfer=mooncake`` where ``mooncake.engine`` fails to import, as
    it does on a host without libibverbs: exit code 2 and the install lines, no traceback."""
    from bench.switch import load_config
    from controller.controller import cellrunner_config

    broken = tmp_path / "site" / "mooncake"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("")
    (broken / "engine.py").write_text('raise ImportError("libibverbs.so.1: cannot open shared object file")\n')
    cfg = load_config(["cluster.transfer=mooncake"])
    cfg_path = tmp_path / "cellrunner.json"
    cfg_path.write_text(json.dumps(cellrunner_config(cfg, checkpoint_dir=tmp_path / "checkpoints", log_dir=tmp_path)))
    satellite = 1 if cfg.cluster.core_cell != 1 else 0
    proc = subprocess.run(
        [sys.executable, "-m", "cellrunner.main", "--config-json", str(cfg_path), "--cell-id", str(satellite),
         "--controller", "tcp://127.0.0.1:9"],  # nobody listens: the cell fails before it needs one
        cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{broken.parent}{os.pathsep}{ROOT}"},
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "mooncake-transfer-engine-non-cuda" in proc.stderr and "apt-get install -y libibverbs1" in proc.stderr
    assert "libibverbs.so.1" in proc.stderr and "Traceback" not in proc.stderr


def test_cuda_memory_without_a_device_stops_at_start_up(tmp_path: Path) -> None:
    """``cluster.mooncake.memory=cuda`` on a host with no CUDA device: the publisher and puller
    refuse at construction (a cell exits 2 with this line), not at the first weight pull."""
    import torch

    if torch.cuda.is_available():  # this check is about hosts without one; GPU hosts run gpu_check
        pytest.skip("a CUDA device is present")
    for make in (lambda: MooncakeWeightPublisher(zmq.Context.instance(), f"tcp://{HOST}:0", host=HOST, memory="cuda"),
                 lambda: MooncakeWeightPuller(zmq.Context.instance(), host=HOST, memory="cuda")):
        with pytest.raises(CudaMemoryUnavailable, match="cluster.mooncake.memory=cpu"):
            make()


def test_the_mooncake_block_is_typed_config(tmp_path: Path) -> None:
    from bench.switch import load_config
    from controller.controller import cellrunner_config

    cfg = load_config(["transfer=mooncake", "cluster.mooncake.protocol=rdma", "cluster.mooncake.device_name=mlx5_0"])
    assert (cfg.cluster.transfer, cfg.cluster.mooncake.protocol, cfg.cluster.mooncake.memory) == ("mooncake", "rdma", "cpu")
    sent = cellrunner_config(cfg, checkpoint_dir=tmp_path, log_dir=tmp_path)["mooncake"]
    assert sent == {"protocol": "rdma", "device_name": "mlx5_0", "memory": "cpu"}
    with pytest.raises(Exception, match="memory"):
        load_config(["cluster.mooncake.memory=gpu"])


def test_a_slot_takes_torch_tensors_too(ctx: zmq.Context) -> None:
    """A trainer on GPUs hands the publisher torch tensors; a host-memory slot copies them in."""
    import torch

    w = tiny_weights(3)
    pub = MooncakeWeightPublisher(ctx, f"tcp://{HOST}:0", host=HOST)
    pub.start()
    puller = MooncakeWeightPuller(ctx, host=HOST)
    try:
        pub.publish(FlatWeights(w.version, w.specs, torch.from_numpy(w.data.copy())))
        got = puller.pull(pub.addr, 3, timeout_s=30)
        assert got.version == 3 and np.array_equal(got.data, w.data)
        assert torch.equal(got.tensor(), torch.from_numpy(w.data))
    finally:
        puller.close()
        pub.close()


def test_serving_engines_pull_a_bf16_copy_at_half_the_bytes(ctx: zmq.Context) -> None:
    """serve_bf16: the core keeps a bf16 copy of each version beside the float32 one; a serving
    cell pulls it (half the bytes), a training cell still gets float32, and a publisher without
    the copy says so instead of sending float32 bits as bf16."""
    import torch

    from cellrunner.model import to_bf16

    w = tiny_weights(4)
    pub = MooncakeWeightPublisher(ctx, f"tcp://{HOST}:0", host=HOST, serve_bf16=True)
    plain = MooncakeWeightPublisher(ctx, f"tcp://{HOST}:0", host=HOST)
    pub.start()
    plain.start()
    puller = MooncakeWeightPuller(ctx, host=HOST)
    try:
        pub.publish(w)
        plain.publish(w)
        served = puller.pull(pub.addr, 4, timeout_s=30, dtype="bfloat16")
        assert served.dtype == "bfloat16" and served.nbytes * 2 == w.nbytes
        assert torch.equal(served.tensor(), torch.from_numpy(w.data).to(torch.bfloat16))
        assert np.array_equal(served.data, to_bf16(w).data)
        trained = puller.pull(pub.addr, 4, timeout_s=30)  # the same puller, back to float32
        assert trained.dtype == "float32" and np.array_equal(trained.data, w.data)
        again = puller.pull(pub.addr, 4, timeout_s=30, dtype="bfloat16")  # each dtype's buffer registered once
        assert again.data.ctypes.data == served.data.ctypes.data and np.array_equal(again.data, to_bf16(w).data)
        with pytest.raises(TransferError, match="bfloat16 is not published here"):
            puller.pull(plain.addr, 4, timeout_s=30, dtype="bfloat16")
    finally:
        puller.close()
        pub.close()
        plain.close()
