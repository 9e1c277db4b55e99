"""Give a restarted proxy back what it had acknowledged: an execution's CallRecords, from the log.

The proxy keeps each execution's sessions (the calls it splices new prompts onto, and whose line
each call is on) in memory only. Every call it answered is in the processor's log first (a record
is acknowledged once logged), and each CallRecord carries what the proxy remembered of it
(``wire.SessionEntry``). So a proxy that restarted asks, before it answers the next call of an
execution it does not know, with ``SessionReplayRequest`` on the records socket; the processor
sends that execution's logged CallRecords back on the same socket, as logged and in log order,
then ``SessionReplayEnd`` with their count (and whether the execution is sealed, so its token is
refused again). The proxy remembers them again (``harness_proxy.sessions.SessionStore.restore``).

``SessionIndex`` keeps where each open execution's records start in the log (8 bytes a call, not
the records), from the replay and from each append; a sealed execution's are dropped, since its
proxy sessions are gone for good.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from base.wire import CallRecord, ExecutionSealed, Message, SessionReplayEnd, SessionReplayRequest, encode
from trajectory.log import AppendLog

log = logging.getLogger(__name__)


class SessionIndex:
    def __init__(self, log_: AppendLog) -> None:
        self.log = log_
        self._offsets: dict[str, dict[str, int]] = {}
        """execution id -> call id -> where its first logged copy starts."""
        self.num_replays = 0
        self.num_records_replayed = 0

    def logged(self, msg: Message, offset: int) -> None:
        """A message now in the log at ``offset``."""
        if isinstance(msg, CallRecord):
            self._offsets.setdefault(msg.execution_id, {}).setdefault(msg.call_id, offset)
        elif isinstance(msg, ExecutionSealed):
            self._offsets.pop(msg.execution_id, None)

    def num_open(self) -> int:
        return len(self._offsets)

    def answer(self, request: SessionReplayRequest, is_sealed: Callable[[str], bool]) -> list[bytes]:
        """The frames that answer ``request``: the execution's logged CallRecords, then the end."""
        offsets = self._offsets.get(request.execution_id, {})
        sealed = is_sealed(request.execution_id)
        try:
            frames = [] if sealed else self.log.read_at(sorted(offsets.values()))
        except (OSError, ValueError) as exc:  # the log cannot give them back: say so, send no partial set
            log.error("session replay of %s: %s", request.execution_id, exc)
            return []
        self.num_replays += 1
        self.num_records_replayed += len(frames)
        log.info("session replay: %d record(s) of execution %s%s", len(frames), request.execution_id,
                 " (sealed)" if sealed else "")
        return frames + [encode(SessionReplayEnd(execution_id=request.execution_id, num_records=len(frames),
                                                 sealed=sealed))]


def split_requests(
    batch: Sequence[tuple[bytes, bytes]], decode_request: Callable[[bytes], SessionReplayRequest | bool]
) -> tuple[list[tuple[bytes, bytes]], list[tuple[bytes, SessionReplayRequest]]]:
    """The records socket's frames: those to log, and the replay requests (never logged).
    ``decode_request``: the request, False for a frame that is no request, True for one that looks
    like a request but is not valid (it has been rejected, and goes nowhere)."""
    rest, requests = [], []
    for ident, frame in batch:
        req = decode_request(frame)
        if req is False:
            rest.append((ident, frame))
        elif req is not True:
            requests.append((ident, req))
    return rest, requests
