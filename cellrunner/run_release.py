"""Run release on a cell: train an execution as soon as it is graded, apply its advantage later.

A run-released shard (``Shard.reward`` set) reaches a cell before its group has closed, so its
advantage ``A = (reward - mean) / divisor`` is not known yet. GSPO's sequence loss is
``-min(s_i A, clip(s_i) A)``; for a fixed sign of A it is linear in A:

- A > 0: sequences with ``s_i <= 1 + eps_high`` (in the band, or below it) give ``-A ∇s_i``, the
  others (clipped above) give nothing;
- A < 0: sequences with ``s_i >= 1 - eps_low`` give ``-A ∇s_i``, the others nothing.

So the cell takes, at the step's weights, ``P = ∇ Σ n_i w_i s_i`` over the first set and keeps
it per execution, with ``D = N - P`` (over the second set minus the first) once some ratio is
outside the band. One backward pass gives both when the ratios are all in the band, all above
it or all below it (as they are for an execution of one trajectory); two otherwise. When the step's ``GroupStats`` arrive it adds ``-A·P``, or ``-A·(P + D)`` for A < 0.
That is the gradient a whole-group shard with advantages gives, up to float rounding: the update
does not depend on how early a run was trained. The cost is one or two gradient-sized buffers
per execution held until the step's end, which is why only the embedded trainer takes such
shards (``AlgoConfig.release``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cellrunner.gspo import PackedBatch, sequence_ratios
from base.wire import GroupStats
from base.advantages import advantage


@dataclass
class _Kept:
    group_id: str
    reward: float
    pos: torch.Tensor | None = None   # P: the gradient that counts when A > 0
    diff: torch.Tensor | None = None  # D: N - P, where N counts when A < 0; None while 0
    pos_value: float = 0.0            # Σ n w s over P's sequences (the loss is -A times it)
    diff_value: float = 0.0


class RunReleasedGrads:
    """Per-execution gradients of run-released shards, until their groups' advantages arrive."""

    def __init__(self, *, eps_low: float, eps_high: float):
        self.eps_low = eps_low
        self.eps_high = eps_high
        self._kept: dict[str, _Kept] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def clear(self) -> None:
        self._kept.clear()

    def add(self, params: list[torch.nn.Parameter], logprobs: torch.Tensor, batch: PackedBatch, *,
            execution_id: str, group_id: str, reward: float) -> tuple[int, float, float]:
        """Take one chunk of an execution's sequences; returns (backward passes, mean ratio, fraction
        of sequences outside the clip band). Two passes only when the chunk's ratios fall on both
        sides of the band's edges in a way one gradient cannot express; an execution's one
        trajectory, or ratios all in, above or below the band, take one."""
        ratio, n_tok, has = sequence_ratios(logprobs, batch)
        weighted = ratio * n_tok * batch.token_weights
        with torch.no_grad():
            high = has & (ratio > 1.0 + self.eps_high)   # counts only when A < 0
            low = has & (ratio < 1.0 - self.eps_low)     # counts only when A > 0
            pos_mask = has & ~high                       # the band and below: P's sequences
        kept = self._kept.setdefault(execution_id, _Kept(group_id, reward))
        if (kept.group_id, kept.reward) != (group_id, reward):
            raise ValueError(f"execution {execution_id}: shards disagree on its group or reward")
        neg_mask = has & ~low                            # the band and above: N's sequences
        has_pos, has_neg = bool(pos_mask.any()), bool(neg_mask.any())
        split = has_pos and has_neg and not bool(torch.equal(pos_mask, neg_mask))  # needs two passes
        passes = 0
        if has_pos:
            pos = weighted[pos_mask].sum()
            g = _flat_grad(pos, params, retain_graph=split)
            passes += 1
            kept.pos = _accumulate(kept.pos, g)
            kept.pos_value += float(pos.item())
            if not has_neg:  # every ratio below the band: N = 0, so D = -P (no second pass)
                kept.diff = _accumulate(kept.diff, -g)
                kept.diff_value -= float(pos.item())
        if has_neg and not has_pos:  # every ratio above the band: P = 0, so D = N
            neg = weighted[neg_mask].sum()
            kept.diff = _accumulate(kept.diff, _flat_grad(neg, params, retain_graph=False))
            kept.diff_value += float(neg.item())
            passes += 1
        elif split:
            diff = weighted[high].sum() - weighted[low].sum()
            kept.diff = _accumulate(kept.diff, _flat_grad(diff, params, retain_graph=False))
            kept.diff_value += float(diff.item())
            passes += 1
        n = int(has.sum().item())
        mean_ratio = float(ratio[has].mean().item()) if n else 1.0
        out_of_band = float((high | low).sum().item()) / n if n else 0.0
        return passes, mean_ratio, out_of_band

    def fold(self, params: list[torch.nn.Parameter], groups: list[GroupStats]) -> float:
        """Add every kept execution's ``-A·P`` or ``-A·(P + D)`` into ``params``' grads; forget them.

        Raise, keeping everything, if a kept execution's group is not in ``groups``: the gradient
        would be wrong without it. Returns the loss those executions add to the step.
        """
        stats = {g.group_id: g for g in groups}
        missing = sorted({k.group_id for k in self._kept.values()} - set(stats))
        if missing:
            raise ValueError(f"run-released gradients of group(s) {missing} but no GroupStats for them")
        total: torch.Tensor | None = None
        loss = 0.0
        for kept in self._kept.values():
            g = stats[kept.group_id]
            a = 0.0 if g.dropped else advantage(kept.reward, g.mean_reward, g.adv_divisor)
            if a == 0.0:
                continue
            parts = [(kept.pos, kept.pos_value)]
            if a < 0:
                parts.append((kept.diff, kept.diff_value))
            for buf, value in parts:
                if buf is not None:
                    total = buf * -a if total is None else total.add_(buf, alpha=-a)
                    loss += -a * value
        self._kept.clear()
        if total is not None:
            _add_into_grads(params, total)
        return loss


def _accumulate(into: torch.Tensor | None, g: torch.Tensor) -> torch.Tensor:
    return g if into is None else into.add_(g)


def _flat_grad(value: torch.Tensor, params: list[torch.nn.Parameter], *, retain_graph: bool) -> torch.Tensor:
    grads = torch.autograd.grad(value, params, retain_graph=retain_graph, allow_unused=True)
    return torch.cat([
        (g if g is not None else torch.zeros_like(p)).detach().reshape(-1) for g, p in zip(grads, params)
    ])


def _add_into_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        part = flat[offset : offset + n].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = part.clone()
        else:
            p.grad.add_(part)
        offset += n
