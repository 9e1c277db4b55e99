"""The embedded engine's prefix cache: the KV of token sequences it has run, matched by longest prefix.

One cache per engine serves every session and execution on it: the KV of positions [0, n) depends
on tokens [0, n) alone, so a harness's fixed system prompt and tools hit across executions, and a
session's next call hits its own history. It holds KV of one set of weights; its owner clears it
when the weights change (SGLang flushes its radix cache on a weight update the same way).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values), each [kv_heads, tokens, head_dim]: one sequence's cache, no batch axis."""


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


@dataclasses.dataclass(eq=False)
class _Entry:
    tokens: np.ndarray  # int64
    kv: KV
    nbytes: int


class PrefixCache:
    """The KV of finished requests' token sequences, bounded by bytes, least recently used out first.

    `match` takes the longest common prefix of a prompt with any entry, not only whole entries:
    the KV of positions [0, n) depends on tokens [0, n) alone, so a harness's fixed system prompt
    and tools hit across executions as well as a session's earlier call (its prompt + output).
    An entry that is a prefix of a newer one is dropped, since the newer answers every lookup it
    would. Entries hold KV of one set of weights: the owner clears the cache when they change.
    Only the generation thread touches it.
    """

    def __init__(self, *, max_bytes: int, min_tokens: int) -> None:
        if max_bytes < 0 or min_tokens < 1:
            raise ValueError(f"prefix cache: want max_bytes >= 0 and min_tokens >= 1, got {max_bytes}, {min_tokens}")
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._next_key = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[tuple[np.ndarray, KV]]:
        """(token ids, KV) of every entry, least recently used first."""
        return [(e.tokens, e.kv) for e in self._entries.values()]

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def match(self, tokens: list[int]) -> tuple[int, KV | None]:
        """(n, KV of tokens[:n]) for the longest cached prefix, n >= min_tokens; else (0, None)."""
        ids = np.asarray(tokens, dtype=np.int64)
        best_key, best_n = None, 0
        for key, entry in self._entries.items():
            n = common_prefix(ids, entry.tokens)
            if n > best_n:
                best_key, best_n = key, n
        if best_key is None or best_n < self.min_tokens:
            return 0, None
        self._entries.move_to_end(best_key)
        return best_n, [(k[:, :best_n], v[:, :best_n]) for k, v in self._entries[best_key].kv]

    def insert(self, tokens: list[int], kv: KV) -> None:
        """Keep a copy of `kv` (views are fine) as the KV of `tokens`, unless already held or too big."""
        ids = np.asarray(tokens, dtype=np.int64)
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        if len(ids) < self.min_tokens or nbytes > self.max_bytes:
            return
        for key, entry in list(self._entries.items()):
            n = common_prefix(ids, entry.tokens)
            if n == len(ids):  # held already, inside an entry at least as long
                self._entries.move_to_end(key)
                return
            if n == len(entry.tokens):  # the new entry answers every lookup this one would
                self._drop(key)
        while self.nbytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[self._next_key] = _Entry(ids, [(k.clone(), v.clone()) for k, v in kv], nbytes)
        self._next_key += 1
        self.nbytes += nbytes

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
