"""The core exports while it serves: ``stop()`` offloads the Megatron replica (its parameters'
storage shrunk to nothing, ``cellrunner.param_offload``), and the switch back to serving, a
LoadWeights while serving and the final checkpoint all read the weights after that. Here the
offload runs on the host (stop() does it on CUDA only), through the same code."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import megatron.core  # noqa: E402,F401  (the [test] extra: missing is a failure, never a skip)

from tests.cellrunner.test_megatron_trainer import VOCAB, algo_cfg, make_shard, megatron_cfg, model_cfg  # noqa: E402

from cellrunner.megatron_trainer import MegatronTrainer  # noqa: E402
from cellrunner.model import FlatWeights  # noqa: E402
from base.checkpoints import Checkpoint  # noqa: E402


def trained_core(params_dtype: str) -> MegatronTrainer:
    """A core one step in (Adam has moments), offloading when it stops, here on the host too."""
    mcfg = dataclasses.replace(megatron_cfg(), params_dtype=params_dtype, offload_when_serving=True)
    core = MegatronTrainer(model_cfg=model_cfg(), algo=algo_cfg(lr=1e-4, eps_low=0.5, eps_high=10.0),
                           vocab_size=VOCAB, is_core=True, megatron=mcfg)
    core._offloads = lambda: True
    shard = make_shard(4)
    core.start(None)
    core.microstep(shard)
    core.apply([], num_executions=shard.num_executions)
    return core


@pytest.fixture(autouse=True)
def _host_sync(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)  # Megatron's grad-buffer offload calls it


def test_an_offloaded_core_exports_what_it_held(tmp_path):
    # float32 only: Megatron's bf16 optimizer wants CUDA tensors (its fp32 main copies, also
    # offloaded and read from their host copies by save_checkpoint, are checked on the GPU only).
    core = trained_core("float32")
    before, local_before = core.weights(), core.local_weights()
    before_ckpt = core.save_checkpoint(str(tmp_path / "before"))
    core.stop()
    assert core._offloaded and all(p.untyped_storage().nbytes() == 0 for p in core.model.module.parameters())
    after = core.weights()  # the switch back to serving, and every LoadWeights while serving
    assert after.version == before.version
    np.testing.assert_array_equal(after.data, before.data)
    np.testing.assert_array_equal(core.local_weights().data, local_before.data)
    assert all(p.untyped_storage().nbytes() == 0 for p in core.model.module.parameters())  # still offloaded
    # The final checkpoint of a core that serves at shutdown: the same bytes as one taken in training.
    from safetensors.torch import load_file

    after_ckpt = core.save_checkpoint(str(tmp_path / "after"))
    want, got = (load_file(f"{d}/tp00_pp00_ep00.safetensors") for d in (before_ckpt, after_ckpt))
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # ... and it resumes: a new core restored from it exports the same weights.
    again = MegatronTrainer(model_cfg=core.model_cfg, algo=core.algo, vocab_size=VOCAB, is_core=True, megatron=core.cfg)
    again.restore(Checkpoint(core.version, tmp_path / "after" / f"v{core.version}"))
    np.testing.assert_array_equal(again.weights().data, before.data)


def test_exports_while_offloaded_leave_the_next_step_as_it_would_have_been():
    stay, away = trained_core("float32"), trained_core("float32")
    away.stop()
    for _ in range(2):  # the switch to serving, then a LoadWeights while serving
        np.testing.assert_array_equal(away.weights().data, stay.weights().data)
    away.start(None)  # back to training: the step lands where the one that never left lands
    shard = make_shard(5, step=1)
    for t in (stay, away):
        t.microstep(shard)
    (w_stay, n_stay), (w_away, n_away) = (t.apply([], num_executions=shard.num_executions) for t in (stay, away))
    assert n_away == n_stay > 0
    np.testing.assert_array_equal(w_away.data, w_stay.data)


def test_weights_loaded_while_offloaded_are_the_ones_it_trains_from():
    core, fresh = trained_core("float32"), trained_core("float32")
    other = core.weights()
    other = FlatWeights(7, other.specs, (other.data + np.float32(0.01)).astype(np.float32))
    core.stop()
    core.start(other)  # loaded into the offloaded replica: it comes back, then takes them
    fresh.start(other)
    assert core.version == fresh.version == 7
    np.testing.assert_array_equal(core.weights().data, other.data)
    shard = make_shard(6, step=7)
    for t in (core, fresh):
        t.microstep(shard)
    (w_a, _), (w_b, _) = (t.apply([], num_executions=shard.num_executions) for t in (core, fresh))
    np.testing.assert_array_equal(w_a.data, w_b.data)
