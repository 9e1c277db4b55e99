"""Sandboxes: what confines a harness run and its grader on a shared node (conf/sandbox).

``make_sandbox(cfg)`` picks the kind; each kind is a module with one class implementing
``workloads.api.Sandbox``. The sandbox is the security boundary: a harness runs arbitrary shell
commands, so it sees its workspace and the read-only system, nothing of the run folder, the tokens,
other workspaces or the project's own files.
"""

from __future__ import annotations

import logging

from workloads.api import Sandbox
from workloads.config import SandboxConfig
from workloads.sandbox.none import NoSandbox

log = logging.getLogger(__name__)


def make_sandbox(cfg: SandboxConfig) -> Sandbox:
    """The sandbox ``cfg`` names; ``auto`` is bwrap where it runs here, else none (logged loudly).

    Raises ``SandboxUnavailable`` for ``bwrap`` or ``apptainer`` named explicitly but not runnable here.
    """
    if cfg.kind == "none":
        return NoSandbox()
    if cfg.kind in ("bwrap", "auto"):
        from workloads.sandbox.bwrap import BwrapSandbox, bwrap_problem

        problem = bwrap_problem(cfg.binary)
        if not problem:
            return BwrapSandbox(cfg)
        if cfg.kind == "bwrap":
            raise SandboxUnavailable(f"sandbox=bwrap: {problem} (install Debian's bubblewrap: make system-packages)")
        log.warning("SANDBOX OFF: sandbox=auto found no working bwrap (%s); harnesses run unconfined", problem)
        return NoSandbox()
    from workloads.sandbox.apptainer import ApptainerSandbox, apptainer_problem

    problem = apptainer_problem(cfg.binary, cfg.image)
    if problem:
        raise SandboxUnavailable(f"sandbox=apptainer: {problem}")
    return ApptainerSandbox(cfg)


class SandboxUnavailable(RuntimeError):
    """The configured sandbox cannot run here; the run stops at start with this line."""
