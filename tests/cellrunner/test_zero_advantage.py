"""A step whose every advantage is 0 carries no data: the core must not take an AdamW step on it.

Stepping on a zero gradient is not a no-op. The weights keep moving along the decaying first
moment, and the second moment decays by beta2 a step, so after a long zero-advantage streak the
first real gradient meets a near-zero second moment and every element it touches moves by ~lr
(Adam's first-step sign update), where the same gradient without the streak moves far less.
"""

import dataclasses
import random

import numpy as np
import torch

from cellrunner.trainer import EmbeddedTrainer
from tests.cellrunner.test_trainer import VOCAB, cfgs, make_shards

STREAK = 150  # the zero-advantage steps seen before the soak's collapse


def zero_advantage(shards):
    return [dataclasses.replace(sh, sequences=[dataclasses.replace(s, advantage=0.0) for s in sh.sequences])
            for sh in shards]


def core_after(warmup, streak: int) -> EmbeddedTrainer:
    """A core trained on ``warmup`` (a list of steps' shards), then ``streak`` zero-advantage steps."""
    model_cfg, algo = cfgs()
    core = EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=True)
    core.start(None)
    for shards in warmup:
        for sh in shards:
            core.microstep(sh)
        core.apply([], num_executions=9)
    for _ in range(streak):  # no microstep: a zero-advantage shard's gradient is 0 (the test above)
        core.apply([], num_executions=9)
    return core


def real_step(core: EmbeddedTrainer, shards) -> np.ndarray:
    before = core.weights().data.copy()
    for sh in shards:
        core.microstep(sh)
    after, _ = core.apply([], num_executions=9)
    return after.data - before


def test_a_zero_advantage_step_changes_nothing_but_the_version():
    warmup = [make_shards(random.Random(s), 3) for s in range(4)]
    core = core_after(warmup, 0)
    weights = core.weights().data.copy()
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in core.optimizer.state_dict()["state"].items()}
    for sh in zero_advantage(warmup[0]):
        core.microstep(sh)
    after, norm = core.apply([], num_executions=9)
    assert after.version == 5 and norm == 0.0
    np.testing.assert_array_equal(after.data, weights)  # stepping would drift along the momentum
    for i, s in core.optimizer.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(v, state[i][k]), (i, k)  # step count and both moments as they were


def test_the_first_real_step_after_a_streak_is_the_step_without_it():
    warmup = [make_shards(random.Random(s), 3) for s in range(4)]
    real = make_shards(random.Random(99), 3)
    plain = real_step(core_after(warmup, 0), real)
    after_streak = real_step(core_after(warmup, STREAK), real)
    # Bit-identical: the streak left the optimizer as it was. (Stepping through it made this
    # update several times larger, most elements moving by ~lr: the premise test below.)
    np.testing.assert_array_equal(after_streak, plain)


def test_premise_adam_stepped_on_zero_gradients_drifts_then_takes_an_outsized_update():
    """Plain AdamW stepped through a streak, as the trainer did. The streak moves the weights by
    about ten real updates (the first moment's geometric tail, sum 1 / (1 - 0.9 / 0.99 ** 0.5)),
    and the next real update grows with the streak's length as the second moment decays: about
    the same size after 150 steps, several times larger after 1,000 (the sign-like update)."""
    torch.manual_seed(0)
    grads = [torch.randn(4096) * 0.01 for _ in range(101)]

    def run(streak: int) -> tuple[float, float]:
        p = torch.nn.Parameter(torch.zeros(4096))
        opt = torch.optim.AdamW([p], lr=5e-3, betas=(0.9, 0.99), weight_decay=0.0)
        for g in grads[:-1]:
            p.grad = g.clone()
            opt.step()
        start = p.detach().clone()
        for _ in range(streak):
            p.grad = torch.zeros_like(p)
            opt.step()
        before = p.detach().clone()
        p.grad = grads[-1].clone()
        opt.step()
        return float((before - start).norm()), float((p.detach() - before).norm())

    _, plain = run(0)
    drift, after_150 = run(STREAK)
    _, after_1000 = run(1000)
    assert drift > 8 * plain  # moved without data
    assert 0.8 * plain < after_150 < 1.5 * plain
    assert after_1000 > 3 * plain
