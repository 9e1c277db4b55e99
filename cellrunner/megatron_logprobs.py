"""Per-token log-probs from vocab-parallel logits, a chunk of tokens at a time.

The trainer needs log pi(token) at every position of sequences of 20k-100k tokens. Taking them
with megatron's ``vocab_parallel_cross_entropy`` on the whole ``[tokens, vocab/TP]`` block costs
several full-vocabulary float32 copies: the float32 cast, the temperature's quotient, the masked
copy, the contiguous transpose it asks for (it works in place), and the softmax it keeps for the
backward pass. At 32k tokens and Qwen3's 151,936 rows that is 20 GB each.

Here the forward pass takes each chunk of ``chunk`` tokens to float32, reduces it to its
log-sum-exp and its target's logit (max, sum and target summed over the TP group, as
megatron's cross entropy does) and drops it: it keeps two floats a token. The backward pass
rebuilds each chunk's softmax from the logits (which autograd holds anyway) and writes the chunk's
gradient, ``(onehot - softmax) / T`` times the incoming gradient, into the logits' gradient in the
logits' dtype. At most one chunk's full-vocabulary float32 block exists at any time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, inv_temp: float,
                pad_cols: torch.Tensor | None, chunk: int, group: Any) -> torch.Tensor:
        n, part = logits.shape
        start = (dist.get_rank(group) * part) if group is not None else 0
        local = targets - start
        inside = (local >= 0) & (local < part)
        local = local.clamp(0, part - 1)
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = logits[s:e].to(torch.float32, copy=True).mul_(inv_temp)  # the one float32 block
            if pad_cols is not None:
                z.masked_fill_(pad_cols, float("-inf"))
            top = z.max(dim=1).values
            if group is not None:
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            z.sub_(top.unsqueeze(1))
            target = z.gather(1, local[s:e].unsqueeze(1)).squeeze(1) * inside[s:e]
            total = z.exp_().sum(dim=1)
            if group is not None:
                both = torch.stack([target, total])
                dist.all_reduce(both, group=group)
                target, total = both[0], both[1]
            log_total = total.log()
            out[s:e] = target - log_total
            lse[s:e] = top + log_total
            del z
        ctx.save_for_backward(logits, local, inside, lse)
        ctx.inv_temp, ctx.pad_cols, ctx.chunk = inv_temp, pad_cols, chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        logits, local, inside, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        n = logits.shape[0]
        g = grad_out.to(torch.float32)
        for s in range(0, n, ctx.chunk):
            e = min(n, s + ctx.chunk)
            p = logits[s:e].to(torch.float32, copy=True).mul_(ctx.inv_temp)
            if ctx.pad_cols is not None:
                p.masked_fill_(ctx.pad_cols, float("-inf"))
            p.sub_(lse[s:e].unsqueeze(1)).exp_()  # softmax at the temperature; padded columns 0
            p.mul_(-g[s:e].unsqueeze(1))
            p.scatter_add_(1, local[s:e].unsqueeze(1), (g[s:e] * inside[s:e]).unsqueeze(1))
            grad[s:e] = p.mul_(ctx.inv_temp)
            del p
        return grad, None, None, None, None, None


def chunked_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float,
                           pad_cols: torch.Tensor | None, chunk_tokens: int, group: Any = None) -> torch.Tensor:
    """log pi of each next token, ``[B, L-1]``, from vocab-parallel logits ``[B, L, V/tp]``
    (this rank's columns; ``group``: the TP group, None for TP 1) at ``temperature``;
    ``pad_cols`` marks this rank's padded vocabulary columns (masked out)."""
    b, length, part = logits.shape
    if targets.shape != (b, length - 1):
        raise ValueError(f"targets: want shape {(b, length - 1)}, got {tuple(targets.shape)}")
    # Score all L positions of the flat [B*L, V] view (no copy of the logits); the last position
    # of each row has no next token and is cut off below (its gradient is zero).
    full = torch.zeros((b, length), dtype=torch.long, device=targets.device)
    full[:, :-1] = targets
    flat = _ChunkedLogprobs.apply(logits.reshape(b * length, part), full.reshape(-1), 1.0 / temperature,
                                  pad_cols, int(chunk_tokens), group)
    return flat.view(b, length)[:, :-1]
