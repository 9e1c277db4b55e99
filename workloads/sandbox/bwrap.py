"""``sandbox=bwrap``: Debian's bubblewrap confines each harness run and grader on a shared node.

What bwrap enforces for one ``SandboxSpec`` (every path at the same place inside as outside, but
for the workspace, home and binds the spec shows elsewhere: a harness run sees its workspace at
``/workspace`` and its home at ``/home/agent``, whichever execution it is):

- Files: a read-only system (``/usr``, ``/etc`` and the ``/bin``, ``/lib*``, ``/sbin`` that exist,
  merged-/usr symlinks kept as symlinks) on an otherwise empty, read-only root. The workspace is
  writable and the cwd; ``spec.home`` is writable and ``$HOME`` (without one, an empty tmpfs at
  ``/home/sandbox`` is ``$HOME`` unless ``spec.env`` sets it); ``cfg.ro_paths`` and ``spec.ro_paths`` are read-only, visible though
  their parents are not. ``/tmp`` is a private tmpfs, ``/proc`` a new procfs of the sandbox's own
  PIDs, ``/dev`` a minimal one (null, zero, random, tty, pts, shm...). Nothing else exists: not the
  project folder, ``/root``, the run folder, the tokens, other workspaces, other users' files.
- Processes: its own PID namespace (nothing outside can be seen or signalled), IPC and UTS
  namespaces, a new session (no TIOCSTI into the controller's terminal), no capabilities, and
  ``--die-with-parent``: when the bwrap process dies, for whatever reason, everything inside is
  killed. A SIGTERM to the bwrap process is not passed in; it simply ends the sandbox like a kill.
- Network: its own network namespace with only a loopback. ``network=none``: nothing listens
  there. ``network=proxy``: the relay (``relay.py``, run by the system's ``/usr/bin/python3 -I -S``
  from a read-only bind of that one file at ``/run/gyre/relay.py``) listens on
  127.0.0.1:``spec.proxy_port`` and copies each connection to the proxy's Unix socket
  (``spec.proxy_socket``), then runs the harness as its child. So the proxy is reachable and
  nothing else on the node or beyond. The socket's *folder* is bound (read-only, at
  ``/run/gyre/proxy/``), not the socket file: a proxy restarted in place makes a new socket at the
  same path, which a bind of the old file would never see. So that folder must hold nothing but
  the socket (the controller makes one for it).
- Environment: exactly the environment the bwrap process is started with (Popen it with
  ``env=spec.env``), plus ``HOME``. The environment is not put on bwrap's argv (``--clearenv``,
  ``--setenv``) because it holds the execution token, and any user of a node can read every
  process's argv in ``/proc/*/cmdline``, while ``/proc/*/environ`` is the owner's only.

Run as root (as on this development machine), processes inside are uid 0 without capabilities:
the mounts cannot be undone, and ``/proc/sys`` is bound read-only on top of the new procfs (uid 0
may write sysctls without any capability), but root-readable files of the visible system (such as
``/etc/shadow``, masked here with ``/dev/null``) are readable. On a cluster bwrap runs as the user.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

from workloads.api import SandboxSpec
from workloads.config import SandboxConfig
from workloads.sandbox.launcher import INNER_SOURCE, inner_argv

SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
MASKED_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-")
RELAY_SOURCE = Path(__file__).with_name("relay.py")
RELAY_PYTHON = "/usr/bin/python3"
RELAY_INSIDE = "/run/gyre/relay.py"
INNER_INSIDE = "/run/gyre/inner.py"
SOCKET_DIR_INSIDE = "/run/gyre/proxy"
TMPFS_HOME = "/home/sandbox"
PROBE_TIMEOUT_S = 20.0


def find_bwrap(binary: str = "") -> str:
    """``binary``, or ``bwrap`` on PATH; '' when there is none."""
    if binary:
        return binary if os.access(binary, os.X_OK) else ""
    return shutil.which("bwrap") or ""


@functools.cache
def bwrap_problem(binary: str = "") -> str:
    """'' when bwrap can make its namespaces here (tried once per binary); else one line why not."""
    found = find_bwrap(binary)
    if not found:
        return f"no bwrap binary ({binary or 'bwrap on PATH'})"
    try:
        r = subprocess.run(
            [found, "--ro-bind", "/", "/", "--unshare-pid", "--unshare-net", "--die-with-parent", "true"],
            stdin=subprocess.DEVNULL, capture_output=True, timeout=PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{found} did not run: {exc}"
    if r.returncode != 0:
        why = r.stderr.decode(errors="replace").strip().splitlines()
        return f"{found} cannot make its namespaces here: {why[-1] if why else f'exit {r.returncode}'}"
    return ""


class BwrapSandbox:
    kind = "bwrap"
    shows_fixed_paths = True

    def __init__(self, cfg: SandboxConfig) -> None:
        self.shows_fixed_paths = cfg.fixed_paths
        self.binary = find_bwrap(cfg.binary) or cfg.binary or "bwrap"
        self.ro_paths = tuple(Path(p) for p in cfg.ro_paths)

    def wrap(self, spec: SandboxSpec) -> list[str]:
        """The bwrap command line for ``spec``; Popen it with ``env=spec.env`` (see the module doc).

        Raises ``ValueError`` for a relative path or a proxy spec without port or socket, and
        ``FileNotFoundError`` for a path that does not exist (bwrap would stop on it less clearly).
        """
        ro_paths = (*self.ro_paths, *spec.ro_paths)
        _check_paths(spec.workspace, *ro_paths, *([spec.home] if spec.home else []), *(h for h, _ in spec.ro_binds))
        _check_inside(spec)
        ws_inside = spec.workspace_inside or spec.workspace
        tmp_size = ["--size", str(spec.limits.tmp_bytes)] if spec.limits is not None and spec.limits.tmp_bytes else []
        net = [] if spec.network == "host" else ["--unshare-net"]
        argv = [self.binary, "--unshare-pid", "--unshare-ipc", "--unshare-uts", *net,
                "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--hostname", "gyre-sandbox", *_system_mounts(), *tmp_size, "--tmpfs", "/dev/shm",
                *tmp_size, "--tmpfs", "/tmp", "--bind", str(spec.workspace), str(ws_inside)]
        if spec.home is not None:
            home_inside = spec.home_inside or spec.home
            argv += ["--bind", str(spec.home), str(home_inside), "--setenv", "HOME", str(home_inside)]
        else:  # an empty private home; HOME points there unless spec.env chose one (a grader: its workspace)
            argv += ["--tmpfs", TMPFS_HOME] + ([] if "HOME" in spec.env else ["--setenv", "HOME", TMPFS_HOME])
        for path in ro_paths:  # after the workspace, so a read-only path inside it stays read-only
            argv += ["--ro-bind", str(path), str(_seen_at(path, spec))]
        for host, inside in spec.ro_binds:
            argv += ["--ro-bind", str(host), str(inside)]
        command = list(spec.argv)
        if spec.network == "proxy":
            if not spec.proxy_port or spec.proxy_socket is None:
                raise ValueError("sandbox=bwrap, network=proxy: want spec.proxy_port and spec.proxy_socket")
            _check_paths(spec.proxy_socket, Path(RELAY_PYTHON))
            socket_inside = f"{SOCKET_DIR_INSIDE}/{spec.proxy_socket.name}"
            argv += ["--ro-bind", str(RELAY_SOURCE), RELAY_INSIDE,
                     "--ro-bind", str(spec.proxy_socket.parent), SOCKET_DIR_INSIDE]
            command = [RELAY_PYTHON, "-I", "-S", RELAY_INSIDE, str(spec.proxy_port), socket_inside, *command]
        # RLIMIT_NPROC counts per user: inside the user namespace an unprivileged bwrap makes, that
        # is this sandbox's processes only (uid 0 never makes one, and the kernel exempts it anyway).
        launcher = inner_argv(RELAY_PYTHON, INNER_INSIDE, spec, nproc=True)
        argv += ["--ro-bind", str(INNER_SOURCE), INNER_INSIDE]
        return [*argv, "--remount-ro", "/", "--chdir", str(ws_inside), "--", *launcher, *command]

    def describe(self) -> str:
        return (f"sandbox=bwrap ({self.binary}): read-only system, writable workspace and home, private /tmp and "
                "/dev/shm of a set size, PID/IPC/UTS/network namespaces, no capabilities, no new privileges, "
                "nosuid binds, no setuid/setgid file can be made (seccomp), rlimits, killed with its parent; "
                "the harness reaches only the proxy (a relay on 127.0.0.1 to its Unix socket), graders no network")


def _check_inside(spec: SandboxSpec) -> None:
    for p in (spec.workspace_inside, spec.home_inside, *(inside for _, inside in spec.ro_binds)):
        if p is not None and not p.is_absolute():
            raise ValueError(f"sandbox=bwrap: want an absolute path inside, got {str(p)!r}")


def _seen_at(path: Path, spec: SandboxSpec) -> Path:
    """Where a read-only path shows inside: under the workspace it moves with the workspace."""
    if spec.workspace_inside is not None and path.is_relative_to(spec.workspace):
        return spec.workspace_inside / path.relative_to(spec.workspace)
    return path


def _system_mounts() -> list[str]:
    argv: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    for f in MASKED_FILES:
        if os.path.isfile(f):
            argv += ["--ro-bind", "/dev/null", f]
    argv += ["--proc", "/proc"]
    if os.geteuid() == 0:
        argv += ["--ro-bind", "/proc/sys", "/proc/sys"]
    return [*argv, "--dev", "/dev"]


def _check_paths(*paths: Path) -> None:
    for p in paths:
        if not p.is_absolute():
            raise ValueError(f"sandbox=bwrap: want an absolute path, got {str(p)!r}")
        if not p.exists():
            raise FileNotFoundError(f"sandbox=bwrap: {p} does not exist")
