"""A crash-safe, append-only log of frames: what the processor accepted, persisted before use.

Entry layout: ``<u32 payload length, little-endian> <u32 crc32 of payload> <payload>``. A
payload is a wire frame exactly as received, or a *marker* (below). ``append`` writes and
flushes, then ``os.fsync`` when ``fsync=True``; ``append_many`` does one flush/fsync for a batch
(the processor's group commit). ``replay`` yields every payload in order and stops cleanly at a
torn or corrupt tail (a crash mid-write), truncating it so new entries follow the last good one.

Markers record what the processor *did* (a group's shards went out), so a restart does not do it
again. They are a local format, never sent on any wire: MessagePack
``["gyre.trajectory.marker", 1, kind, {field: value}]``. A wire frame starts with the protocol
version (an int), a marker with this string, so the two cannot be confused.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from base.wire import MAX_FRAME_BYTES

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<II")
MAX_ENTRY_BYTES = MAX_FRAME_BYTES
MARKER_TAG = "gyre.trajectory.marker"
_MARKER_VERSION = 1
_MARKER_HEAD = b"\x94" + msgpack.packb(MARKER_TAG)  # fixarray(4) + the tag string


@dataclass(frozen=True, slots=True)
class Marker:
    kind: str
    fields: dict[str, Any]


def encode_marker(kind: str, **fields: Any) -> bytes:
    return msgpack.packb([MARKER_TAG, _MARKER_VERSION, kind, fields], use_bin_type=True)


def decode_marker(payload: bytes) -> Marker | None:
    """The marker in ``payload``, or None when it is not one (then it is a wire frame).

    Raises ValueError for a payload that starts like a marker but is not a valid one.
    """
    if not payload.startswith(_MARKER_HEAD):
        return None
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise ValueError(f"marker: not MessagePack ({exc})") from None
    if not (
        isinstance(obj, list)
        and len(obj) == 4
        and obj[1] == _MARKER_VERSION
        and isinstance(obj[2], str)
        and isinstance(obj[3], dict)
    ):
        raise ValueError(f"marker: want [tag, {_MARKER_VERSION}, kind, fields], got {obj!r:.200}")
    return Marker(kind=obj[2], fields=obj[3])


class AppendLog:
    """One log file. Call ``replay()`` (to the end) before appending; ``append`` does it if not."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.num_entries = 0
        self.num_truncated_bytes = 0
        self.last_offset = 0
        """Where the entry ``replay`` yielded last starts (``read_at`` reads it again)."""
        self._file: BinaryIO | None = None

    def scan(self) -> Iterator[bytes]:
        """Yield each good payload in order, read-only (no truncation, not opened for append)."""
        for payload, _ in self._entries():
            yield payload

    def replay(self) -> Iterator[bytes]:
        """Yield each good payload in order; then truncate a torn/corrupt tail and open for append."""
        if self._file is not None:
            raise RuntimeError("replay: the log is already open for appending")
        self.num_entries = 0
        good_end = 0
        for payload, good_end in self._entries():
            self.num_entries += 1
            self.last_offset = good_end - _HEADER.size - len(payload)
            yield payload
        size = self.path.stat().st_size if self.path.exists() else 0
        if good_end < size:
            self.num_truncated_bytes = size - good_end
            log.warning(
                "log %s: torn or corrupt tail after %d entries; truncating %d bytes",
                self.path, self.num_entries, self.num_truncated_bytes,
            )
            os.truncate(self.path, good_end)
        self._open()

    def _entries(self) -> Iterator[tuple[bytes, int]]:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            while True:
                payload = _read_entry(f)
                if payload is None:
                    return
                yield payload, f.tell()

    def append(self, payload: bytes) -> None:
        self.append_many((payload,))

    def append_many(self, payloads: Iterable[bytes]) -> list[int]:
        """Write the entries, flush, and fsync once (when configured); durable on return. Returns
        where each entry starts (``read_at``)."""
        if self._file is None:
            for _ in self.replay():
                pass
        assert self._file is not None
        wrote = False
        offsets = []
        for payload in payloads:
            if len(payload) > MAX_ENTRY_BYTES:
                raise ValueError(f"log entry: {len(payload)} bytes is over {MAX_ENTRY_BYTES}")
            offsets.append(self._file.tell())
            self._file.write(_HEADER.pack(len(payload), zlib.crc32(payload)))
            self._file.write(payload)
            self.num_entries += 1
            wrote = True
        if wrote:
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
        return offsets

    def read_at(self, offsets: Iterable[int]) -> list[bytes]:
        """The payloads of the entries starting at ``offsets`` (from ``append_many`` or
        ``last_offset``), read back in that order; ValueError for one that is not a good entry."""
        out = []
        with open(self.path, "rb") as f:
            for offset in offsets:
                f.seek(offset)
                payload = _read_entry(f)
                if payload is None:
                    raise ValueError(f"log {self.path}: no good entry at byte {offset}")
                out.append(payload)
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _open(self) -> None:
        created = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")
        if created and self.fsync:  # make the new file's directory entry durable too
            fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _read_entry(f: BinaryIO) -> bytes | None:
    header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    length, crc = _HEADER.unpack(header)
    if length > MAX_ENTRY_BYTES:
        return None
    payload = f.read(length)
    if len(payload) < length or zlib.crc32(payload) != crc:
        return None
    return payload


def read_from(path: Path, offset: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """``(start, end, payload)`` of each good entry from byte ``offset`` (an entry's start) on,
    read-only. It stops at a torn or corrupt entry as ``replay`` does, but leaves it in the file
    (``replay`` would truncate it; a reader such as the viewer must not change a run's files):
    the caller compares the last ``end`` with the file's size."""
    with open(path, "rb") as f:
        f.seek(offset)
        while (payload := _read_entry(f)) is not None:
            end = f.tell()
            yield end - _HEADER.size - len(payload), end, payload
