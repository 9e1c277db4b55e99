"""The parts of a run this package supplies, built once from config: task set, harness, sandbox.

``preflight`` says in one line what keeps a run from starting (a harness binary not installed, a
sandbox that cannot run here), so ``gyre`` stops at once (exit 2) instead of crashing every
execution it launches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from workloads.api import HarnessAdapter, Sandbox, TaskSet
from workloads.config import HarnessConfig, SandboxConfig, WorkloadConfig
from workloads.harnesses import make_harness
from workloads.sandbox import SandboxUnavailable, make_sandbox
from workloads.tasksets import make_taskset

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunParts:
    taskset: TaskSet
    harness: HarnessAdapter
    sandbox: Sandbox


class PartsError(RuntimeError):
    """One line: what is missing and how to get it."""


def build_parts(workload: WorkloadConfig, harness: HarnessConfig, sandbox: SandboxConfig) -> RunParts:
    adapter = make_harness(harness, think_time=workload.think_time)
    problem = adapter.check_installed()
    if problem:
        raise PartsError(problem)
    try:
        box = make_sandbox(sandbox)
    except SandboxUnavailable as exc:
        raise PartsError(str(exc)) from None
    log.info("sandbox: %s", box.describe())
    return RunParts(taskset=make_taskset(workload, box), harness=adapter, sandbox=box)
