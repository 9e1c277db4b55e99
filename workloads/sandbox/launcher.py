"""The argv of the trusted launcher (workloads/sandbox/inner.py) every sandbox kind runs first.

The launcher sets the command's rlimits, ``no_new_privs`` and the seccomp filter that keeps any
process of the tree from making a setuid or setgid file, writes the "started" byte, and only then
runs the command. Every sandbox kind puts it in front of the command, so ``sandbox=none`` gets
the limits too (not the confinement).
"""

from __future__ import annotations

from pathlib import Path

from workloads.api import SandboxSpec

INNER_SOURCE = Path(__file__).with_name("inner.py")


def inner_argv(python: str, inner: str, spec: SandboxSpec, *, nproc: bool) -> list[str]:
    """``python -I -S inner [limits] --no-setuid [--started-fd N] --`` for ``spec``. ``nproc``:
    whether RLIMIT_NPROC may be set (it counts every process of the user where the sandbox makes no
    user namespace of its own, so there it would bind the whole run)."""
    argv = [python, "-I", "-S", inner]
    lim = spec.limits
    if lim is not None:
        rlimits = {"cpu": lim.cpu_time_s, "fsize": lim.file_bytes, "nofile": lim.open_files, "data": lim.memory_bytes,
                   "nproc": lim.processes if nproc else 0}
        for name, value in rlimits.items():
            if value:
                argv += ["--rlimit", f"{name}={value}"]
        argv += ["--rlimit", "core=0"]  # a crashing test must not fill the disk with cores
    argv.append("--no-setuid")
    if spec.started_fd >= 0:
        argv += ["--started-fd", str(spec.started_fd)]
    return [*argv, "--"]
