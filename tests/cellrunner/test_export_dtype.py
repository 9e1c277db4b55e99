"""The dtype the core assembles its whole model in: the widest some puller needs, never wider.

A multi-rank core whose satellites train from their peers' own shards hands its whole model only
to bf16 serving engines: it exports bf16, so its rank 0 never holds a float32 copy of the model
(4 bytes a parameter on a 235B model is 940 GB). Single-rank satellites start from the whole
model in their trainer's own dtype (bf16 for a bf16 Megatron, float32 for the embedded trainer).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import zmq

import megatron.core  # noqa: F401  (the [test] extra: missing is a failure, never a skip)

from tests.cellrunner import megatron_cpu_shims

megatron_cpu_shims.install()

from cellrunner.backends import core_export_dtype, make_trainer, trainer_dtype, whole_model_dtypes  # noqa: E402
from cellrunner.main import satellite_initial  # noqa: E402
from cellrunner.model import FlatWeights, to_bf16, vocab_rows, weights_digest  # noqa: E402
from cellrunner.transfer import TransferError, WeightServer, pull_weights  # noqa: E402
from base.wire import TensorSpec  # noqa: E402
from tests.cellrunner.test_backends import cell_cfg  # noqa: E402

MEGATRON = ("trainer=megatron", "trainer.offload_when_serving=false", "trainer.pad_vocab_to=128")


@pytest.mark.parametrize(("overrides", "trainers_pull", "dtypes", "export"), [
    # multi-rank core, bf16 servers: only the serving copy, assembled as it is served
    (("engine=sglang",), False, ("bfloat16",), "bfloat16"),
    # single-rank bf16 Megatron satellites start from bf16: one dtype serves both
    (("engine=sglang",), True, ("bfloat16",), "bfloat16"),
    # float32 parameters: float32 for trainers, the bf16 copy for the servers
    (("engine=sglang", "trainer.params_dtype=float32"), True, ("float32", "bfloat16"), "float32"),
    (("engine=sglang", "trainer.params_dtype=float32"), False, ("bfloat16",), "bfloat16"),
    # the embedded engine computes in float32
    ((), True, ("bfloat16", "float32"), "float32"),
])
def test_the_core_exports_the_widest_dtype_a_puller_asks_for(tmp_path, overrides, trainers_pull, dtypes, export):
    cfg = cell_cfg(tmp_path, *MEGATRON, *overrides)
    assert whole_model_dtypes(cfg, trainers_pull=trainers_pull) == dtypes
    assert core_export_dtype(cfg, trainers_pull=trainers_pull) == export


def test_the_embedded_trainer_takes_float32(tmp_path):
    cfg = cell_cfg(tmp_path)
    assert trainer_dtype(cfg) == "float32"
    assert core_export_dtype(cfg, trainers_pull=True) == "float32"


def flat(version: int, n: int = 10_001) -> FlatWeights:
    data = np.random.default_rng(version).standard_normal(n, dtype=np.float32)
    return FlatWeights(version, (TensorSpec(name="w", shape=[n], offset=0),), data)


def test_a_bf16_publisher_hands_out_bf16_as_it_is_and_refuses_to_widen_it():
    ctx = zmq.Context.instance()
    server = WeightServer(ctx, "tcp://127.0.0.1:0")
    server.start()
    try:
        w = to_bf16(flat(3))
        server.publish(w)
        got = pull_weights(ctx, server.addr, 3, 10, "bfloat16")
        assert got.dtype == "bfloat16" and np.array_equal(got.data, w.data)
        with pytest.raises(TransferError, match="publishes bfloat16 weights; asked for float32"):
            pull_weights(ctx, server.addr, 3, 10, "float32")
        server.publish(flat(4))  # a float32 export still serves both
        assert np.array_equal(pull_weights(ctx, server.addr, 4, 10, "float32").data, flat(4).data)
        assert np.array_equal(pull_weights(ctx, server.addr, 4, 10, "bfloat16").data, to_bf16(flat(4)).data)
    finally:
        server.close()


@pytest.mark.parametrize(("overrides", "multi_rank"), [
    (("engine=sglang", "trainer.params_dtype=float32"), True),   # float32 params, bf16 export
    (("engine=sglang", "trainer.params_dtype=float32"), False),  # float32 params, float32 export
    (("trainer.params_dtype=float32",), False),                  # float32 params, embedded engine
])
def test_the_core_steps_and_publishes_in_its_export_dtype_and_satellites_start_equal(tmp_path, overrides, multi_rank):
    """The core's apply() hands the publisher its export dtype; a satellite's own version 0 has the
    digest of the core's first export (the controller refuses a run whose cells start apart).
    float32 parameters only: megatron's bf16 optimizer (the core's) checks for CUDA tensor types."""
    cfg = cell_cfg(tmp_path, *MEGATRON, "model=tiny", *overrides)
    cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, tree_packing=False))
    vocab = vocab_rows(cfg.model)
    core = make_trainer(cfg, vocab, is_core=True, multi_rank=multi_rank)
    export = core_export_dtype(cfg, trainers_pull=not multi_rank)
    assert core.export_dtype == export
    core.start(None)
    first = core.weights(everywhere=False)
    assert first.dtype == export
    assert weights_digest(satellite_initial(cfg, vocab, trainers_pull=not multi_rank)) == weights_digest(first)
    grads = np.random.default_rng(0).standard_normal(core.grad_numel()).astype(np.float32)
    after, norm = core.apply([grads], 1)
    assert norm > 0 and after.version == 1 and after.dtype == export
    exact = core.weights(dtype="float32")
    assert torch.equal(after.tensor(), exact.tensor().to(after.tensor().dtype))  # rounded once, from the step's values


def test_a_bf16_satellite_starts_from_bf16_weights_bit_for_bit(tmp_path):
    """What a single-rank bf16 Megatron satellite pulls (``trainer_dtype``) and starts from."""
    cfg = cell_cfg(tmp_path, *MEGATRON, "model=tiny", "engine=sglang")
    cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, tree_packing=False))
    assert trainer_dtype(cfg) == "bfloat16"
    vocab = vocab_rows(cfg.model)
    pulled = satellite_initial(cfg, vocab, trainers_pull=True)
    noisy = FlatWeights(7, pulled.specs, to_bf16(FlatWeights(7, pulled.specs, pulled.tensor().float().numpy()
                                                             + np.float32(0.01))).data)
    sat = make_trainer(cfg, vocab, is_core=False)
    sat.start(noisy)
    assert sat.version == 7
    back = sat.weights(dtype="bfloat16")
    assert np.array_equal(back.data, noisy.data)
