"""The processor's end of the proxy's record stream: a ROUTER that hands frames over in batches and
answers each batch, once its receiver has made it durable, with one ``RecordsAck`` per sender.

The proxy keeps every CallRecord and seal until it is acknowledged and resends what is not
(``harness_proxy.record_sink``), so the ack must mean *in the log*: ``ack`` is called after the
batch's ``AppendLog.append_many`` returned. A duplicate (a resend of a frame that did land) is
acknowledged again; the processor drops it by its key (``wire.record_key``).

Under CURVE a frame's sender is the member whose key opened the connection: only ``only`` (the
proxy) may send here, whatever the frame says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import zmq

from base import curve
from base.wire import CallRecord, ExecutionSealed, RecordsAck, encode, record_key


REPLAY_SNDHWM = 100_000
"""Frames queued to one proxy before more are dropped (it counts them against ``SessionReplayEnd``)."""


class RecordInbox:
    def __init__(self, ctx: zmq.Context, addr: str, *, only: str | None = "proxy",
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.only = only
        self.on_refused = on_refused or (lambda why: None)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, REPLAY_SNDHWM)  # a session replay is one frame per call
        curve.server(self.sock)  # only the run's members get in
        self.sock.bind(addr)
        self.addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms))

    def drain(self, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` waiting ``(sender identity, frame)``; frames from a member other than
        ``only``, or not one part, are refused through ``on_refused``."""
        out: list[tuple[bytes, bytes]] = []
        while len(out) < limit:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            sender = curve.sender(parts[-1])
            if self.only is not None and sender is not None and sender != self.only:
                # Records and seals come from the proxy alone: another member's would be logged
                # and trained as if the proxy had recorded them.
                self.on_refused(f"{sender} sent on the {self.only}'s socket")
                continue
            body = [p.bytes for p in parts[1:] if p.bytes]  # a REQ-like peer may add b""
            if len(body) != 1:
                self.on_refused(f"want one frame per message, got {len(body)} parts")
                continue
            out.append((parts[0].bytes, body[0]))
        return out

    def ack(self, logged: Sequence[tuple[bytes, CallRecord | ExecutionSealed]]) -> None:
        """Acknowledge records and seals that are in the log, one ``RecordsAck`` per sender."""
        for parts in ack_frames(logged):
            try:
                self.sock.send_multipart(parts, zmq.NOBLOCK)
            except zmq.Again:
                pass  # the sender is gone or full: it resends, and the duplicate is acked then

    def send(self, frames: Sequence[list[bytes]]) -> None:
        """``[sender identity, frame]`` pairs back to their senders (session replays); a sender that is
        gone or full loses them, and asks again."""
        for parts in frames:
            try:
                self.sock.send_multipart(parts, zmq.NOBLOCK)
            except zmq.Again:
                pass

    def close(self) -> None:
        self.sock.close()


def ack_frames(logged: Sequence[tuple[bytes, CallRecord | ExecutionSealed]]) -> list[list[bytes]]:
    """``[sender identity, RecordsAck]`` per sender of these records and seals (for a ROUTER)."""
    by_sender: dict[bytes, list[tuple[str, str]]] = {}
    for ident, msg in logged:
        by_sender.setdefault(ident, []).append(record_key(msg))
    return [[ident, encode(RecordsAck(execution_ids=[e for e, _ in keys], call_ids=[c for _, c in keys]))]
            for ident, keys in by_sender.items()]
