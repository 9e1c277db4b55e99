"""Where the core's Mooncake slots live and what they hold: host memory (page-locked where a CUDA
device is seen), and only the dtypes some puller asks for. Before, ``memory=cuda`` put two
float32 and two bf16 slots of the whole model on GPU 0: 12 bytes a parameter beside the
trainer's own state. Real Mooncake engines over loopback TCP, as in test_transfer_mooncake.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq

from cellrunner.backends import make_weight_publisher, whole_model_dtypes
from cellrunner.model import FlatWeights, to_bf16
from cellrunner.transfer import TransferError
from cellrunner.transfer_mooncake import MooncakeWeightPublisher, MooncakeWeightPuller
from base.wire import TensorSpec
from tests.cellrunner.test_backends import cell_cfg

HOST = "127.0.0.1"
N = 300_001  # odd: no slot size lines up with a page by chance


def weights(version: int, n: int = N) -> FlatWeights:
    data = np.random.default_rng(version).standard_normal(n, dtype=np.float32)
    return FlatWeights(version, (TensorSpec(name="w", shape=[n], offset=0),), data)


@pytest.fixture
def ctx() -> zmq.Context:
    return zmq.Context.instance()


def test_a_serving_only_publisher_holds_two_bf16_slots_in_host_memory(ctx):
    pub = MooncakeWeightPublisher(ctx, f"tcp://{HOST}:0", host=HOST, dtypes=("bfloat16",))
    pub.start()
    puller = MooncakeWeightPuller(ctx, host=HOST)
    try:
        for v in (1, 2):  # the second version goes into the second slot
            pub.publish(weights(v))
        fp = pub.footprint()
        assert fp["slots"] == 2 and fp["bytes"] == 2 * 2 * N
        assert fp["bytes_per_parameter"] == 4.0  # was 12 (two float32 and two bf16 slots)
        assert fp["placement"] == ["host"]  # page-locked with a CUDA device: "host (page-locked)"
        got = puller.pull(pub.addr, 2, timeout_s=30, dtype="bfloat16")
        assert got.version == 2 and np.array_equal(got.data, to_bf16(weights(2)).data)
        with pytest.raises(TransferError, match="float32 is not published here"):
            puller.pull(pub.addr, 2, timeout_s=30)
    finally:
        puller.close()
        pub.close()


def test_the_core_keeps_float32_whole_model_slots_only_for_trainers_that_pull_them(ctx, tmp_path):
    cfg = cell_cfg(tmp_path, "trainer=megatron", "engine=sglang", "transfer=mooncake")
    # Multi-rank satellites train from each rank's own shard; single-rank ones from the whole model.
    assert whole_model_dtypes(cfg, trainers_pull=False) == ("bfloat16",)
    assert whole_model_dtypes(cfg, trainers_pull=True) == ("bfloat16",)  # bf16 Megatron satellites start from bf16
    f32 = cell_cfg(tmp_path, "trainer=megatron", "engine=sglang", "transfer=mooncake", "trainer.params_dtype=float32")
    assert whole_model_dtypes(f32, trainers_pull=True) == ("float32", "bfloat16")
    assert whole_model_dtypes(cell_cfg(tmp_path), trainers_pull=False) == ("float32",)  # the embedded engine
    pub = make_weight_publisher(cfg, ctx, serving=True, trainers_pull=False)
    shard = make_weight_publisher(cfg, ctx)  # a rank's own shard: what its peer's trainer loads
    try:
        pub.publish(weights(0))
        shard.publish(weights(0))
        assert pub.footprint()["dtypes"] == ["bfloat16"] and pub.footprint()["bytes_per_parameter"] == 2.0
        assert shard.footprint()["dtypes"] == ["float32"]
    finally:
        pub.close()
        shard.close()


def test_slots_take_torch_tensors_as_they_are_and_refuse_a_cast(ctx):
    """A trainer on GPUs hands torch tensors, and the bf16 copy of a tensor is a torch bf16 tensor
    (``to_bf16``): it lands bit for bit (before, numpy could not take bf16 and the publish raised);
    float32 bits into a bf16 slot are refused, not cast."""
    w = weights(3)
    pub = MooncakeWeightPublisher(ctx, f"tcp://{HOST}:0", host=HOST, serve_bf16=True)
    pub.start()
    puller = MooncakeWeightPuller(ctx, host=HOST)
    try:
        pub.publish(FlatWeights(3, w.specs, torch.from_numpy(w.data.copy())))
        assert np.array_equal(puller.pull(pub.addr, 3, timeout_s=30).data, w.data)
        served = puller.pull(pub.addr, 3, timeout_s=30, dtype="bfloat16")
        assert torch.equal(served.tensor(), torch.from_numpy(w.data).to(torch.bfloat16))
        # Already bf16 (what to_bf16 gives for a CUDA tensor): copied, not rounded twice or refused.
        bf16_only = MooncakeWeightPublisher(ctx, f"tcp://{HOST}:0", host=HOST, dtypes=("bfloat16",))
        bf16_only.start()
        try:
            bf16_only.publish(FlatWeights(4, w.specs, torch.from_numpy(w.data).to(torch.bfloat16)))
            again = puller.pull(bf16_only.addr, 4, timeout_s=30, dtype="bfloat16")
            assert torch.equal(again.tensor(), served.tensor())
            with pytest.raises(ValueError, match="refused"):
                bf16_only._slot("bfloat16", 0, N).buffer.write(w.data)  # float32 numpy into bf16
            with pytest.raises(ValueError, match="refused"):
                bf16_only._slot("bfloat16", 0, N).buffer.write(torch.from_numpy(w.data))
        finally:
            bf16_only.close()
    finally:
        puller.close()
        pub.close()


@pytest.mark.parametrize("dtypes", [(), ("float32", "float32"), ("float16",)])
def test_a_publisher_refuses_dtypes_nobody_can_pull(ctx, dtypes):
    with pytest.raises(ValueError, match="dtypes"):
        MooncakeWeightPublisher(ctx, f"tcp://{HOST}:0", host=HOST, dtypes=dtypes)
