"""Task sets: what a run's executions work on (conf/workload). ``make_taskset`` picks one by kind."""

from __future__ import annotations

from workloads.api import Sandbox, TaskSet
from workloads.config import WorkloadConfig


def make_taskset(cfg: WorkloadConfig, sandbox: Sandbox) -> TaskSet:
    if cfg.kind == "wordmap":
        from workloads.tasksets.wordmap_set import WordmapTaskSet

        return WordmapTaskSet(cfg)
    from workloads.tasksets.swe import SweTaskSet

    return SweTaskSet(cfg, sandbox)
