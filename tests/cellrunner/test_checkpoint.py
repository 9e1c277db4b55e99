"""The core's checkpoints: a trainer restored from one continues exactly as the original would."""

import dataclasses
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

from cellrunner.checkpoint import save_checkpoint
from cellrunner.trainer import EmbeddedTrainer
from base.checkpoints import latest_checkpoint
from tests.cellrunner.test_trainer import VOCAB, cfgs, make_shards


def stepped_core(shards, steps: int) -> EmbeddedTrainer:
    model_cfg, algo = cfgs()
    core = EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=True)
    core.start(None)
    for step in range(steps):
        for sh in shards:
            core.microstep(dataclasses.replace(sh, step=step))
        core.apply([], num_executions=9)
    return core


def test_restored_core_takes_the_same_next_step(tmp_path):
    shards = make_shards(random.Random(0), 3)
    original = stepped_core(shards, 2)
    original.save_checkpoint(str(tmp_path))
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.version == 2

    model_cfg, algo = cfgs()
    restored = EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=True)
    restored.restore(ckpt)
    assert restored.version == 2
    restored_v2 = restored.weights()
    np.testing.assert_array_equal(restored_v2.data, original.weights().data)
    for trainer in (original, restored):
        for sh in shards:
            trainer.microstep(dataclasses.replace(sh, step=2))
    w_orig, _ = original.apply([], num_executions=9)
    w_rest, _ = restored.apply([], num_executions=9)
    assert w_rest.version == w_orig.version == 3
    # The AdamW moments and step count came back: the third update is bit-identical. A fresh
    # optimizer would take a first-step-sized update instead.
    np.testing.assert_array_equal(w_rest.data, w_orig.data)

    # The premise: from the same weights without the optimizer state, the step differs.
    fresh = EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=True)
    fresh.start(None)
    fresh.start(restored_v2)
    for sh in shards:
        fresh.microstep(dataclasses.replace(sh, step=2))
    w_fresh, _ = fresh.apply([], num_executions=9)
    assert not np.allclose(w_fresh.data, w_orig.data)


def test_latest_ignores_incomplete_and_temporary_folders(tmp_path):
    core = stepped_core(make_shards(random.Random(1), 2), 1)
    save_checkpoint(tmp_path, core.weights(), core.optimizer, core.param_names())
    (tmp_path / "v7").mkdir()  # a folder without checkpoint.json: a write that never finished
    (tmp_path / ".v9.tmp-123").mkdir()
    (tmp_path / "notes").mkdir()
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.version == 1
    assert latest_checkpoint(tmp_path / "missing") is None


def test_a_corrupt_checkpoint_is_refused_with_a_clear_error(tmp_path):
    core = stepped_core(make_shards(random.Random(2), 2), 1)
    path = save_checkpoint(tmp_path, core.weights(), core.optimizer, core.param_names())
    (path / "checkpoint.json").write_text(json.dumps({"version": 5}))
    model_cfg, algo = cfgs()
    other = EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=True)
    with pytest.raises(ValueError, match="version 5, folder says 1"):
        other.restore(latest_checkpoint(tmp_path))


RESUME_CHILD = """
import dataclasses, random, sys
from pathlib import Path
from cellrunner.trainer import EmbeddedTrainer
from base.checkpoints import latest_checkpoint
from tests.cellrunner.test_trainer import VOCAB, cfgs, make_shards
src, resaved, after = (Path(a) for a in sys.argv[1:4])
model_cfg, algo = cfgs()
core = EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=True)
core.restore(latest_checkpoint(src))
core.save_checkpoint(str(resaved))  # the state as restored, before anything else touches it
for sh in make_shards(random.Random(0), 3):
    core.microstep(dataclasses.replace(sh, step=core.version))
core.apply([], num_executions=9)
core.save_checkpoint(str(after))
"""


def optimizer_files(folder) -> tuple[dict, dict]:
    import safetensors.numpy

    meta = json.loads((folder / "checkpoint.json").read_text())
    return meta, safetensors.numpy.load_file(str(folder / "optimizer.safetensors"))


def assert_same_optimizer(a, b) -> None:
    """Every moment bit for bit (dtype and shape too), the step count and every group setting."""
    meta_a, tensors_a = optimizer_files(a)
    meta_b, tensors_b = optimizer_files(b)
    assert meta_a == meta_b
    assert sorted(tensors_a) == sorted(tensors_b) and tensors_a
    for name, t in tensors_a.items():
        assert t.dtype == tensors_b[name].dtype and t.shape == tensors_b[name].shape, name
        assert t.tobytes() == tensors_b[name].tobytes(), name


def test_a_resumed_core_has_the_checkpointed_optimizer_bit_for_bit(tmp_path):
    """What a requeued job's core does: a fresh process restores the checkpoint. Its AdamW state
    (both moments, the step count, lr and every group setting) equals the saved one bit for bit,
    in-process too, and its next update equals the live core's next update bit for bit."""
    import subprocess
    import sys

    import torch

    shards = make_shards(random.Random(0), 3)
    live = stepped_core(shards, 3)
    live.save_checkpoint(str(tmp_path / "ckpt"))

    restored = EmbeddedTrainer(model_cfg=live.model_cfg, algo=live.algo, vocab_size=VOCAB, is_core=True)
    restored.restore(latest_checkpoint(tmp_path / "ckpt"))
    want, got = live.optimizer.state_dict(), restored.optimizer.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"]) and want["state"]
    for i, s in want["state"].items():
        assert sorted(got["state"][i]) == sorted(s)
        for key, t in s.items():
            assert got["state"][i][key].dtype == t.dtype and torch.equal(got["state"][i][key], t), (i, key)

    subprocess.run([sys.executable, "-c", RESUME_CHILD, str(tmp_path / "ckpt"), str(tmp_path / "resaved"),
                    str(tmp_path / "after")], check=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert_same_optimizer(tmp_path / "ckpt" / "v3", tmp_path / "resaved" / "v3")
    for sh in shards:
        live.microstep(dataclasses.replace(sh, step=3))
    live.apply([], num_executions=9)
    live.save_checkpoint(str(tmp_path / "live"))
    assert_same_optimizer(tmp_path / "live" / "v4", tmp_path / "after" / "v4")
    from safetensors.numpy import load_file

    w_live, w_child = load_file(str(tmp_path / "live" / "v4" / "model.safetensors")), \
        load_file(str(tmp_path / "after" / "v4" / "model.safetensors"))
    assert sorted(w_live) == sorted(w_child)
    for name, t in w_live.items():
        assert t.tobytes() == w_child[name].tobytes(), name


def test_a_changed_lr_on_resume_is_taken_from_the_config_and_said(tmp_path, caplog):
    live = stepped_core(make_shards(random.Random(3), 2), 1)
    live.save_checkpoint(str(tmp_path))
    model_cfg, algo = cfgs()
    other = EmbeddedTrainer(model_cfg=model_cfg, algo=dataclasses.replace(algo, lr=1e-4), vocab_size=VOCAB,
                            is_core=True)
    with caplog.at_level("WARNING", logger="cellrunner.checkpoint"):
        other.restore(latest_checkpoint(tmp_path))
    assert other.optimizer.param_groups[0]["lr"] == 1e-4
    assert "lr=0.0001 from the config" in caplog.text and "lr=0.005" in caplog.text
