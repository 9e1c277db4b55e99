"""The append-only log: round trip, torn and corrupt tails, markers."""

from __future__ import annotations

from pathlib import Path

import pytest

from base.wire import decode, encode
from tests.trajectory import grade
from trajectory.log import AppendLog, decode_marker, encode_marker, read_from


def test_round_trip_in_order(tmp_path: Path) -> None:
    frames = [encode(grade(f"e{i}", "g", 1.0, group_size=3)) for i in range(3)]
    log = AppendLog(tmp_path / "p.log", fsync=True)
    assert list(log.replay()) == []
    log.append(frames[0])
    log.append_many(frames[1:])
    log.close()
    again = AppendLog(tmp_path / "p.log", fsync=False)
    assert list(again.replay()) == frames
    assert [decode(f) for f in frames] == [grade(f"e{i}", "g", 1.0, group_size=3) for i in range(3)]


@pytest.mark.parametrize("cut", [1, 5, 8, 20])
def test_a_torn_tail_is_truncated_and_appends_follow_the_last_good_entry(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "p.log"
    log = AppendLog(path, fsync=False)
    log.append_many([b"one", b"two", b"three-is-long-enough"])
    log.close()
    good = path.stat().st_size
    path.write_bytes(path.read_bytes()[: good - cut])  # the crash hit the last write
    log = AppendLog(path, fsync=False)
    assert list(log.replay()) == [b"one", b"two"]
    assert log.num_truncated_bytes > 0
    log.append(b"four")
    log.close()
    assert list(AppendLog(path, fsync=False).replay()) == [b"one", b"two", b"four"]


def test_a_corrupt_entry_ends_the_replay(tmp_path: Path) -> None:
    path = tmp_path / "p.log"
    log = AppendLog(path, fsync=False)
    log.append_many([b"one", b"two", b"three"])
    log.close()
    data = bytearray(path.read_bytes())
    data[8 + 3 + 8] ^= 0xFF  # first payload byte of "two"
    path.write_bytes(bytes(data))
    assert list(AppendLog(path, fsync=False).replay()) == [b"one"]


def test_garbage_length_is_a_corrupt_tail(tmp_path: Path) -> None:
    path = tmp_path / "p.log"
    path.write_bytes(b"\xff\xff\xff\xff\x00\x00\x00\x00rest")
    log = AppendLog(path, fsync=False)
    assert list(log.replay()) == []
    assert path.stat().st_size == 0


def test_append_without_replay_checks_the_tail_first(tmp_path: Path) -> None:
    path = tmp_path / "p.log"
    path.write_bytes(b"\x05\x00")
    log = AppendLog(path, fsync=False)
    log.append(b"x")
    log.close()
    assert list(AppendLog(path, fsync=False).replay()) == [b"x"]


def test_markers_are_told_apart_from_wire_frames() -> None:
    marker = decode_marker(encode_marker("group_done", group_id="g1"))
    assert marker is not None and (marker.kind, marker.fields) == ("group_done", {"group_id": "g1"})
    assert decode_marker(encode(grade("e", "g", 1.0, group_size=1))) is None
    with pytest.raises(ValueError, match="marker"):
        decode_marker(encode_marker("x")[:-1])


def test_read_from_gives_offsets_stops_at_a_torn_tail_and_leaves_it(tmp_path: Path) -> None:
    path = tmp_path / "p.log"
    log = AppendLog(path, fsync=False)
    log.append_many([b"one", b"two", b"three"])
    log.close()
    with open(path, "ab") as f:
        f.write(b"\x09\x00\x00\x00torn")
    data = path.read_bytes()
    entries = list(read_from(path))
    assert [p for _, _, p in entries] == [b"one", b"two", b"three"]
    assert [(s, e) for s, e, _ in entries] == [(0, 11), (11, 22), (22, 35)]
    assert [p for _, _, p in read_from(path, entries[1][0])] == [b"two", b"three"]  # from an entry's start
    assert path.read_bytes() == data  # the torn tail is left for the processor's own replay
