"""The bundled task set ``wordmap``: each task names a topic; the answer is the topic's phrase.

A task is a short ticket ("Ticket #4821: the success case has no return statement. Put it in
note_12.txt.") whose wording, ticket number, filler and file name vary; the grader wants the
topic's target phrase in the named file. Train and held-out eval tasks share the topics but never
a prompt, so the eval reward measures the policy on tickets it has not seen.

The phrases are return statements ("return true" for the success case, ...): one shared word and
one topic word, each a single token of the compact vocabulary. The shared word is what a tiny
random-init policy finds first by sampling (the eval reward rises by ~0.5 within 60 GSPO steps,
``bench/learnability.py``); the topic word is the harder part that needs the policy to read the
topic. The prompt never contains the phrase. The set is a pure function of ``WorkloadConfig``
(``task_seed`` and the counts): every process that builds it gets the same tasks.

The controller hands a task to the bundled harness as ``TASK.md`` in the execution's workspace:
first line ``file: <name>``, a blank line, then the prompt text (``write_task_file``).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

from workloads.config import WorkloadConfig

TASK_FILE = "TASK.md"
# A file name the harness may write: a plain name in the workspace, no directories.
FILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Topic:
    name: str
    """The word the prompt uses for the topic."""
    target: str
    """The phrase the grader wants in the file."""


# Chosen with bench/learnability.py; every word is one token of the compact vocabulary.
TOPICS: tuple[Topic, ...] = (
    Topic("success", "return true"),
    Topic("failure", "return false"),
    Topic("missing", "return null"),
    Topic("chaining", "return self"),
)


@dataclass(frozen=True)
class Task:
    task_id: str
    prompt: str
    target: str
    file_name: str
    """The workspace file the harness writes and the grader reads."""
    topic: str


_TEMPLATES = (
    "Ticket #{num}: the {topic} case has no return statement. Put it in {file}.",
    "{filler} Write the return line of the {topic} path to {file}. Ref {num}.",
    "Ticket {num}. {filler} {file} needs the line that ends the {topic} branch.",
    "Finish the {topic} branch: its last line goes in {file}. {filler} (ticket #{num})",
    "{filler} Task {num}: {file} should hold what the {topic} case returns.",
    "Request #{num}: save the {topic} return in {file}. {filler}",
)
_FILLERS = (
    "Quick one.", "Thanks!", "Low priority.", "From the ops team.", "Urgent.", "No rush.",
    "Small fix.", "See the wiki.", "For the demo.", "Before Friday.", "As discussed.", "Cheers.",
)
_FILE_STEMS = ("note", "answer", "out", "reply", "msg", "result")


def _prompt(rng: random.Random, topic: Topic) -> tuple[str, str]:
    num = rng.randrange(100, 10000)
    file_name = f"{rng.choice(_FILE_STEMS)}_{rng.randrange(10, 100)}.txt"
    template = rng.choice(_TEMPLATES)
    text = template.format(num=num, topic=topic.name, file=file_name, filler=rng.choice(_FILLERS))
    return text, file_name


def make_tasks(
    cfg: WorkloadConfig, *, topics: tuple[Topic, ...] = TOPICS
) -> tuple[list[Task], list[Task]]:
    """(train, eval): deterministic in ``cfg``; topics round-robin; no prompt in both sets.

    Eval tasks are drawn first, so changing ``num_train_tasks`` keeps the eval set fixed.
    ``topics`` exists for the learnability probe; the workload is ``TOPICS``.
    """
    if cfg.num_train_tasks < 1 or cfg.num_eval_tasks < 1:
        raise ValueError("num_train_tasks and num_eval_tasks: want >= 1")
    rng = random.Random(cfg.task_seed)
    seen: set[str] = set()

    def draw(split: str, count: int) -> list[Task]:
        tasks: list[Task] = []
        attempts = 0
        while len(tasks) < count:
            attempts += 1
            if attempts > 100 * count + 1000:
                raise ValueError(f"wordmap: cannot draw {count} distinct {split} prompts")
            topic = topics[len(tasks) % len(topics)]
            prompt, file_name = _prompt(rng, topic)
            if prompt in seen:
                continue
            seen.add(prompt)
            tasks.append(Task(
                task_id=f"wordmap-{split}-{len(tasks):04d}",
                prompt=prompt,
                target=topic.target,
                file_name=file_name,
                topic=topic.name,
            ))
        return tasks

    eval_tasks = draw("eval", cfg.num_eval_tasks)
    train_tasks = draw("train", cfg.num_train_tasks)
    return train_tasks, eval_tasks


def task_file_text(task: Task) -> str:
    return f"file: {task.file_name}\n\n{task.prompt}\n"


def write_task_file(task: Task, workspace: Path) -> Path:
    """Write ``TASK.md`` (the harness's input) into ``workspace``, creating the folder."""
    if not FILE_NAME_RE.match(task.file_name) or task.file_name == TASK_FILE:
        raise ValueError(f"{task.task_id}.file_name: not a plain workspace file name: {task.file_name!r}")
    workspace.mkdir(parents=True, exist_ok=True)
    path = workspace / TASK_FILE
    path.write_text(task_file_text(task), encoding="utf-8")
    return path
