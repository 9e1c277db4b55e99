"""The core's checkpoints: a trainer restored from one continues exactly as the original would."""

import dataclasses
import json
import random

import numpy as np
import pytest

from cellrunner.checkpoint import save_checkpoint
from cellrunner.trainer import EmbeddedTrainer
from controller.checkpoints import latest_checkpoint
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
