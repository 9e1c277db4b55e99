"""The embedded trainer: one torch replica of the policy, behind the interface Megatron fills.

A replica runs microsteps (forward + backward on one shard, gradients accumulate) and hands its
gradient sum over. Only the core's replica owns the authoritative weights and the AdamW state:
``apply`` adds the satellites' sums to its own, divides by the step's executions (the fair
weighting: a mean of per-execution means) and steps the optimizer.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from cellrunner.checkpoint import Checkpoint, load_optimizer_state, load_weights, save_checkpoint
from cellrunner.config import ModelConfig
from cellrunner.gspo import gspo_loss, pack, token_logprobs
from cellrunner.model import FlatWeights, build_model, flatten_grads, flatten_params, load_flat
from cellrunner.run_release import RunReleasedGrads
from cellrunner.tree_pack import packed_token_logprobs, tree_chunks
from base.wire import GroupStats, Sequence, Shard
from base.algo_config import AlgoConfig

log = logging.getLogger(__name__)


_SECOND_PASS = 2.0 / 3.0
"""A second backward pass over a run-released chunk (cellrunner.run_release), in forward-backwards:
backward is about two thirds of one."""


@dataclass
class MicrostepResult:
    num_tokens: int
    loss: float
    fb_s: float
    mean_ratio: float
    clip_fraction: float
    kl: float | None = None
    """Per policy token (``gspo.LossStats.kl``); None when no chunk measured it (run-released only)."""


def split_by_tokens(sequences: list[Sequence], max_tokens: int) -> list[list[Sequence]]:
    """Chunks of sequences whose padded size stays near ``max_tokens`` (one sequence at least)."""
    chunks: list[list[Sequence]] = []
    cur: list[Sequence] = []
    longest = 0
    for s in sorted(sequences, key=lambda s: len(s.tokens)):
        longest_if = max(longest, len(s.tokens))
        if cur and longest_if * (len(cur) + 1) > max_tokens:
            chunks.append(cur)
            cur, longest_if = [], len(s.tokens)
        cur.append(s)
        longest = longest_if
    if cur:
        chunks.append(cur)
    return chunks


class EmbeddedTrainer:
    def __init__(self, *, model_cfg: ModelConfig, algo: AlgoConfig, vocab_size: int, is_core: bool,
                 device_s_per_token: float = 0.0):
        self.device_s_per_token = device_s_per_token
        """>0: a microstep lasts at least its tokens x this (EmbeddedTrainerConfig.device_s_per_token)."""
        self.model_cfg = model_cfg
        self.algo = algo
        self.vocab_size = vocab_size
        self.is_core = is_core
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.version = -1
        self.num_microsteps = 0
        self.run_released = RunReleasedGrads(eps_low=algo.eps_low, eps_high=algo.eps_high)
        """Gradients of run-released shards, kept apart until ``fold_groups`` (cellrunner.run_release)."""

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, weights: FlatWeights | None) -> None:
        """Build the replica. The core keeps its model and optimizer across role switches."""
        if self.model is None:
            self.model = build_model(self.model_cfg, self.vocab_size)
            if weights is None:
                self.version = 0  # the seeded init is version 0 everywhere
        if weights is not None:
            load_flat(self.model, weights)
            self.version = weights.version
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        self.run_released.clear()
        self.num_microsteps = 0
        if self.is_core and self.optimizer is None:
            b1, b2 = self.algo.betas
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=self.algo.lr, betas=(b1, b2), weight_decay=self.algo.weight_decay
            )

    def stop(self) -> None:
        """Satellites drop everything; the core keeps weights and optimizer state (it owns them)."""
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)
        self.run_released.clear()
        if not self.is_core:
            self.model = None  # freed by reference counting; a full gc.collect() cost ~1.5 s a switch
            self.version = -1

    def weights(self) -> FlatWeights:
        assert self.model is not None
        return flatten_params(self.model, self.version)

    def param_names(self) -> list[str]:
        """The parameters in the optimizer's order (``model.parameters()``, shared ones once)."""
        assert self.model is not None
        return [name for name, _ in self.model.named_parameters()]

    def save_checkpoint(self, checkpoint_dir: str) -> str:
        """Core only: this version's weights and AdamW state (cellrunner.checkpoint)."""
        assert self.is_core and self.model is not None
        return str(save_checkpoint(checkpoint_dir, self.weights(), self.optimizer, self.param_names()))

    def restore(self, ckpt: Checkpoint) -> None:
        """Core only, instead of ``start(None)``: resume from a checkpoint's weights and AdamW state."""
        assert self.is_core and self.model is None, "restore() replaces the first start()"
        self.start(None)
        assert self.optimizer is not None
        self.start(load_weights(ckpt, self.weights().specs))
        load_optimizer_state(ckpt, self.optimizer, self.param_names())

    # -- work ----------------------------------------------------------------------------------

    def microstep(self, shard: Shard) -> MicrostepResult:
        assert self.model is not None, "microstep before start()"
        t0 = time.perf_counter()
        total_loss, num_tokens, ratios, clips, n = 0.0, 0, 0.0, 0.0, 0
        kl_sum, kl_tokens = 0.0, 0
        sequences = list(shard.sequences)
        device_tokens = float(sum(len(s.tokens) for s in sequences))  # what the emulated device computes
        if self.algo.tree_packing:
            chunks = tree_chunks(sequences, self.algo.max_tokens_per_microstep)
        else:
            chunks = split_by_tokens(sequences, self.algo.max_tokens_per_microstep)
        for chunk in chunks:
            batch = pack(chunk)
            if self.algo.tree_packing:
                logprobs = packed_token_logprobs(self.model, chunk, targets_only=True,
                                                 temperature=self.algo.rollout.temperature)
            else:
                logprobs = token_logprobs(self.model, batch, self.algo.rollout.temperature)
            num_tokens += batch.num_targets
            n += len(chunk)
            if shard.run_released:  # no advantage yet: keep the gradient apart (run_release.py)
                passes, mean_ratio, outside = self.run_released.add(
                    list(self.model.parameters()), logprobs, batch, execution_id=chunk[0].execution_id,
                    group_id=shard.group_id, reward=float(shard.reward),
                )
                ratios += mean_ratio * len(chunk)
                clips += outside * len(chunk)
                device_tokens += _SECOND_PASS * max(passes - 1, 0) * sum(len(s.tokens) for s in chunk)
                continue
            loss, stats = gspo_loss(logprobs, batch, eps_low=self.algo.eps_low, eps_high=self.algo.eps_high)
            loss.backward()
            total_loss += stats.loss
            ratios += stats.mean_ratio * len(chunk)
            clips += stats.clip_fraction * len(chunk)
            kl_sum += stats.kl * batch.num_targets
            kl_tokens += batch.num_targets
        if self.device_s_per_token > 0:
            # the emulated accelerator: sleep (no CPU) until the device would have finished
            left = self.device_s_per_token * device_tokens - (time.perf_counter() - t0)
            if left > 0:
                time.sleep(left)
        self.num_microsteps += 1
        return MicrostepResult(
            num_tokens=num_tokens,
            loss=total_loss,
            fb_s=time.perf_counter() - t0,
            mean_ratio=ratios / max(n, 1),
            clip_fraction=clips / max(n, 1),
            kl=kl_sum / kl_tokens if kl_tokens else None,
        )

    def fold_groups(self, groups: list[GroupStats]) -> float:
        """Fold the run-released gradients in now that their groups' advantages are known (before
        ``take_grads`` / ``apply``); returns the loss they add."""
        if not len(self.run_released):
            return 0.0
        assert self.model is not None
        return self.run_released.fold(list(self.model.parameters()), groups)

    def take_grads(self) -> np.ndarray:
        """The summed gradient of every microstep since the last call, flat; then zero it."""
        assert self.model is not None
        if len(self.run_released):
            raise RuntimeError("gradients asked for before the run-released ones were folded in")
        flat = flatten_grads(self.model)
        self.model.zero_grad(set_to_none=True)
        self.num_microsteps = 0
        return flat

    def grad_numel(self) -> int:
        """Elements of the flat gradient (``take_grads``' length)."""
        assert self.model is not None
        return sum(p.numel() for p in self.model.parameters())

    def apply(self, satellite_grads: list[np.ndarray], num_executions: int) -> tuple[FlatWeights, float]:
        """Core only: combine gradients, mean over executions, clip, AdamW step -> next version.
        A step whose gradient is all zero or not finite advances the version without an update."""
        assert self.is_core and self.model is not None and self.optimizer is not None
        if len(self.run_released):
            raise RuntimeError("apply before the run-released gradients were folded in")
        total = flatten_grads(self.model)
        for g in satellite_grads:
            if g.shape != total.shape:
                raise ValueError(f"satellite gradient has {g.size} elements, want {total.size}")
            total += g
        total /= float(num_executions)
        flat = torch.from_numpy(total)
        offset = 0
        for p in self.model.parameters():
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
        norm = float(torch.linalg.vector_norm(flat).item())
        if not math.isfinite(norm):
            # One inf/NaN would poison every weight and both moments for good: skip the update, as
            # Megatron's optimizer does on found_inf; the NaN norm reaches the metrics (controller.health).
            log.error("step to version %d: gradient norm %s, optimizer step skipped", self.version + 1, norm)
        elif not flat.any():
            # No data in the step (every advantage 0): no update and no Adam step. Stepping on a
            # zero gradient still moves the weights along the decaying first moment, and over a
            # long streak the second moment decays toward 0, so the first real gradient after it
            # gets a sign-like update of ~lr on every element (tests/cellrunner/test_zero_advantage.py).
            pass
        else:
            if self.algo.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.algo.grad_clip)
            self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        self.num_microsteps = 0
        self.version += 1
        return self.weights(), norm
