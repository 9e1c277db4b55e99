"""Task sets: what a run's executions work on (conf/workload).

``make_taskset(cfg, sandbox)`` picks the implementation of ``workloads.api.TaskSet`` by
``cfg.kind``: ``swe`` (SWE-style JSONL rows, workloads/tasksets/swe.py; ``generate: pyfix`` first
writes the bundled set, workloads/tasksets/pyfix.py) or ``wordmap`` (the bundled one-turn set).
"""

from __future__ import annotations

import dataclasses

from workloads.api import Sandbox, TaskSet
from workloads.config import WorkloadConfig


def make_taskset(cfg: WorkloadConfig, sandbox: Sandbox) -> TaskSet:
    """The task set ``cfg`` names; the sandbox confines its grader's test commands."""
    if cfg.kind == "wordmap":
        from workloads.tasksets.wordmap_set import WordmapTaskSet

        return WordmapTaskSet(cfg)
    from workloads.tasksets.swe import SweTaskSet

    if cfg.generate == "pyfix":
        from workloads.tasksets import pyfix

        generated = pyfix.generate(cfg.data_dir)
        cfg = dataclasses.replace(cfg, task_file=cfg.task_file or str(generated))
    return SweTaskSet(cfg, sandbox)
