"""Run one confined command to its end: the graders' test runs and a task's ``setup_cmd``.

``run_confined`` wraps the spec with the sandbox, puts the whole tree in a cgroup of its own where
the node lets the run make them (workloads/sandbox/cgroups.py), waits up to a timeout, and then
kills what is left: the process group, and everything in the cgroup (a child that left the group
included). It tells apart, from outside the sandbox:

- ``started``: the sandbox's launcher wrote its byte on ``spec.started_fd`` once every limit held
  (no byte: the sandbox never ran the command, a failure of the node or of Gyre);
- ``exit_code``: the command's, or None when it ran past the timeout.

The output goes to a file outside every tree the command can write, bounded by the command's own
``file_bytes`` limit; only its tail is read back.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workloads.api import Sandbox, SandboxSpec

OUTPUT_TAIL_BYTES = 64 * 1024


@dataclass
class Ran:
    exit_code: int | None
    """None: killed at the timeout."""
    started: bool
    elapsed_s: float
    output_tail: str
    limits_hit: dict[str, int] = field(default_factory=dict)
    """What the cgroup counted (``pids_max_hits``, ``oom_kills``), where there was one."""


def run_confined(sandbox: Sandbox, spec: SandboxSpec, *, timeout_s: float, output: Path, cgroups: Any = None,
                 cgroup_name: str = "") -> Ran:
    """Run ``spec`` in ``sandbox`` to its end or ``timeout_s``; ``output`` receives stdout and stderr.

    ``cgroups``: a ``cgroups.CgroupSupport`` (or None) in which a cgroup ``cgroup_name`` is made for
    this run with the spec's process and memory limits, and removed after.
    """
    read_fd, write_fd = os.pipe()
    spec = dataclasses.replace(spec, started_fd=write_fd)
    group = None
    started_at = time.monotonic()
    try:
        argv = sandbox.wrap(spec)
        if cgroups is not None and spec.limits is not None:
            group = cgroups.create(cgroup_name, processes=spec.limits.processes, memory_bytes=spec.limits.memory_bytes)
            argv = [*group.join_argv(), *argv]
        with open(output, "wb") as out:
            proc = subprocess.Popen(argv, cwd=spec.workspace, env=spec.env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(write_fd,))
            os.close(write_fd)
            write_fd = -1
            try:
                exit_code: int | None = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                exit_code = None
            finally:
                _kill_group(proc)
                if group is not None:
                    group.kill()
        started = _read_started(read_fd)
        hit = group.events() if group is not None else {}
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        os.close(read_fd)
        if group is not None:
            group.remove()
    return Ran(exit_code=exit_code, started=started, elapsed_s=time.monotonic() - started_at,
               output_tail=_tail(output), limits_hit={k: v for k, v in hit.items() if v})


def _read_started(fd: int) -> bool:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 1) == b"1"
    except BlockingIOError:
        return False


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - OUTPUT_TAIL_BYTES))
        return f.read().decode("utf-8", errors="replace")


def _kill_group(proc: subprocess.Popen) -> None:
    # Also after a normal exit: a test may have left a child running in the group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass
    proc.wait()
