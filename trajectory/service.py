"""The processor's process loop: sockets, heartbeats, the inbox wiring.

``serve`` is the ZMQ loop around a ``trajectory.delivery.ProcessorService``: a ``RecordInbox``
(ROUTER) bound for records (from the proxy, each acknowledged once logged; a restarted proxy's
``SessionReplayRequest`` is answered there with the execution's logged records,
``trajectory.session_replay``), DEALER connected to the controller (``Hello``, then ``Grade`` and
``Delivered`` in, ``ShardReady`` / ``GroupDone`` / ``ErrorReply`` out, and a ``ServiceHeartbeat``
each ``heartbeat_s`` from the loop itself). The decisions are ``trajectory.processor``'s, the
logging and owed messages ``trajectory.delivery``'s.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import zmq

from base import curve
from base.wire import Hello, Message, ServiceHeartbeat, encode
from trajectory.delivery import ProcessorService
from trajectory.inbox import RecordInbox

log = logging.getLogger(__name__)

_DRAIN_LIMIT = 512
RESEND_AFTER_S = 10.0
"""Owed messages with no ``Delivered`` this long after they went out are sent again (the
controller answers within a tick; a resend covers a frame lost on a reconnect)."""


def serve(
    service: ProcessorService,
    *,
    records_addr: str,
    controller_addr: str,
    stop: threading.Event,
    on_ready: Callable[[str], None] | None = None,
    poll_ms: int = 100,
    heartbeat_s: float = 1.0,
) -> None:
    """Replay, bind, say Hello, send what is owed, then move frames until ``stop`` or Shutdown.

    ``on_ready`` gets the bound records address (``tcp://host:port``, port resolved).
    """
    owed = service.replay()
    ctx = zmq.Context()
    inbox = RecordInbox(ctx, records_addr, only="proxy", on_refused=lambda why: service.reject("records", why))
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 2000)
        curve.client(dealer, "controller")
        dealer.connect(controller_addr)
        dealer.send(encode(Hello(peer="processor", pid=os.getpid())))
        _send(dealer, service, owed)
        log.info("processor ready: records on %s, controller %s", inbox.addr, controller_addr)
        if on_ready is not None:
            on_ready(inbox.addr)
        poller = zmq.Poller()
        poller.register(inbox.sock, zmq.POLLIN)
        poller.register(dealer, zmq.POLLIN)
        next_beat = 0.0
        while not stop.is_set() and not service.shutdown_requested:
            if (now := time.monotonic()) >= next_beat:  # from the loop itself: a stuck loop falls silent
                dealer.send(encode(ServiceHeartbeat(peer="processor", pid=os.getpid())))
                next_beat = now + heartbeat_s
            events = dict(poller.poll(poll_ms))
            if inbox.sock in events:
                batch, replays = service.session_replays(inbox.drain(_DRAIN_LIMIT))
                out, logged = service.take_records(batch)
                inbox.ack(logged)  # after take_records: the batch is in the log
                inbox.send(replays)
                _send(dealer, service, out)
            if dealer in events:
                _send(dealer, service, service.on_control_frames(_drain(dealer, service, "control")))
            for m in service.due_resends(time.monotonic(), RESEND_AFTER_S):
                dealer.send(encode(m))
    finally:
        log.info("processor stopping: %s", service.counters.metrics())
        inbox.close()
        dealer.close()
        curve.stop()  # its ZAP handler lives in this context: stopped before the context ends
        ctx.term()
        service.log.close()


def _send(dealer: zmq.Socket, service: ProcessorService, messages: list[Message]) -> None:
    service.sending(messages)
    for m in messages + service.processor.take_facts():  # facts: informational, never marked or owed
        dealer.send(encode(m))


def _drain(sock: zmq.Socket, service: ProcessorService, where: str) -> list[bytes]:
    """Up to _DRAIN_LIMIT waiting frames from the controller (one log fsync for the batch)."""
    frames: list[bytes] = []
    while len(frames) < _DRAIN_LIMIT:
        try:
            parts = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        parts = [p for p in parts if p] if len(parts) > 1 else parts
        if len(parts) != 1:
            service.reject(where, f"want one frame per message, got {len(parts)} parts")
            continue
        frames.append(parts[0])
    return frames
