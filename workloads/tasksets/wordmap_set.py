"""The wordmap task set behind the ``TaskSet`` interface: tasks, ``TASK.md`` in the workspace, grading.

``workload.answer_from`` says where the answer is: ``file`` (the file the ticket names, as the
bundled harness writes it) or ``stdout`` (what the harness printed last, e.g. ``claude -p``'s
final answer), so a real harness can be trained on the same family without writing files.
"""

from __future__ import annotations

from pathlib import Path

from workloads.api import GradeResult, RunArtifacts
from workloads.config import WorkloadConfig
from workloads.graders.wordmap import grade, similarity
from workloads.tasksets.wordmap import Task, make_tasks, write_task_file

MAX_STDOUT_BYTES = 65536
"""Only this much of the end of a harness's stdout is read for its answer."""


class WordmapTaskSet:
    def __init__(self, cfg: WorkloadConfig):
        self.cfg = cfg
        self.name = cfg.name

    def split(self) -> tuple[list[Task], list[Task]]:
        return make_tasks(self.cfg)

    def prepare(self, task: Task, workspace: Path) -> None:
        write_task_file(task, workspace)

    def grade(self, task: Task, workspace: Path, run: RunArtifacts) -> GradeResult:
        if self.cfg.answer_from == "file":
            return grade(task, workspace)
        try:
            with open(run.stdout_path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - MAX_STDOUT_BYTES))
                text = f.read().decode("utf-8", errors="replace")
        except OSError as exc:
            return GradeResult(reward=None, error=f"{task.task_id}: cannot read the harness's stdout: {exc}")
        # The last non-empty line is the answer: a harness may print progress before it.
        lines = [line for line in text.splitlines() if line.strip()]
        return GradeResult(reward=similarity(lines[-1] if lines else "", task.target))
