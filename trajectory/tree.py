"""The trajectory tree: the calls of one execution merged into a prefix tree over token ids.

Each non-side CallRecord is inserted as the path ``prompt_ids + output_ids``. A call whose prompt
extends an earlier call's prompt + output walks that path and continues it; a call that diverges
(compaction rewrote history, a sub-agent started, the template dropped thinking) branches off at
the first differing token. Every root-to-leaf chain is a *trajectory*.

Positions are either *policy* tokens (some call generated them; we keep which call, so its
lineage and weight version, and its behaviour logprob) or *context* (prompt, tool results, system
text). When a later call generates a token at a position that already is a policy token (a
retried call regenerating the same output), the first insertion wins: its call and logprob stay.
"First" is arrival order, which is the order of the processor's log, so a replay rebuilds the
same tree. A position first seen as context becomes policy when a later call generates it.

Storage is a compressed trie: an ``Edge`` is a run of positions with no branch inside, held as
three numpy arrays (token ids, generating call or -1, logprob), so memory and insert time are
linear in the tokens, not one Python object per token. Every call ends exactly at an edge end
(the edge is split there), which makes leaves and their calls easy to find.

This module owns the tree only; which trajectories to keep is ``sampling``, turning them into
training sequences is ``samples``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from base.wire import CallRecord, Lineage

TrajectoryKind = Literal["main", "main-summary", "sub-agent", "sub-agent-summary"]

KIND_PRIORITY: dict[str, int] = {"main": 0, "main-summary": 1, "sub-agent": 2, "sub-agent-summary": 3}
"""Lower is kept first (bounded sampling). ``side`` calls are not trajectories at all."""

CONTEXT = -1
"""The ``calls`` entry of a context position."""

_TOKEN_DTYPE = np.int32
_MAX_TOKEN_ID = np.iinfo(_TOKEN_DTYPE).max


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What the tree remembers of one inserted call; policy positions point at one of these."""

    call_id: str
    call_index: int
    lineage: Lineage
    agent_id: str
    weight_version: int


class Edge:
    """A run of tree positions with no branch inside.

    ``tokens[i]`` is the token id, ``calls[i]`` the index (into ``TokenTree.calls``) of the call
    that generated it or ``CONTEXT``, ``logprobs[i]`` its behaviour logprob (0.0 for context).
    ``children`` maps the first token of each child edge to it; ``end_calls`` are the calls
    whose path ends exactly at this edge's last position.
    """

    __slots__ = ("tokens", "calls", "logprobs", "children", "end_calls")

    def __init__(
        self,
        tokens: np.ndarray,
        calls: np.ndarray,
        logprobs: np.ndarray,
        children: dict[int, Edge] | None = None,
        end_calls: list[int] | None = None,
    ) -> None:
        self.tokens = tokens
        self.calls = calls
        self.logprobs = logprobs
        self.children: dict[int, Edge] = children if children is not None else {}
        self.end_calls: list[int] = end_calls if end_calls is not None else []

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_policy(self) -> int:
        return int(np.count_nonzero(self.calls != CONTEXT))

    def policy_mask(self) -> np.ndarray:
        """int8 per position: 1 for a policy token, 0 for context."""
        return (self.calls != CONTEXT).astype(np.int8)

    def split(self, at: int) -> None:
        """Keep positions ``[:at]`` here and move ``[at:]`` (with the children) to a new child."""
        tail = Edge(
            self.tokens[at:].copy(),
            self.calls[at:].copy(),
            self.logprobs[at:].copy(),
            self.children,
            self.end_calls,
        )
        self.tokens = self.tokens[:at].copy()
        self.calls = self.calls[:at].copy()
        self.logprobs = self.logprobs[:at].copy()
        self.children = {int(tail.tokens[0]): tail}
        self.end_calls = []


@dataclass(frozen=True, slots=True, eq=False)
class Trajectory:
    """One root-to-leaf chain of a tree.

    ``kind`` is the lineage of the calls that end at the leaf (the deepest call of the chain; a
    compaction summary branch is ``main-summary`` although it carries the main calls before it).
    ``first_call_index`` / ``first_call_id`` name the earliest of those calls.
    """

    kind: TrajectoryKind
    edges: tuple[Edge, ...]
    num_tokens: int
    num_policy_tokens: int
    first_call_index: int
    first_call_id: str

    def token_ids(self) -> list[int]:
        return np.concatenate([e.tokens for e in self.edges]).tolist()


class TokenTree:
    """The prefix tree of one execution's calls; see the module docstring."""

    def __init__(self, execution_id: str) -> None:
        self.execution_id = execution_id
        self.root = Edge(
            np.empty(0, _TOKEN_DTYPE), np.empty(0, np.int32), np.empty(0, np.float64)
        )
        self.calls: list[CallInfo] = []
        self._call_refs: dict[str, int] = {}
        self.num_side_calls = 0
        self.num_hung_up_calls = 0
        self.num_duplicate_calls = 0
        self.num_tokens = 0
        """Positions in the tree (shared prefixes counted once)."""

    @property
    def num_calls(self) -> int:
        """Calls inserted (side calls and duplicates not included)."""
        return len(self.calls)

    def insert(self, record: CallRecord) -> bool:
        """Add one call; False when it is a side call or a call_id already inserted.

        Raises ValueError for token ids outside 0..2**31-1 (the tree stores int32).
        """
        if record.lineage == "side":
            self.num_side_calls += 1
            return False
        if record.finish_reason == "abort" and not record.output_ids:
            self.num_hung_up_calls += 1  # the harness hung up before any output: no new path
            return False
        if record.call_id in self._call_refs:
            self.num_duplicate_calls += 1
            return False
        path = _as_tokens(record.prompt_ids, record.output_ids)
        ref = len(self.calls)
        self.calls.append(
            CallInfo(
                call_id=record.call_id,
                call_index=record.call_index,
                lineage=record.lineage,
                agent_id=record.agent_id,
                weight_version=record.weight_version,
            )
        )
        self._call_refs[record.call_id] = ref
        out_start = len(record.prompt_ids)
        logprobs = np.asarray(record.output_logprobs, dtype=np.float64)
        self._walk(path, out_start, ref, logprobs)
        return True

    def _walk(self, path: np.ndarray, out_start: int, ref: int, logprobs: np.ndarray) -> None:
        node = self.root
        pos = 0
        n = len(path)
        while pos < n:
            child = node.children.get(int(path[pos]))
            if child is None:
                child = _new_edge(path, pos, out_start, ref, logprobs)
                node.children[int(path[pos])] = child
                self.num_tokens += len(child)
                node = child
                break
            m = _common_prefix(child.tokens, path, pos)
            if m < len(child):
                child.split(m)
            lo, hi = max(pos, out_start), pos + m
            if lo < hi:  # this call generated positions [lo, hi) of the edge; first one wins
                seg = child.calls[lo - pos : hi - pos]
                free = seg == CONTEXT
                if free.any():
                    seg[free] = ref
                    child.logprobs[lo - pos : hi - pos][free] = logprobs[lo - out_start : hi - out_start][free]
            node = child
            pos += m
        node.end_calls.append(ref)

    def trajectories(self) -> list[Trajectory]:
        """Every root-to-leaf chain, in depth-first order of insertion."""
        out: list[Trajectory] = []
        stack: list[tuple[Edge, tuple[Edge, ...], int, int]] = [
            (child, (child,), len(child), child.num_policy)
            for child in reversed(self.root.children.values())
        ]
        while stack:
            edge, chain, num_tokens, num_policy = stack.pop()
            if not edge.children:
                out.append(self._trajectory(chain, num_tokens, num_policy))
                continue
            for child in reversed(edge.children.values()):
                stack.append(
                    (child, chain + (child,), num_tokens + len(child), num_policy + child.num_policy)
                )
        return out

    def _trajectory(self, chain: tuple[Edge, ...], num_tokens: int, num_policy: int) -> Trajectory:
        leaf_calls = [self.calls[r] for r in chain[-1].end_calls]
        assert leaf_calls, "every leaf is the end of some call"
        # Several calls can end at one leaf (identical retries); the most important lineage names it.
        kind = min((c.lineage for c in leaf_calls), key=KIND_PRIORITY.__getitem__)
        first = min(leaf_calls, key=lambda c: (c.call_index, c.call_id))
        return Trajectory(
            kind=kind,  # type: ignore[arg-type]  # never "side": side calls are not inserted
            edges=chain,
            num_tokens=num_tokens,
            num_policy_tokens=num_policy,
            first_call_index=first.call_index,
            first_call_id=first.call_id,
        )

    def dump(self) -> str:
        """The tree as indented text, policy tokens starred; for tests and debugging."""
        lines: list[str] = []

        def walk(edge: Edge, depth: int) -> None:
            for child in edge.children.values():
                toks = " ".join(
                    f"{t}*" if c != CONTEXT else str(t)
                    for t, c in zip(child.tokens.tolist(), child.calls.tolist())
                )
                ends = ",".join(self.calls[r].call_id for r in child.end_calls)
                lines.append(f"{'  ' * depth}[{toks}]" + (f" <- {ends}" if ends else ""))
                walk(child, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)


def _as_tokens(prompt_ids: list[int], output_ids: list[int]) -> np.ndarray:
    try:
        path = np.asarray(prompt_ids + output_ids, dtype=np.int64)
    except OverflowError:
        raise ValueError("token ids: want 0..2**31-1") from None
    if len(path) and (int(path.min()) < 0 or int(path.max()) > _MAX_TOKEN_ID):
        raise ValueError("token ids: want 0..2**31-1")
    return path.astype(_TOKEN_DTYPE)


def _new_edge(path: np.ndarray, pos: int, out_start: int, ref: int, logprobs: np.ndarray) -> Edge:
    n = len(path)
    num_context = max(0, min(out_start, n) - pos)
    calls = np.full(n - pos, ref, dtype=np.int32)
    calls[:num_context] = CONTEXT
    lps = np.zeros(n - pos, dtype=np.float64)
    first_out = pos + num_context
    lps[num_context:] = logprobs[first_out - out_start :]
    return Edge(path[pos:].copy(), calls, lps)


def _common_prefix(edge_tokens: np.ndarray, path: np.ndarray, pos: int) -> int:
    """Length of the common prefix of ``edge_tokens`` and ``path[pos:]`` (at least 1 here)."""
    size = min(len(edge_tokens), len(path) - pos)
    differ = np.flatnonzero(edge_tokens[:size] != path[pos : pos + size])
    return int(differ[0]) if len(differ) else size
