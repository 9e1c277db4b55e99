"""The parts of a run this package supplies, built once from config: task set, harness, sandbox.

``preflight`` says in one line what keeps a run from starting (a harness binary not installed, a
sandbox that cannot run here), so ``gyre`` stops at once (exit 2) instead of crashing every
execution it launches.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workloads.api import HarnessAdapter, Sandbox, TaskSet
from workloads.config import HarnessConfig, LimitsConfig, SandboxConfig, WorkloadConfig
from workloads.harnesses import make_harness
from workloads.sandbox import SandboxUnavailable, make_sandbox
from workloads.tasksets import make_taskset

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunParts:
    taskset: TaskSet
    harness: HarnessAdapter
    sandbox: Sandbox
    limits: LimitsConfig
    """Each harness run's limits."""
    cgroups: Any = None
    """A ``workloads.sandbox.cgroups.CgroupSupport`` where the node lets the run make cgroups."""

    def close(self) -> None:
        """Remove the run's cgroups (each run's own are removed as it ends)."""
        if self.cgroups is not None:
            self.cgroups.cleanup()


class PartsError(RuntimeError):
    """One line: what is missing and how to get it."""


def cgroup_run_name(run_dir: Path) -> str:
    """The run's cgroup name: its folder's name and a hash of the folder's whole path, so two runs of
    one ``run.run_id`` in other runs folders on a node never share (and tear down) one cgroup, while
    every attempt of one run (a resume in the same folder) gets the same."""
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:10]
    return f"{run_dir.name[:80]}-{digest}"


def build_parts(workload: WorkloadConfig, harness: HarnessConfig, sandbox: SandboxConfig, *,
                run_name: str = "") -> RunParts:
    """``run_name`` names the run's cgroup (default: this process's id)."""
    adapter = make_harness(harness, think_time=workload.think_time)
    problem = adapter.check_installed()
    if problem:
        raise PartsError(problem)
    try:
        box = make_sandbox(sandbox)
    except SandboxUnavailable as exc:
        raise PartsError(str(exc)) from None
    log.info("sandbox: %s", box.describe())
    groups = None
    if sandbox.cgroups:
        from workloads.sandbox import cgroups

        groups, why = cgroups.detect(run_name or f"pid{os.getpid()}")
        if groups is None:
            log.warning("sandbox: no cgroup per execution (%s): processes and memory are limited per process only",
                        why)
        else:
            log.info("sandbox: %s", groups.describe())
    taskset = make_taskset(workload, box, grader_limits=sandbox.grader_limits.resources(), cgroups=groups)
    return RunParts(taskset=taskset, harness=adapter, sandbox=box, limits=sandbox.limits, cgroups=groups)
