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


class _Node:
    """A radix tree node: the edge's token ids into it, its children by their edge's first id, the
    entries whose token sequence passes through it, and those whose sequence ends at it (each
    entry's sequence ends at a node)."""

    __slots__ = ("edge", "children", "keys", "ends")

    def __init__(self, edge: np.ndarray, keys: set[int], ends: set[int] | None = None) -> None:
        self.edge, self.children, self.keys, self.ends = edge, {}, keys, ends if ends is not None else set()


class RadixIndex:
    """Entry keys by token sequence: the longest prefix of a prompt that any entry holds, in time
    linear in the prompt rather than in prompt x entries (SGLang's radix cache does its matching so)."""

    def __init__(self) -> None:
        self.root = _Node(np.zeros(0, dtype=np.int64), set())

    def match(self, ids: np.ndarray) -> tuple[int, set[int]]:
        """(n, the entries holding ids[:n]) for the longest n any entry holds; (0, set()) for none."""
        node, pos, keys = self.root, 0, set()
        while pos < len(ids) and (child := node.children.get(int(ids[pos]))) is not None:
            m = common_prefix(child.edge, ids[pos:])
            pos, keys = pos + m, child.keys
            if m < len(child.edge):
                break
            node = child
        return pos, keys

    def insert(self, key: int, ids: np.ndarray) -> None:
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(int(ids[pos]))
            if child is None:
                node.children[int(ids[pos])] = _Node(ids[pos:].copy(), {key}, {key})
                return
            m = common_prefix(child.edge, ids[pos:])
            if m < len(child.edge):  # split the edge where the new sequence leaves it
                mid = _Node(child.edge[:m], set(child.keys))
                child.edge = child.edge[m:]
                mid.children[int(child.edge[0])] = child
                node.children[int(ids[pos])] = child = mid
            child.keys.add(key)
            node, pos = child, pos + m
            if pos == len(ids):
                child.ends.add(key)

    def ending_on(self, ids: np.ndarray) -> list[int]:
        """Entries whose whole sequence is a prefix of ids."""
        node, pos, out = self.root, 0, []
        while pos < len(ids) and (child := node.children.get(int(ids[pos]))) is not None:
            m = common_prefix(child.edge, ids[pos:])
            if m < len(child.edge):
                break
            node, pos = child, pos + m
            out += node.ends
        return out

    def remove(self, key: int, ids: np.ndarray) -> None:
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children[int(ids[pos])]
            child.keys.discard(key)
            child.ends.discard(key)
            if not child.keys:  # no entry passes through it, nor through anything below it
                del node.children[int(ids[pos])]
                return
            node, pos = child, pos + len(child.edge)


@dataclasses.dataclass(eq=False)
class _Entry:
    tokens: np.ndarray  # int64
    kv: KV
    nbytes: int


class PrefixCache:
    """The KV of finished requests' token sequences, bounded by bytes, least recently used out first.

    `match` takes the longest common prefix of a prompt with any entry, not only whole entries,
    found in a radix tree over the entries' token ids (`RadixIndex`): the KV of positions [0, n)
    depends on tokens [0, n) alone, so a harness's fixed system prompt and tools hit across
    executions as well as a session's earlier call (its prompt + output).
    An entry that is a prefix of a newer one is dropped, since the newer answers every lookup it
    would. Entries hold KV of one set of weights: the owner clears the cache when they change.
    Only the generation thread touches it.
    """

    def __init__(self, *, max_bytes: int, min_tokens: int) -> None:
        if max_bytes < 0 or min_tokens < 1:
            raise ValueError(f"prefix cache: want max_bytes >= 0 and min_tokens >= 1, got {max_bytes}, {min_tokens}")
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._index = RadixIndex()
        self._next_key = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[tuple[np.ndarray, KV]]:
        """(token ids, KV) of every entry, least recently used first."""
        return [(e.tokens, e.kv) for e in self._entries.values()]

    def clear(self) -> None:
        self._entries.clear()
        self._index = RadixIndex()
        self.nbytes = 0

    def match(self, tokens: list[int]) -> tuple[int, KV | None]:
        """(n, KV of tokens[:n]) for the longest cached prefix, n >= min_tokens; else (0, None)."""
        best_n, keys = self._index.match(np.asarray(tokens, dtype=np.int64))
        if not keys or best_n < self.min_tokens:
            return 0, None
        best_key = max(keys)  # the newest of the entries holding it
        self._entries.move_to_end(best_key)
        return best_n, [(k[:, :best_n], v[:, :best_n]) for k, v in self._entries[best_key].kv]

    def insert(self, tokens: list[int], kv: KV) -> None:
        """Keep a copy of `kv` (views are fine) as the KV of `tokens`, unless already held or too big."""
        ids = np.asarray(tokens, dtype=np.int64)
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        if len(ids) < self.min_tokens or nbytes > self.max_bytes:
            return
        held, keys = self._index.match(ids)
        if held == len(ids) and keys:  # held already, inside an entry at least as long
            self._entries.move_to_end(max(keys))
            return
        for key in self._index.ending_on(ids):  # the new entry answers every lookup these would
            self._drop(key)
        while self.nbytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[self._next_key] = _Entry(ids, [(k.clone(), v.clone()) for k, v in kv], nbytes)
        self._index.insert(self._next_key, ids)
        self._next_key += 1
        self.nbytes += nbytes

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._index.remove(key, entry.tokens)
        self.nbytes -= entry.nbytes
