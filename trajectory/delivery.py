"""The processor's delivery, both ways: what comes in is logged before it counts, what goes out
is owed until the controller says ``Delivered``.

``ProcessorService`` wraps a ``trajectory.processor.Processor`` (the decisions) around an
``AppendLog``: it decodes frames, appends the valid ones to the log *before* processing (and
acknowledging) them, rebuilds the state from the log on start, and logs a marker for a group (or a
run-released execution) once the controller has taken all of its messages, so a restart sends
again exactly what may not have arrived. It owns no socket: ``trajectory.service.serve`` moves its
frames.

Delivery (at least once, each receiver idempotent: effectively once). The processor acknowledges
records and seals (``RecordsAck``) only once they are in its log; the proxy resends what is not
acknowledged, and records and seals are deduplicated by ``(execution_id, call_id)``, grades by
execution (the controller resends its grades when a restarted processor says Hello). Outgoing, a
group's messages (its shards, then its ``GroupDone``) and a run-released execution's shards stay
owed until the controller answers ``Delivered`` for every one of them; only then is the group's (or
execution's) *delivered* marker logged. A restart replays the log and sends again whatever has no
marker, and the controller drops what it already took by shard and group id. So a kill at any
moment loses nothing and trains nothing twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack

from base.wire import (
    CallRecord,
    Delivered,
    ErrorReply,
    ExecutionSealed,
    Grade,
    GroupDone,
    PROTOCOL_VERSION,
    Message,
    ProtocolError,
    SessionReplayRequest,
    ShardReady,
    Shutdown,
    decode,
)
from trajectory.log import AppendLog, Marker, decode_marker, encode_marker
from trajectory.processor import Counters, Processor
from trajectory.run_release import EXECUTION_SENT_MARKER, released_execution
from trajectory.session_replay import SessionIndex, split_requests

log = logging.getLogger(__name__)

_REPLAY_REQUEST_HEAD = msgpack.packb([PROTOCOL_VERSION, SessionReplayRequest.TAG, {}])[:-1]
"""How a replay request's frame starts ([version, tag, ...), so record frames are not decoded twice."""
GROUP_DONE_MARKER = "group_done"
_MARKER_FIELDS = {GROUP_DONE_MARKER: "group_id", EXECUTION_SENT_MARKER: "execution_id"}


class ProcessorService:
    """Frames in, messages out, with every accepted frame logged before it is processed."""

    RECORD_MESSAGES = (CallRecord, ExecutionSealed)
    CONTROL_MESSAGES = (Grade, Delivered, Shutdown)

    def __init__(self, processor: Processor, log_: AppendLog) -> None:
        self.processor = processor
        self.log = log_
        self.shutdown_requested = False
        # What went out and is not yet Delivered: marker key -> its messages, the delivery ids
        # still waited for, and when it was last sent (for a resend).
        self.owed: dict[tuple[str, str], _Owed] = {}
        self._owed_by_id: dict[str, tuple[str, str]] = {}
        self.sessions = SessionIndex(log_)

    @property
    def counters(self) -> Counters:
        return self.processor.counters

    def replay(self) -> list[Message]:
        """Rebuild state from the log; return the messages still owed (those without a marker).

        Owed messages keep their log order, so a group's run-released shards precede its
        ``GroupDone``.
        """
        owed: dict[tuple[str, str], list[Message]] = {}
        sent = self._sent_before()
        self.processor.expect_sent_before(
            {i for kind, i in sent if kind == GROUP_DONE_MARKER},
            {i for kind, i in sent if kind == EXECUTION_SENT_MARKER},
        )
        for payload in self.log.replay():
            try:
                marker = decode_marker(payload)
                if marker is not None:
                    self._replay_marker(marker, owed)
                    continue
                msg = decode(payload, expect=self.RECORD_MESSAGES + (Grade,))
            except ValueError as exc:  # ProtocolError is a ValueError
                self.reject("log", str(exc))
                continue
            self.sessions.logged(msg, self.log.last_offset)
            _collect_by_group(self.processor.on_message(msg), owed)
        messages = [m for outs in owed.values() for m in outs]
        self.processor.take_facts()  # reported by the attempt that first saw them
        log.info(
            "replayed %d log entries: %d group(s) and %d execution(s) already sent, %d open "
            "group(s), %d open execution(s), %d group(s) or execution(s) owed", self.log.num_entries,
            self.counters.num_groups_replayed, self.counters.num_executions_replayed,
            self.processor.num_open_groups, self.processor.num_open_executions, len(owed),
        )
        return messages

    def _replay_marker(self, marker: Marker, owed: dict[tuple[str, str], list[Message]]) -> None:
        key = _marker_key(marker)
        if key is None:
            return
        owed.pop(key, None)
        if key[0] == GROUP_DONE_MARKER:
            self.processor.mark_group_done(key[1])

    def _sent_before(self) -> set[tuple[str, str]]:
        """The (marker kind, id) of everything the log says went out."""
        sent = set()
        for payload in self.log.scan():
            try:
                marker = decode_marker(payload)
            except ValueError:
                continue  # counted when the replay meets it
            key = _marker_key(marker) if marker is not None else None
            if key is not None:
                sent.add(key)
        return sent

    def on_record_frames(self, frames: Sequence[bytes]) -> list[Message]:
        """Frames from the records socket (CallRecord, ExecutionSealed); no replies for bad ones."""
        out, _ = self.take_records([(b"", frame) for frame in frames])
        return out

    def take_records(
        self, batch: Sequence[tuple[bytes, bytes]]
    ) -> tuple[list[Message], list[tuple[bytes, CallRecord | ExecutionSealed]]]:
        """``(sender, frame)`` pairs from the records socket: the messages to send, and the
        ``(sender, record)`` pairs now in the log, to acknowledge (``RecordInbox.ack``)."""
        accepted = []
        for ident, frame in batch:
            try:
                accepted.append((ident, frame, decode(frame, expect=self.RECORD_MESSAGES)))
            except ProtocolError as exc:
                self.reject("records", str(exc))
        out = self._persist_and_process([(frame, msg) for _, frame, msg in accepted])
        return out, [(ident, msg) for ident, _, msg in accepted]  # type: ignore[misc]

    def session_replays(self, batch: Sequence[tuple[bytes, bytes]]) -> tuple[
            list[tuple[bytes, bytes]], list[list[bytes]]]:
        """Take the replay requests out of a records-socket batch: the rest (for ``take_records``), and
        ``[sender, frame]`` pairs answering the requests. Answer them after ``take_records`` of the
        same batch, so a record logged just before a request is in its answer."""
        def request(frame: bytes) -> SessionReplayRequest | bool:
            if not frame.startswith(_REPLAY_REQUEST_HEAD):
                return False
            try:
                return decode(frame, expect=(SessionReplayRequest,))  # type: ignore[return-value]
            except ProtocolError as exc:
                self.reject("records", str(exc))
                return True
        rest, requests = split_requests(batch, request)
        answers = [[ident, frame] for ident, req in requests
                   for frame in self.sessions.answer(req, self.processor.is_sealed)]
        return rest, answers

    def on_control_frames(self, frames: Sequence[bytes]) -> list[Message]:
        """Frames from the controller (Grade, Shutdown); a bad one gets an ErrorReply."""
        accepted = []
        replies: list[Message] = []
        for frame in frames:
            try:
                msg = decode(frame, expect=self.CONTROL_MESSAGES)
            except ProtocolError as exc:
                self.reject("control", str(exc))
                replies.append(ErrorReply(where="processor.control", message=str(exc)))
                continue
            if isinstance(msg, Shutdown):
                log.info("shutdown requested by the controller: %s", msg.reason)
                self.shutdown_requested = True
                continue
            if isinstance(msg, Delivered):
                self.on_delivered(msg)
                continue
            accepted.append((frame, msg))
        return replies + self._persist_and_process(accepted)

    def sending(self, messages: Sequence[Message], now: float | None = None) -> None:
        """These messages go out now: hold them as owed until ``Delivered`` names each one."""
        groups: dict[tuple[str, str], list[Message]] = {}
        _collect_by_group(list(messages), groups)
        now = time.monotonic() if now is None else now
        for key, msgs in groups.items():
            entry = self.owed.setdefault(key, _Owed(sent_at=now))
            entry.messages.extend(msgs)
            for m in msgs:
                entry.waiting.add(_delivery_id(m))
                self._owed_by_id[_delivery_id(m)] = key

    def on_delivered(self, msg: Delivered) -> None:
        """The controller took these: a group or execution all of whose messages it has is
        marked delivered in the log (durably), and never sent again."""
        done = []
        for id_ in [f"shard:{i}" for i in msg.shard_ids] + [f"group:{g}" for g in msg.group_ids]:
            key = self._owed_by_id.pop(id_, None)
            entry = self.owed.get(key) if key is not None else None
            if entry is None:
                continue  # a duplicate acknowledgement, or one for a message of an earlier attempt
            entry.waiting.discard(id_)
            if not entry.waiting:
                del self.owed[key]  # type: ignore[arg-type]
                done.append(key)
        self._log_markers(done)

    def due_resends(self, now: float, after_s: float) -> list[Message]:
        """Owed messages sent over ``after_s`` ago without a ``Delivered``, to send again (the
        controller drops what it already has)."""
        out: list[Message] = []
        for entry in self.owed.values():
            if now - entry.sent_at >= after_s:
                entry.sent_at = now
                out.extend(m for m in entry.messages if _delivery_id(m) in entry.waiting)
        return out

    def mark_delivered(self, messages: Sequence[Message]) -> None:
        """Log these messages' groups and executions as delivered (what ``on_delivered`` does once
        every message of one is acknowledged)."""
        self._log_markers([k for k in map(_sent_key, messages) if k is not None])

    def _log_markers(self, keys: list[tuple[str, str]]) -> None:
        """One marker per group and run-released execution, in order, durable on return."""
        markers = [
            encode_marker(kind, **{_MARKER_FIELDS[kind]: id_}) for kind, id_ in dict.fromkeys(keys)
        ]
        self.log.append_many(markers)

    def reject(self, where: str, text: str) -> None:
        self.counters.num_rejected += 1
        log.warning("rejected a frame on %s: %s", where, text)

    def _persist_and_process(self, accepted: list[tuple[bytes, Message]]) -> list[Message]:
        offsets = self.log.append_many(frame for frame, _ in accepted)
        out: list[Message] = []
        for (_, msg), offset in zip(accepted, offsets):
            self.sessions.logged(msg, offset)
            out.extend(self.processor.on_message(msg))
        return out


@dataclass
class _Owed:
    sent_at: float
    messages: list[Message] = field(default_factory=list)
    waiting: set[str] = field(default_factory=set)


def _delivery_id(m: Message) -> str:
    """How ``Delivered`` names a message: ``shard:<shard id>`` or ``group:<group id>``."""
    if isinstance(m, ShardReady):
        return f"shard:{m.shard.shard_id}"
    assert isinstance(m, GroupDone), m
    return f"group:{m.group_id}"


def _collect_by_group(messages: list[Message], owed: dict[tuple[str, str], list[Message]]) -> None:
    """Key messages by the marker that will say they went out: a group's ``ShardReady``s with the
    ``GroupDone`` that follows them (one group per call), run-released shards by execution."""
    pending: list[Message] = []
    for m in messages:
        key = _sent_key(m)
        if isinstance(m, ShardReady) and key is None:
            pending.append(m)
        elif isinstance(m, GroupDone):
            owed[(GROUP_DONE_MARKER, m.group_id)] = pending + [m]
            pending = []
        elif key is not None:  # a run-released shard: its execution's marker covers it
            owed.setdefault(key, []).append(m)


def _sent_key(m: Message) -> tuple[str, str] | None:
    """(marker kind, id) of the marker logged when ``m`` goes out; None when it has none."""
    if isinstance(m, GroupDone):
        return (GROUP_DONE_MARKER, m.group_id)
    if isinstance(m, ShardReady) and (execution_id := released_execution(m.shard)) is not None:
        return (EXECUTION_SENT_MARKER, execution_id)
    return None


def _marker_key(marker: Marker) -> tuple[str, str] | None:
    """(kind, id) of a logged marker, as ``_sent_key`` names it; None for an unknown kind."""
    name = _MARKER_FIELDS.get(marker.kind)
    return None if name is None else (marker.kind, str(marker.fields.get(name)))
