"""GSPO loss on shards: sequence-level, length-normalised importance ratio, clipped, weighted.

For a training sequence i with policy tokens T_i (``target_mask``):

    s_i = exp( mean_{t in T_i} (log pi_theta(y_t) - log pi_behaviour(y_t)) )
    loss_i = -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)

Each policy token carries its sequence's loss and its execution's ``token_weight`` (1 / policy
tokens of the execution), so ``sum_t w_t * loss_i(t)`` is the per-execution mean; the trainer
sums that over a step's shards and divides by the step's executions (the fair weighting). The
sum is linear in shards, so replicas that each take some shards add up to one replica's update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from base.wire import Sequence


@dataclass
class PackedBatch:
    """Sequences right-padded into one batch; masks select the policy tokens (targets)."""

    input_ids: torch.Tensor        # [B, L]
    attention_mask: torch.Tensor   # [B, L]
    targets: torch.Tensor          # [B, L-1] next-token ids
    target_mask: torch.Tensor      # [B, L-1] 1 where targets[b, t] is a policy token
    behaviour_logprobs: torch.Tensor  # [B, L-1]
    advantages: torch.Tensor       # [B]
    token_weights: torch.Tensor    # [B]
    num_targets: int


def pack(sequences: list[Sequence]) -> PackedBatch:
    length = max(len(s.tokens) for s in sequences)
    b = len(sequences)
    ids = torch.zeros(b, length, dtype=torch.long)
    attn = torch.zeros(b, length, dtype=torch.long)
    mask = torch.zeros(b, length, dtype=torch.float32)
    blp = torch.zeros(b, length, dtype=torch.float32)
    for i, s in enumerate(sequences):
        n = len(s.tokens)
        ids[i, :n] = torch.tensor(s.tokens)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(s.target_mask, dtype=torch.float32)
        blp[i, :n] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
    return PackedBatch(
        input_ids=ids,
        attention_mask=attn,
        targets=ids[:, 1:],
        target_mask=mask[:, 1:],
        behaviour_logprobs=blp[:, 1:],
        advantages=torch.tensor([s.advantage for s in sequences], dtype=torch.float32),
        token_weights=torch.tensor([s.token_weight for s in sequences], dtype=torch.float32),
        num_targets=int(mask.sum().item()),
    )


def token_logprobs(model: torch.nn.Module, batch: PackedBatch, temperature: float = 1.0) -> torch.Tensor:
    """log pi_theta of each next token, [B, L-1], at the sampling temperature (``algo.rollout``):
    the distribution the engine drew the tokens from and scored them under."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logits = logits.float() / temperature
    return torch.gather(torch.log_softmax(logits, dim=-1), 2, batch.targets.unsqueeze(-1)).squeeze(-1)


@dataclass
class LossStats:
    loss: float
    mean_ratio: float
    clip_fraction: float
    num_targets: int
    kl: float = 0.0
    """KL(behaviour || current) per policy token, k3 estimator: mean of exp(d) - 1 - d, d = new - old
    logprob (>= 0, unbiased under behaviour samples; what TensorBoard plots as the drift from behaviour)."""


def sequence_ratios(logprobs: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sequence's s_i (with its graph), its policy tokens, and whether it has any, all [B]."""
    mask = batch.target_mask
    n_tok = mask.sum(dim=1)
    log_ratio = ((logprobs - batch.behaviour_logprobs) * mask).sum(dim=1) / n_tok.clamp(min=1)
    return torch.exp(log_ratio), n_tok, n_tok > 0


def gspo_loss(
    logprobs: torch.Tensor, batch: PackedBatch, *, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, LossStats]:
    """Weighted sum (not mean) of per-sequence GSPO losses; see the module docstring."""
    ratio, n_tok, has = sequence_ratios(logprobs, batch)
    adv = batch.advantages
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    seq_loss = -torch.minimum(unclipped, clipped)
    # Each of the n_tok policy tokens carries seq_loss with weight token_weight.
    weighted = seq_loss * n_tok * batch.token_weights
    loss = weighted[has].sum()
    with torch.no_grad():
        was_clipped = (clipped < unclipped)[has].float()
        d = (logprobs.detach() - batch.behaviour_logprobs) * batch.target_mask
        k3 = (torch.exp(d) - 1.0 - d) * batch.target_mask
        num_targets = float(batch.target_mask.sum().item())
        stats = LossStats(
            loss=float(loss.item()),
            mean_ratio=float(ratio[has].mean().item()) if has.any() else 1.0,
            clip_fraction=float(was_clipped.mean().item()) if has.any() else 0.0,
            num_targets=batch.num_targets,
            kl=float(k3.sum().item()) / num_targets if num_targets else 0.0,
        )
    return loss, stats
