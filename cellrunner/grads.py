"""Satellites' gradients to the core, rank to rank.

Every rank of the core binds its own PULL socket (a ``GradInbox``); the controller hands their
addresses, in rank order, to every satellite, and rank r of a satellite pushes its own flat
gradient buffer to rank r of the core. Cells share one training layout, so rank r's buffer means
the same thing in every cell: nothing is gathered on a leader or scattered again, and each pair of
ranks uses its own link (on a cluster, its own node's NIC). DP replicas send their identical
copies to their peers, so the core's replicas need no exchange among themselves.

A frame is ``[GradsHeader, raw float32]`` (``cellrunner.transfer``), checked against its header
and against the rank it reached; nothing is unpickled.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import zmq

from cellrunner.spmd import Agree
from cellrunner.transfer import recv_grads, send_grads
from base import curve
from base.wire import ProtocolError

log = logging.getLogger(__name__)

SEND_LINGER_MS = 5000
"""How long closing a push socket waits to flush its frame."""


class GradInbox:
    """One core rank's PULL socket and the satellite gradients that came in, by step and cell."""

    def __init__(self, ctx: zmq.Context, host: str, rank: int):
        self.rank = rank
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        curve.server(self._sock)
        self._sock.bind(f"tcp://{host}:0")
        self.addr = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pending: dict[int, dict[int, np.ndarray]] = {}
        """step -> sending cell -> its gradient."""

    def drain(self, timeout_ms: int = 0) -> None:
        """Take every frame waiting (after up to ``timeout_ms`` for the first)."""
        while self._sock.poll(timeout_ms):
            timeout_ms = 0
            frames = self._sock.recv_multipart(copy=False)
            sender = curve.sender(frames[0])
            parts = [f.bytes for f in frames]
            try:
                header, grads = recv_grads(parts)
                if sender is not None and sender != f"cell-{header.cell_id}":
                    # Only the cell itself may hand in its gradient: the first frame per (step,
                    # cell) is kept, so a frame in its name from anyone else would replace it.
                    raise ProtocolError(f"grads: {sender} sent a gradient in cell {header.cell_id}'s name")
                if header.rank != self.rank:
                    raise ProtocolError(f"grads: from rank {header.rank} of cell {header.cell_id}, this is rank {self.rank}")
                if header.cell_id in self.pending.get(header.step, {}):
                    raise ProtocolError(f"grads: a second gradient of step {header.step} from cell {header.cell_id}")
            except ProtocolError as exc:
                log.error("core rank %d: rejected gradient frame: %s", self.rank, exc)
                continue
            self.pending.setdefault(header.step, {})[header.cell_id] = grads

    def take(self, step: int, cells: list[int], timeout_s: float) -> list[np.ndarray] | None:
        """The gradients of ``step`` from exactly ``cells``, in that order, once all are in; None
        if they are not by the timeout (what came stays here)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.drain()
            if not self.missing(step, cells):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.drain(timeout_ms=max(1, min(100, int(left * 1000))))
        have = self.pending[step] if cells else {}
        return [have.pop(c) for c in cells]

    def missing(self, step: int, cells: list[int]) -> list[int]:
        have = self.pending.get(step, {})
        return [c for c in cells if c not in have]

    def pending_back(self, step: int, cells: list[int], grads: list[np.ndarray]) -> None:
        """Keep ``grads`` (of ``cells``) of ``step`` for a later ``take`` (a step refused on another rank)."""
        self.pending.setdefault(step, {}).update(zip(cells, grads))

    def forget_through(self, step: int) -> None:
        """``step`` is applied: what is left of it and of earlier steps can no longer count (a
        satellite lost after sending: its shards were trained again elsewhere)."""
        for old in [s for s in self.pending if s <= step]:
            left = self.pending.pop(old)
            if left:
                log.warning("core rank %d: dropping step %d's gradients from cells %s (not counted)", self.rank, old,
                            sorted(left))

    def count(self, step: int) -> int:
        return len(self.pending.get(step, {}))

    def close(self) -> None:
        self._sock.close()


def send_to_peer(ctx: zmq.Context, addr: str, *, cell_id: int, step: int, rank: int, grads: np.ndarray) -> None:
    """Push this rank's gradient to the core's rank at ``addr``; returns once it is flushed (or
    the linger ran out: a core that is gone then counts it missing)."""
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, SEND_LINGER_MS)
    curve.client(push, "core")
    push.connect(addr)
    try:
        send_grads(push, cell_id=cell_id, step=step, rank=rank, grads=grads)
    finally:
        push.close()


class GradExchange:
    """This rank's side of the exchange: the inbox on the core, the push everywhere."""

    def __init__(self, ctx: zmq.Context, host: str, rank: int, is_core: bool):
        self.ctx, self.rank = ctx, rank
        self.inbox = GradInbox(ctx, host, rank) if is_core else None

    @property
    def addr(self) -> str:
        return self.inbox.addr if self.inbox is not None else ""

    def send(self, trainer: Any, addrs: list[str], *, cell_id: int, step: int, agree: Agree) -> None:
        """Every rank: take the trainer's gradient sum and push it to ``addrs[rank]``."""
        grads, error = trainer.take_grads(), ""
        try:
            send_to_peer(self.ctx, addrs[self.rank], cell_id=cell_id, step=step, rank=self.rank, grads=grads)
        except (zmq.ZMQError, IndexError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.error("cell %d rank %d: gradient of step %d not sent: %s", cell_id, self.rank, step, error)
        failed = agree(not error)
        if failed:
            raise RuntimeError(f"step {step}: ranks {failed} could not send their gradients" + (f" ({error})" if error else ""))

    def apply(self, trainer: Any, *, step: int, satellites: list[int], num_executions: int, timeout_s: float,
              agree: Agree) -> tuple[Any, float]:
        """Every rank of the core: take the gradients of ``step`` from exactly the cells
        ``satellites`` from this rank's inbox, check them against the trainer's buffer, and apply
        only if every rank can (a refused step leaves every rank as it was, the gradients kept for
        a retry)."""
        assert self.inbox is not None, "only the core applies"
        got = self.inbox.take(step, satellites, timeout_s)
        want = trainer.grad_numel()
        bad = "" if got is not None else f"no gradient from cells {self.inbox.missing(step, satellites)}"
        if got is not None and any(g.size != want for g in got):
            bad = f"a satellite gradient has {[g.size for g in got if g.size != want][0]} elements, want {want}"
        failed = agree(not bad)
        if failed:
            if got is not None:
                self.inbox.pending_back(step, satellites, got)
            raise ValueError(f"step {step}: refused on ranks {failed}" + (f" (rank {self.rank}: {bad})" if bad else ""))
        out = trainer.apply(got, num_executions)
        self.inbox.forget_through(step)
        return out

    def close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()
