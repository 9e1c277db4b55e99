"""The Megatron core's resume, on the CPU shims: the restored optimizer equals the checkpointed one
bit for bit (moments, step count, every group setting), not only its next update."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import megatron.core  # noqa: E402,F401  (the [test] extra: missing is a failure, never a skip)

from base.checkpoints import latest_checkpoint  # noqa: E402
from tests.cellrunner.test_megatron_trainer import (  # noqa: E402  (imports the CPU shims first)
    VOCAB, algo_cfg, make_shard, megatron_cfg, model_cfg,
)

from cellrunner.megatron_trainer import MegatronTrainer  # noqa: E402


def optimizer_state(t: MegatronTrainer) -> list[tuple[list[dict], list[dict[str, torch.Tensor]]]]:
    """Per torch optimizer inside Megatron's: its groups' settings and each parameter's state, in order."""
    out = []
    for opt in t._torch_optimizers():
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        states = [dict(opt.state.get(p, {})) for g in opt.param_groups for p in g["params"]]
        out.append((groups, states))
    return out


def test_a_resumed_megatron_core_has_the_checkpointed_optimizer_bit_for_bit(tmp_path):
    cfg, algo = model_cfg(), algo_cfg(eps_low=0.2, eps_high=10.0)
    live = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True, megatron=megatron_cfg())
    live.start(None)
    for step in range(3):
        live.microstep(make_shard(10 + step, step=step))
        live.apply([], num_executions=4)
    live.save_checkpoint(str(tmp_path))
    restored = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True, megatron=megatron_cfg())
    restored.restore(latest_checkpoint(tmp_path))
    want, got = optimizer_state(live), optimizer_state(restored)
    assert len(want) == len(got) and want
    for (groups_w, states_w), (groups_g, states_g) in zip(want, got):
        assert groups_g == groups_w
        assert len(states_g) == len(states_w) and all(states_w)
        for i, (sw, sg) in enumerate(zip(states_w, states_g)):
            assert sorted(sg) == sorted(sw), i
            for key, t in sw.items():
                if isinstance(t, torch.Tensor):
                    assert sg[key].dtype == t.dtype and sg[key].shape == t.shape, (i, key)
                    assert torch.equal(sg[key], t), (i, key)
                else:
                    assert sg[key] == t, (i, key)


def test_a_megatron_step_with_every_advantage_zero_moves_nothing(tmp_path):
    """No data behind the step: the weights, moments and step count stay; the version advances."""
    cfg, algo = model_cfg(), algo_cfg(eps_low=0.2, eps_high=10.0)
    t = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=True, megatron=megatron_cfg())
    t.start(None)
    t.microstep(make_shard(1))
    t.apply([], num_executions=4)  # one real step: the moments are not zero
    before_w, before_opt = t.local_weights().data.copy(), optimizer_state(t)
    zero = make_shard(2, step=1)
    zero = dataclasses.replace(zero, sequences=[dataclasses.replace(s, advantage=0.0) for s in zero.sequences])
    t.microstep(zero)
    _, norm = t.apply([], num_executions=4)
    assert norm == 0.0 and t.version == 2
    assert (t.local_weights().data == before_w).all()
    for (_, states_w), (_, states_g) in zip(before_opt, optimizer_state(t)):
        for sw, sg in zip(states_w, states_g):
            assert all(torch.equal(sg[k], v) if isinstance(v, torch.Tensor) else sg[k] == v for k, v in sw.items())
