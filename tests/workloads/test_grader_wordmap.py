"""The wordmap grader: dense reward in [0, 1]; a missing file is 0.0; a grader failure is None."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from workloads.graders import wordmap as graders
from workloads.graders.wordmap import GradeResult, grade, similarity
from workloads.tasksets.wordmap import Task

TASK = Task(task_id="wordmap-test-0000", prompt="p", target="return true", file_name="out_12.txt", topic="success")


def _write(ws: Path, data: bytes | str) -> Path:
    ws.mkdir(parents=True, exist_ok=True)
    path = ws / TASK.file_name
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return ws


@pytest.mark.parametrize("text", ["return true", "Return True\n", "  `return true;`  ", "RETURN\ttrue.", "\"return  true\""])
def test_exact_match_after_normalising_scores_one(tmp_path: Path, text: str):
    assert grade(TASK, _write(tmp_path, text)) == GradeResult(1.0)


def test_partial_scores_between_junk_and_exact(tmp_path: Path):
    near = grade(TASK, _write(tmp_path / "a", "return tru")).reward
    half = grade(TASK, _write(tmp_path / "b", "return")).reward
    junk = grade(TASK, _write(tmp_path / "c", "zzqq xkcd")).reward
    assert near is not None and half is not None and junk is not None
    assert 0.0 <= junk < half < near < 1.0
    assert near < 1.0 - graders.EXACT_BONUS + 1e-9  # the last step to exact pays the bonus


def test_similarity_stays_in_unit_interval():
    for text in ["", "   ", "!!!", "return true" * 50, "eurt nruter", "r", "return true x", "\x00\xff"]:
        assert 0.0 <= similarity(text, "return true") <= 1.0
    assert similarity("", "return true") == 0.0


def test_missing_file_is_zero_not_a_failure(tmp_path: Path):
    assert grade(TASK, tmp_path) == GradeResult(0.0)


def test_empty_file_is_zero(tmp_path: Path):
    assert grade(TASK, _write(tmp_path, "")) == GradeResult(0.0)


def test_missing_workspace_is_a_failure(tmp_path: Path):
    result = grade(TASK, tmp_path / "gone")
    assert result.reward is None and "workspace missing" in result.error


def test_unreadable_file_is_a_failure(tmp_path: Path):
    (tmp_path / TASK.file_name).mkdir()  # a directory where the file should be
    result = grade(TASK, tmp_path)
    assert result.reward is None and "cannot read" in result.error


def test_grader_exception_is_a_failure_not_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def boom(text: str, target: str) -> float:
        raise RuntimeError("bug in the grader")

    monkeypatch.setattr(graders, "similarity", boom)
    result = grade(TASK, _write(tmp_path, "return true"))
    assert result.reward is None and "RuntimeError" in result.error and "bug in the grader" in result.error


def test_invalid_utf8_is_graded_as_the_agents_output(tmp_path: Path):
    result = grade(TASK, _write(tmp_path, b"ret\xff\xfeurn true"))
    assert result.reward is not None and 0.0 < result.reward < 1.0 and result.error == ""


def test_huge_file_reads_a_bounded_prefix(tmp_path: Path):
    result = grade(TASK, _write(tmp_path, "x" * (graders.MAX_FILE_BYTES * 4)))
    assert result.reward is not None and result.reward < 0.01


def test_partial_grading_of_a_killed_run(tmp_path: Path):
    """A run killed at its timeout leaves its last complete write (and maybe a temp file)."""
    _write(tmp_path, "return tr")
    (tmp_path / f".{TASK.file_name}.tmp").write_text("return true", encoding="utf-8")
    (tmp_path / "TASK.md").write_text("file: out_12.txt\n\np\n", encoding="utf-8")
    result = grade(TASK, tmp_path)
    assert result.reward is not None and 0.5 < result.reward < 1.0


def test_symlink_to_a_file_outside_is_not_followed(tmp_path: Path):
    """An agent that links its answer file to the right text elsewhere scores 0, as with no file."""
    outside = tmp_path / "outside.txt"
    outside.write_text("return true", encoding="utf-8")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / TASK.file_name).symlink_to(outside)
    assert grade(TASK, ws) == GradeResult(0.0)
    assert outside.read_text(encoding="utf-8") == "return true"


def test_symlink_inside_the_workspace_is_not_followed_either(tmp_path: Path):
    _write(tmp_path, "").joinpath("real.txt").write_text("return true", encoding="utf-8")
    (tmp_path / TASK.file_name).unlink()
    (tmp_path / TASK.file_name).symlink_to(tmp_path / "real.txt")
    assert grade(TASK, tmp_path) == GradeResult(0.0)


def test_dangling_symlink_scores_zero(tmp_path: Path):
    (tmp_path / TASK.file_name).symlink_to(tmp_path / "nowhere")
    assert grade(TASK, tmp_path) == GradeResult(0.0)


def test_fifo_in_place_of_the_file_does_not_block(tmp_path: Path):
    os.mkfifo(tmp_path / TASK.file_name)
    assert grade(TASK, tmp_path) == GradeResult(0.0)
