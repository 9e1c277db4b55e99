"""Task sets: what a run's executions work on (conf/workload).

``make_taskset(cfg, sandbox)`` picks the implementation of ``workloads.api.TaskSet`` by
``cfg.kind``: ``swe`` (SWE-style JSONL rows, workloads/tasksets/swe.py; ``generate`` first writes a
bundled set: ``pyfix``, workloads/tasksets/pyfix.py, or ``pkgbugs``, workloads/tasksets/pkgbugs.py)
or ``wordmap`` (the bundled one-turn set).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workloads.api import ResourceLimits, Sandbox, TaskSet
from workloads.config import WorkloadConfig


def make_taskset(cfg: WorkloadConfig, sandbox: Sandbox, *, grader_limits: ResourceLimits | None = None,
                 cgroups: Any = None) -> TaskSet:
    """The task set ``cfg`` names; the sandbox confines its grader's test commands, each within
    ``grader_limits`` and, with ``cgroups`` (a ``CgroupSupport``), in a cgroup of its own."""
    if cfg.kind == "wordmap":
        from workloads.tasksets.wordmap_set import WordmapTaskSet

        return WordmapTaskSet(cfg)
    from workloads.tasksets.swe import SweTaskSet

    if cfg.generate:
        from workloads.tasksets import pkgbugs, pyfix

        generated = {"pyfix": pyfix.generate, "pkgbugs": pkgbugs.generate}[cfg.generate](cfg.data_dir)
        cfg = dataclasses.replace(cfg, task_file=cfg.task_file or str(generated))
    return SweTaskSet(cfg, sandbox, grader_limits=grader_limits, cgroups=cgroups)
