"""Sandboxes: what confines a harness run and its grader on a shared node (conf/sandbox).

``make_sandbox(cfg)`` picks the kind (``auto`` never falls back to none: no sandbox, no run); each kind is a module with one class implementing
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
    """The sandbox ``cfg`` names. ``auto`` is bwrap where it runs here, else apptainer where
    ``cfg.image`` is set and runs; it never falls back to no sandbox: a run that cannot confine its
    agents stops at start (``SandboxUnavailable``, one line saying what to install), and
    ``sandbox=none`` runs unconfined only when named.

    Raises ``SandboxUnavailable`` for a sandbox that cannot run here.
    """
    if cfg.kind == "none":
        log.warning("SANDBOX OFF: sandbox=none: harnesses run unconfined, as this user")
        return NoSandbox()
    from workloads.sandbox.apptainer import ApptainerSandbox, apptainer_problem
    from workloads.sandbox.bwrap import BwrapSandbox, bwrap_problem

    if cfg.kind in ("bwrap", "auto"):
        problem = bwrap_problem(cfg.binary if cfg.kind == "bwrap" else "")
        if not problem:
            return BwrapSandbox(cfg)
        if cfg.kind == "bwrap":
            raise SandboxUnavailable(f"sandbox=bwrap: {problem} ({INSTALL_BWRAP})")
        if cfg.image and not apptainer_problem("", cfg.image):
            return ApptainerSandbox(cfg)
        raise SandboxUnavailable(
            f"sandbox=auto found no working sandbox (bwrap: {problem}{'' if cfg.image else '; apptainer: no sandbox.image'}): "
            f"{INSTALL_BWRAP}, or sandbox=apptainer sandbox.image=/path/image.sif, or pass sandbox=none to run "
            "agents unconfined on purpose")
    problem = apptainer_problem(cfg.binary, cfg.image)
    if problem:
        raise SandboxUnavailable(f"sandbox=apptainer: {problem}")
    return ApptainerSandbox(cfg)


INSTALL_BWRAP = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; RHEL: dnf install bubblewrap; `make system-packages` here)"


class SandboxUnavailable(RuntimeError):
    """The configured sandbox cannot run here; the run stops at start with this line."""
