"""What the execution manager does to an agent's folders from outside: measure, strip, cut."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from workloads.sandbox.aftercare import cut_log, measure, strip_special_bits


def test_setuid_setgid_and_sticky_bits_are_stripped_and_links_never_followed(tmp_path: Path):
    outside = tmp_path / "outside"
    outside.write_text("x")
    os.chmod(outside, 0o4755)
    tree = tmp_path / "ws"
    (tree / "sub").mkdir(parents=True)
    for name, mode in (("suid", 0o4755), ("sub/sgid", 0o2750), ("plain", 0o644)):
        (tree / name).write_text("x")
        os.chmod(tree / name, mode)
    os.chmod(tree / "sub", 0o3775)
    (tree / "link").symlink_to(outside)
    changed = strip_special_bits(tree)
    assert sorted(changed) == ["sub", "sub/sgid", "suid"]
    assert [stat.S_IMODE((tree / p).stat().st_mode) for p in ("suid", "sub/sgid", "plain", "sub")] == [
        0o755, 0o750, 0o644, 0o775]
    assert stat.S_IMODE(outside.stat().st_mode) == 0o4755  # through the link: untouched


def test_measure_counts_bytes_and_stops_at_its_bound(tmp_path: Path):
    for i in range(50):
        (tmp_path / f"f{i}").write_bytes(b"x" * 8192)
    usage = measure([tmp_path], max_entries=1000)
    assert usage.complete and usage.num_entries == 50 and usage.num_bytes >= 50 * 8192
    assert not measure([tmp_path], max_entries=10).complete


def test_cut_log_keeps_the_head_and_says_so(tmp_path: Path):
    log = tmp_path / "stdout.log"
    log.write_bytes(b"a" * 5000)
    assert not cut_log(log, 10_000) and log.stat().st_size == 5000
    assert cut_log(log, 1000)
    data = log.read_bytes()
    assert data.startswith(b"a" * 1000) and b"cut at 1000 bytes of 5000" in data and len(data) < 1200
