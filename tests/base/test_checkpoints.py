"""Which checkpoints stay: the newest complete ones; an interrupted write newer than them stays
too (the core may be writing it), older interrupted writes go."""

from __future__ import annotations

from pathlib import Path

from base.checkpoints import META_FILE, latest_checkpoint, prune


def make(root: Path, version: int, *, complete: bool = True) -> Path:
    folder = root / f"v{version}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"x")
    if complete:
        (folder / META_FILE).write_text("{}")
    return folder


def test_keeps_the_newest_complete_ones_and_a_write_in_progress(tmp_path: Path):
    for v in (1, 2, 3, 4, 5):
        make(tmp_path, v)
    make(tmp_path, 0, complete=False)  # an old torn write
    make(tmp_path, 6, complete=False)  # being written now
    (tmp_path / "notes").mkdir()
    assert prune(tmp_path, keep=2) == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "v4", "v5", "v6"]
    assert latest_checkpoint(tmp_path).version == 5  # type: ignore[union-attr]
    assert prune(tmp_path, keep=2) == []


def test_keep_zero_or_nothing_complete_deletes_nothing(tmp_path: Path):
    make(tmp_path, 1)
    make(tmp_path, 2)
    assert prune(tmp_path, keep=0) == [] and len(list(tmp_path.iterdir())) == 2
    other = tmp_path / "other"
    make(other, 1, complete=False)
    assert prune(other, keep=1) == [] and (other / "v1").exists()
    assert prune(tmp_path / "missing", keep=1) == []
