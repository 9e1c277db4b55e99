"""Continuous batching for the embedded engine: requests, sampling, the batched KV cache, the loop.

One generation thread owns the model and the batch. Requests join at decode-iteration boundaries
(one left-padded prefill for the newcomers, whose KV rows are then merged into the running batch)
and leave as soon as they finish. A finished request's KV goes to the `PrefixCache`; a newcomer
whose prompt starts with cached tokens prefills only the rest, on its own row. Weight swaps and model install/release run as control ops on
the same thread between iterations, so a forward pass never sees half-copied weights. HTTP lives
in `engine.py`; this module knows nothing of it beyond building the response body.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from cellrunner.prefix_cache import KV, PrefixCache, common_prefix

logger = logging.getLogger(__name__)

# Padded tokens one prefill forward may hold: a long prompt is prefilled on its own instead of
# padding every short newcomer up to its length.
PREFILL_TOKEN_BUDGET = 16384
# New tokens per forward when a prompt extends cached KV: a query chunk against all keys needs an
# explicit [chunk, keys] mask, so chunks keep it small however long the prompt.
EXTEND_CHUNK_TOKENS = 4096
TOP_K_ALL = -1



@dataclasses.dataclass(eq=False)
class GenRequest:
    """One /generate call, from admission to its response. Mutated only by the generation thread,
    except `abort_message`, which any thread may set to ask for an abort at the next boundary."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float  # 0 = greedy
    top_p: float
    top_k: int  # TOP_K_ALL = whole vocabulary
    stop_token_ids: frozenset[int]
    return_logprob: bool
    on_done: Callable[[int, dict[str, Any]], None]  # (HTTP status, JSON body); called exactly once
    arrival_s: float = dataclasses.field(default_factory=time.monotonic)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    version_spans: list[list[int]] = dataclasses.field(default_factory=list)  # [version, start, end)
    abort_message: str | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    kv_epoch: int = -1  # the weights epoch its KV was computed under (BatchLoop._epoch)

    def push(self, token: int, logprob: float, version: int) -> dict[str, Any] | None:
        """Record one sampled token; return the finish reason if the request is now done."""
        n = len(self.output_ids)
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        if self.version_spans and self.version_spans[-1][0] == version:
            self.version_spans[-1][2] = n + 1
        else:
            self.version_spans.append([version, n, n + 1])
        # The matched stop token stays in output_ids: the policy generated it, the trainer trains on it.
        if token in self.stop_token_ids:
            return {"type": "stop", "matched": token}
        if n + 1 >= self.max_new_tokens:
            return {"type": "length", "length": self.max_new_tokens}
        return None

    def body(self, finish_reason: dict[str, Any], current_version: int | None) -> dict[str, Any]:
        """The SGLang-shaped response. `weight_version` is the version that produced the first output
        token (the engine's current version if none was produced); `weight_versions` lists every
        version used as half-open spans over output positions, as a request can outlive a swap."""
        version = self.version_spans[0][0] if self.version_spans else current_version
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": finish_reason,
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "weight_version": None if version is None else str(version),
            "weight_versions": [{"version": str(v), "start": s, "end": e} for v, s, e in self.version_spans],
            "e2e_latency": time.monotonic() - self.arrival_s,
        }
        if self.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(self.logprobs, self.output_ids)]
        return {"output_ids": list(self.output_ids), "meta_info": meta}


def sample(
    logits: torch.Tensor, reqs: list[GenRequest], generator: torch.Generator
) -> tuple[list[int], list[float]]:
    """Pick one token per row of `logits` [B, V]; return tokens and their log-probs.

    The log-prob is log_softmax(logits / T) over the full vocabulary, before top-k/top-p, and
    unscaled log_softmax(logits) for greedy rows (T == 0) -- SGLang's behaviour. A trainer that
    samples at T = 1 (Gyre's default) therefore compares against plain log_softmax(logits).
    """
    temps = torch.tensor([r.temperature for r in reqs], dtype=logits.dtype)
    greedy = temps == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        rows = (~greedy).nonzero()[:, 0]
        picked = [reqs[i] for i in rows.tolist()]
        tokens[rows] = _sample_filtered(logp[rows], picked, generator)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def _sample_filtered(logp: torch.Tensor, reqs: list[GenRequest], generator: torch.Generator) -> torch.Tensor:
    if all(r.top_k == TOP_K_ALL and r.top_p >= 1.0 for r in reqs):
        return torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    probs = sorted_logp.exp()
    vocab = probs.shape[-1]
    top_k = torch.tensor([vocab if r.top_k == TOP_K_ALL else r.top_k for r in reqs])
    top_p = torch.tensor([r.top_p for r in reqs], dtype=probs.dtype)
    keep = torch.arange(vocab)[None, :] < top_k[:, None]
    # Keep a token while the mass before it is under top_p, so the most likely token always stays.
    keep &= (probs.cumsum(dim=-1) - probs) < top_p[:, None]
    choice = torch.multinomial(probs * keep, 1, generator=generator)
    return order.gather(1, choice)[:, 0]


def _pad_left(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class KVBatch:
    """The running rows and their KV cache, left-padded so every row ends at the same column.

    Row i's real tokens are the columns where `mask[i]` is 1; `positions[i]` is the RoPE position
    of its next input token, so padding never shifts positions. HF's DynamicCache holds the
    tensors; it is rebuilt from them whenever rows join or leave.
    """

    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self.reqs: list[GenRequest] = []
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._positions = torch.zeros(0, dtype=torch.long)
        self._last = torch.zeros(0, dtype=torch.long)  # each row's newest token, the next input

    def prefill(self, model: torch.nn.Module, new: list[GenRequest]) -> torch.Tensor:
        """Run the prompts of `new` and merge their rows; return next-token logits [len(new), V]."""
        lengths = [len(r.input_ids) for r in new]
        width = max(lengths)
        ids = torch.zeros(len(new), width, dtype=torch.long)
        mask = torch.zeros(len(new), width, dtype=torch.long)
        for i, r in enumerate(new):
            ids[i, width - lengths[i] :] = torch.tensor(r.input_ids)
            mask[i, width - lengths[i] :] = 1
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
        )
        self._merge(new, cache, mask, torch.tensor(lengths))
        return out.logits[:, -1]

    def extend(self, model: torch.nn.Module, req: GenRequest, past: KV) -> torch.Tensor:
        """Prefill `req` on a row of its own on top of `past`, the KV of its first tokens, in chunks
        of EXTEND_CHUNK_TOKENS; merge the row; return its next-token logits [1, V]."""
        ids, cached = req.input_ids, past[0][0].shape[1]
        if not 0 < cached < len(ids):
            raise ValueError(f"extend: {cached} cached tokens for a prompt of {len(ids)}")
        cache = DynamicCache(ddp_cache_data=[(k[None], v[None]) for k, v in past])
        for start in range(cached, len(ids), EXTEND_CHUNK_TOKENS):
            end = min(start + EXTEND_CHUNK_TOKENS, len(ids))
            out = model(
                input_ids=torch.tensor([ids[start:end]]), attention_mask=torch.ones(1, end, dtype=torch.long),
                position_ids=torch.arange(start, end)[None], cache=cache, use_cache=True, logits_to_keep=1,
            )
        self._merge([req], cache, torch.ones(1, len(ids), dtype=torch.long), torch.tensor([len(ids)]))
        return out.logits[:, -1]

    def row_kv(self, row: int, num_tokens: int) -> KV:
        """Views of row `row`'s KV over its last `num_tokens` columns (its real tokens end there)."""
        return [(k[row, :, -num_tokens:], v[row, :, -num_tokens:]) for k, v, _ in self._cache]

    def decode(self, model: torch.nn.Module) -> torch.Tensor:
        """One decode iteration over every row; return next-token logits [B, V]."""
        self._mask = torch.cat([self._mask, self._mask.new_ones(len(self.reqs), 1)], dim=1)
        out = model(
            input_ids=self._last[:, None],
            attention_mask=self._mask,
            position_ids=self._positions[:, None],
            cache=self._cache,
            use_cache=True,
        )
        self._positions = self._positions + 1
        return out.logits[:, -1]

    def set_last(self, rows: slice, tokens: list[int]) -> None:
        self._last[rows] = torch.tensor(tokens, dtype=torch.long)

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in order); drop left-padding columns no kept row needs."""
        if len(rows) == len(self.reqs):
            return
        if not rows:
            self._clear()  # frees the KV tensors
            return
        index = torch.tensor(rows, dtype=torch.long)
        self.reqs = [self.reqs[i] for i in rows]
        mask = self._mask[index]
        start = int(mask.any(dim=0).nonzero()[0, 0])
        self._mask = mask[:, start:]
        kv = [(k[index, :, start:], v[index, :, start:]) for k, v, _ in self._cache]
        self._cache = DynamicCache(ddp_cache_data=kv)
        self._positions = self._positions[index]
        self._last = self._last[index]

    def _merge(self, new: list[GenRequest], cache: DynamicCache, mask: torch.Tensor, lengths: torch.Tensor) -> None:
        last = torch.zeros(len(new), dtype=torch.long)
        if not self.reqs:
            self.reqs, self._cache, self._mask, self._positions, self._last = list(new), cache, mask, lengths, last
            return
        width = max(mask.shape[1], self._mask.shape[1])
        merged = [
            (torch.cat([_pad_left(k0, width, 2), _pad_left(k1, width, 2)]),
             torch.cat([_pad_left(v0, width, 2), _pad_left(v1, width, 2)]))
            for (k0, v0, _), (k1, v1, _) in zip(self._cache, cache)
        ]
        self._cache = DynamicCache(ddp_cache_data=merged)
        self._mask = torch.cat([_pad_left(self._mask, width, 1), _pad_left(mask, width, 1)])
        self._positions = torch.cat([self._positions, lengths])
        self._last = torch.cat([self._last, last])
        self.reqs.extend(new)


class BatchLoop:
    """The generation thread: admits waiting requests, runs prefill and decode iterations, answers.

    Any thread may submit, abort, count or queue a control op; the model, the KVBatch, the prefix
    cache and the sampler's generator are touched only by the loop thread. `_cond` guards the rest.
    `prefix_cache_bytes` 0 turns the prefix cache off.
    """

    def __init__(
        self, *, max_running: int, seed: int, name: str, prefix_cache_bytes: int = 0, prefix_cache_min_tokens: int = 1,
        share_prefill: bool = True, kv_tier: Any = None,
    ) -> None:
        """`share_prefill` False: newcomers that share a prefix each compute it, and only finished
        requests are cached (the engine before it shared; kept for bench.kv_reuse's comparison).
        `kv_tier`: a `cellrunner.kv_tier.KVTier` the engines of a run share, or None: a prompt the
        prefix cache misses is looked up there, and `spill_to_tier` writes the cache to it."""
        self._max_running = max_running
        self._share_prefill = share_prefill
        self._tier = kv_tier
        self._num_tier_tokens = 0  # prompt tokens whose KV came from the tier
        self._prefix = (
            PrefixCache(max_bytes=prefix_cache_bytes, min_tokens=prefix_cache_min_tokens) if prefix_cache_bytes else None
        )
        # Bumped whenever the weights change: KV computed under an older epoch is never cached.
        self._epoch = 0
        self._num_prefill_tokens = 0  # prompt tokens run through the model (cache hits excluded)
        self._generator = torch.Generator().manual_seed(seed)
        self._cond = threading.Condition()
        self._waiting: collections.deque[GenRequest] = collections.deque()
        self._active: set[GenRequest] = set()  # admitted and not answered: waiting + running
        self._ops: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._accepting = False
        self._stopping = False
        self._num_aborted = 0
        self._model: torch.nn.Module | None = None
        self._version: int | None = None
        self._batch = KVBatch()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ------------------------------------------------------------ any thread

    def start(self) -> None:
        self._thread.start()

    @property
    def version(self) -> int | None:
        with self._cond:
            return self._version

    @property
    def num_aborted(self) -> int:
        with self._cond:
            return self._num_aborted

    def num_active(self) -> int:
        with self._cond:
            return len(self._active)

    def num_output_tokens(self) -> int:
        """Tokens generated so far by the requests still active (a load figure, like SGLang's)."""
        with self._cond:
            return sum(len(r.output_ids) for r in self._active)

    def num_prefill_tokens(self) -> int:
        """Prompt tokens prefilled since start, without the cached ones and without padding."""
        with self._cond:
            return self._num_prefill_tokens

    def num_tier_tokens(self) -> int:
        """Prompt tokens whose KV was read from the shared tier since start."""
        with self._cond:
            return self._num_tier_tokens

    def spill_to_tier(self) -> int:
        """Write every prefix-cache entry to the shared tier under the current weight version (a
        draining cell: its sessions' next calls go to other cells); return the pages written."""

        def op() -> int:
            if self._tier is None or self._prefix is None or self._version is None:
                return 0
            return sum(self._tier.put(self._version, tokens.tolist(), kv) for tokens, kv in self._prefix.entries())

        return self.call(op)

    def set_accepting(self, accepting: bool) -> None:
        with self._cond:
            self._accepting = accepting and self._model is not None and not self._stopping

    def accepting(self) -> bool:
        with self._cond:
            return self._accepting

    def submit(self, req: GenRequest) -> bool:
        """Queue `req`; False (and `req` untouched) when not accepting."""
        with self._cond:
            if not self._accepting:
                return False
            self._active.add(req)
            self._waiting.append(req)
            self._cond.notify_all()
            return True

    def abort(self, *, message: str, rid: str | None = None, req: GenRequest | None = None) -> None:
        """Abort requests by rid, by identity, or all of them (neither given)."""
        queued = []
        with self._cond:
            for r in self._active:
                if (rid is None and req is None) or r.rid == rid or r is req:
                    r.abort_message = message
                    if r in self._waiting:
                        queued.append(r)
            for r in queued:
                self._waiting.remove(r)
            self._cond.notify_all()
        for r in queued:
            self._finish(r, {"type": "abort", "message": "Abort in waiting queue"})

    def wait_idle(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._active, timeout=timeout_s)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the loop thread between iterations and return its result (or raise its error)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                raise RuntimeError("engine loop is not running")
            self._ops.append((fn, future))
            self._cond.notify_all()
        return future.result()

    def install(self, model: torch.nn.Module, version: int) -> None:
        def op() -> None:
            self._model, self._version, self._batch = model, version, KVBatch()
            self._new_epoch()

        self.call(op)

    def load_weights(self, load: Callable[[torch.nn.Module], int]) -> None:
        """Swap weights in place: `load(model)` copies them and returns the new weight version."""

        def op() -> None:
            if self._model is None:
                raise RuntimeError("no model loaded: resume() first")
            self._new_epoch()  # first: a failed load may have copied some tensors already
            self._version = load(self._model)

        self.call(op)

    def release(self) -> None:
        def op() -> None:
            self._model, self._version, self._batch = None, None, KVBatch()
            self._new_epoch()

        self.call(op)

    def clear_prefix_cache(self) -> None:
        self.call(self._new_epoch)

    def prefix_cache_usage(self) -> tuple[int, int]:
        """(entries, bytes) of the prefix cache; (0, 0) when it is off."""
        return self.call(lambda: (0, 0) if self._prefix is None else (len(self._prefix), self._prefix.nbytes))

    def stop(self) -> None:
        with self._cond:
            self._stopping, self._accepting = True, False
            self._cond.notify_all()
        self.abort(message="engine stopped")
        if self._thread.is_alive():
            self._thread.join()

    # ------------------------------------------------------------ loop thread

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work)
                ops, self._ops = self._ops, []
            for fn, future in ops:
                try:
                    future.set_result(fn())
                except Exception as e:  # the caller gets it from call()
                    future.set_exception(e)
            admitted = self._admit()  # after the ops, which may have installed or dropped the model
            if admitted is None:
                self._shutdown()
                return
            if admitted or self._batch.reqs:
                self._step(admitted)

    def _has_work(self) -> bool:  # under _cond
        return bool(self._stopping or self._ops or self._batch.reqs or (self._waiting and self._model is not None))

    def _admit(self) -> list[GenRequest] | None:
        """Take the waiting requests that join this iteration; None when the loop must stop."""
        with self._cond:
            if self._stopping:
                return None
            if self._model is None:
                return []
            taken: list[GenRequest] = []
            width = 0
            while self._waiting and len(self._batch.reqs) + len(taken) < self._max_running:
                w = max(width, len(self._waiting[0].input_ids))
                if taken and w * (len(taken) + 1) > PREFILL_TOKEN_BUDGET:
                    break
                taken.append(self._waiting.popleft())
                width = w
            return taken

    def _step(self, admitted: list[GenRequest]) -> None:
        try:
            with torch.inference_mode():
                self._drop_aborted()
                new = [r for r in admitted if not self._finish_early(r)]
                if new:
                    logits = self._prefill(new)
                    self._advance(logits, start=len(self._batch.reqs) - len(new))
                if self._batch.reqs:
                    self._advance(self._batch.decode(self._model), start=0)
        except Exception as e:  # a bug or OOM must answer every caller, not hang them
            logger.exception("engine iteration failed; failing %s requests", len(self._batch.reqs) + len(admitted))
            error = {"error": {"message": f"engine error: {e}", "type": "internal_error"}}
            for r in admitted + self._batch.reqs:
                self._complete(r, 500, error)
            self._batch = KVBatch()

    def _new_epoch(self) -> None:
        self._epoch += 1
        if self._prefix is not None:
            self._prefix.clear()

    def _prefill(self, new: list[GenRequest]) -> torch.Tensor:
        """Prefill `new` and merge their rows; return the logits in merge order.

        With the prefix cache on, each prompt's KV goes into the cache as soon as it is computed
        (SGLang caches unfinished requests the same way), and a newcomer whose prompt shares a
        long prefix with another newcomer waits until that one's KV is in: the executions of a
        group start at once with the same harness prompt, and would otherwise each compute it
        (SGLang's scheduler holds such requests back for the same reason). So in each round the
        prompts that share no uncached prefix with each other run: cache hits extend their cached
        KV one by one, the rest share one padded batch.
        """
        logits: list[torch.Tensor] = []
        pending = list(new)
        while pending:
            fresh, hits, later = self._plan_round(pending)
            if fresh:
                logits.append(self._batch.prefill(self._model, fresh))
                first = len(self._batch.reqs) - len(fresh)
                for i, r in enumerate(fresh):
                    self._keep_prompt_kv(first + i, r)
            for r, past in hits:
                logits.append(self._batch.extend(self._model, r, past))
                self._keep_prompt_kv(len(self._batch.reqs) - 1, r)
            pending = later
        with self._cond:
            self._num_prefill_tokens += sum(len(r.input_ids) - r.cached_tokens for r in new)
        return torch.cat(logits)

    def _plan_round(
        self, pending: list[GenRequest]
    ) -> tuple[list[GenRequest], list[tuple[GenRequest, KV]], list[GenRequest]]:
        """(fresh prompts, cache hits with their KV, prompts that wait for this round's KV)."""
        fresh: list[GenRequest] = []
        hits: list[tuple[GenRequest, KV]] = []
        later: list[GenRequest] = []
        running: list[np.ndarray] = []  # the prompts this round computes
        for r in pending:
            r.kv_epoch = self._epoch
            # One token at least must run through the model to give the next-token logits.
            n, past = (0, None) if self._prefix is None else self._prefix.match(r.input_ids[:-1])
            if self._tier is not None and n < len(r.input_ids) - 1:
                n, past = self._from_tier(r, n, past)
            ids = np.asarray(r.input_ids[:-1], dtype=np.int64)
            shared = max((common_prefix(ids, other) for other in running), default=0)
            if self._share_prefill and self._prefix is not None and shared >= self._prefix.min_tokens and shared > n:
                later.append(r)  # another newcomer computes the longer prefix this round
                continue
            running.append(ids)
            if past is None:
                fresh.append(r)
            else:
                r.cached_tokens = n
                hits.append((r, past))
        return fresh, hits, later

    def _from_tier(self, r: GenRequest, n: int, past: KV | None) -> tuple[int, KV | None]:
        """The tier's KV of the prompt's head where it holds more than the local cache (its
        pages are keyed by weight version: KV of other weights is never read); kept locally too."""
        got, kv = self._tier.get(self._version, r.input_ids)
        if kv is None or got <= n:
            return n, past
        if self._prefix is not None:
            self._prefix.insert(r.input_ids[:got], kv)
        with self._cond:
            self._num_tier_tokens += got
        return got, kv

    def _keep_prompt_kv(self, row: int, r: GenRequest) -> None:
        if self._prefix is not None and self._share_prefill:
            self._prefix.insert(r.input_ids, self._batch.row_kv(row, len(r.input_ids)))

    def _keep_kv(self, row: int, r: GenRequest) -> None:
        """Put a finishing row's KV in the prefix cache: its prompt and every output token but
        the last, which was sampled and never run (SGLang caches the same)."""
        if self._prefix is None or r.kv_epoch != self._epoch or not r.output_ids:
            return
        tokens = r.input_ids + r.output_ids[:-1]
        self._prefix.insert(tokens, self._batch.row_kv(row, len(tokens)))

    def _finish_early(self, r: GenRequest) -> bool:
        """Answer a just-admitted request that needs no forward pass; True if answered."""
        if r.abort_message is not None:
            self._finish(r, {"type": "abort", "message": r.abort_message})
        elif r.max_new_tokens == 0:
            self._finish(r, {"type": "length", "length": 0})
        else:
            return False
        return True

    def _drop_aborted(self) -> None:
        keep = []
        for i, r in enumerate(self._batch.reqs):
            if r.abort_message is None:
                keep.append(i)
            else:
                self._keep_kv(i, r)
                self._finish(r, {"type": "abort", "message": r.abort_message})
        self._batch.keep(keep)

    def _advance(self, logits: torch.Tensor, *, start: int) -> None:
        """Sample the next token of rows start.. from `logits`; answer and drop finished rows."""
        rows = self._batch.reqs[start:]
        tokens, logprobs = sample(logits, rows, self._generator)
        self._batch.set_last(slice(start, None), tokens)
        keep = list(range(start))
        for i, (r, token, logprob) in enumerate(zip(rows, tokens, logprobs)):
            reason = r.push(token, logprob, self._version)
            if reason is None:
                keep.append(start + i)
            else:
                self._keep_kv(start + i, r)
                self._finish(r, reason)
        self._batch.keep(keep)

    def _shutdown(self) -> None:
        for r in self._batch.reqs:
            self._finish(r, {"type": "abort", "message": r.abort_message or "engine stopped"})
        self._model, self._batch = None, KVBatch()
        with self._cond:
            ops, self._ops = self._ops, []
        for _, future in ops:
            future.set_exception(RuntimeError("engine loop stopped"))

    def _finish(self, r: GenRequest, reason: dict[str, Any]) -> None:
        self._complete(r, 200, r.body(reason, self._version))

    def _complete(self, r: GenRequest, status: int, body: dict[str, Any]) -> None:
        with self._cond:
            if r not in self._active:
                return  # already answered
            self._active.discard(r)
            if status == 200 and body["meta_info"]["finish_reason"]["type"] == "abort":
                self._num_aborted += 1
            self._cond.notify_all()
        r.on_done(status, body)
