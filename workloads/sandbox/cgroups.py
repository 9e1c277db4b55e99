"""A cgroup per execution where the node lets the run make them: caps on a whole process tree.

Per-process rlimits (``inner.py``) cannot cap a tree: RLIMIT_NPROC counts per user across the node
and the kernel never enforces it for uid 0, and RLIMIT_DATA/AS bind each process alone. A cgroup's
``pids.max`` (every process and thread of the tree at once: a fork bomb stops at it) and memory
limit (``memory.max``, or v1 ``memory.limit_in_bytes``: the tree's RAM, page cache included; the
kernel's OOM killer ends a process of the tree at it, not one outside) do.

``detect(run_name)`` finds what this node offers and makes the run's parent cgroup:

- cgroup v2, delegated (systemd ``Delegate=yes``, a Slurm or container setup that hands the user
  its cgroup): this process's cgroup C (``0::/path`` in /proc/self/cgroup, under the cgroup2 mount
  in /proc/self/mountinfo) writable, with ``pids`` and ``memory`` in ``C/cgroup.controllers``.
  Children with limits need both in ``C/cgroup.subtree_control``, which the kernel refuses (EBUSY)
  while C itself holds processes; so, as systemd-delegated services do, this process moves itself
  into a leaf ``C/gyre-<run>.controller`` first and then enables them. Any other process left in C
  (a shell that started the run) still blocks that: detection then says so and gives up. Call it
  before the controller starts children, which would otherwise stay behind in C. Executions live in
  ``C/gyre-<run>/<name>``: ``pids.max``, ``memory.max`` and ``memory.swap.max`` 0 (swap is not a way
  out of the memory cap).
- cgroup v1 (as on this development machine): the ``pids`` and ``memory`` hierarchies, each at this
  process's own path there, writable. Executions live in ``<own>/gyre-<run>/<name>`` in each:
  ``pids.max``, ``memory.limit_in_bytes`` and, where swap accounting exists,
  ``memory.memsw.limit_in_bytes`` at the same value (RAM and swap together).

v2 is tried first, then v1; ``None`` with one line naming both reasons when neither works.

What is NOT enforced: a process that can write the cgroup files can leave its cgroup. Inside bwrap
nothing of ``/sys/fs/cgroup`` is visible and no capability is left to mount it; with
``sandbox=none`` a process running as root (v1 here) or as the owner of a delegated v2 tree can
write its pid elsewhere and escape the caps (and ``kill``). The memory cap ends a process by the
OOM killer (one of the tree, usually the biggest), it does not end the whole tree. Swap is held
in only where the kernel accounts it (``memory.swap.max`` / ``memory.memsw.*`` present); elsewhere
a tree can push pages to swap past the cap, on nodes that have swap. CPU time and disk are not
capped here (rlimits, the tmpfs size and the workspace's filesystem do what they can).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shlex
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,100}")
KILL_TIMEOUT_S = 10.0
RMDIR_TIMEOUT_S = 5.0
POLL_S = 0.01
CONTROLLERS = ("pids", "memory")
JOIN_FAILED_EXIT = 126
PROC_SELF = Path("/proc/self")


def _check_name(what: str, name: str) -> None:
    if not NAME_PATTERN.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"cgroup {what} {name!r}: want 1 to 100 of [A-Za-z0-9_.-], not '.' or '..'")


class CgroupError(RuntimeError):
    """A cgroup could not be made, filled with limits, emptied or removed; the message says which and why."""


@dataclass(frozen=True)
class _Mount:
    fstype: str
    root: str
    mountpoint: str
    options: frozenset[str]
    """Super options: on a v1 mount, the controllers it holds (``pids``, ``memory``...)."""


def parse_mountinfo(text: str) -> list[_Mount]:
    """The cgroup and cgroup2 mounts of a /proc/PID/mountinfo text."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 4 or fields[sep + 1] not in ("cgroup", "cgroup2"):
            continue
        mounts.append(_Mount(fstype=fields[sep + 1], root=_unescape(fields[3]), mountpoint=_unescape(fields[4]),
                             options=frozenset(fields[sep + 3].split(","))))
    return mounts


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """/proc/PID/cgroup as {controller: path}; the v2 entry (``0::/path``) under the key ''."""
    own = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for name in controllers.split(",") if controllers else [""]:
            own[name] = path
    return own


def _locate(mount: _Mount, path: str) -> Path | None:
    """Where cgroup ``path`` (as /proc/self/cgroup names it) lies under ``mount``; None: not in its view."""
    root = mount.root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None
    return Path(mount.mountpoint + path[len(root):])


# Every change to a cgroup tree goes through _write, _mkdir and _rmdir_once, and every read through
# _read: the tests put a model of the kernel's v2 rules behind them where a node has no v2 to try.

def _read(path: Path) -> str:
    return path.read_text()


def _mkdir(path: Path, *, exist_ok: bool = False) -> None:
    path.mkdir(exist_ok=exist_ok)


def _rmdir_once(path: Path) -> None:
    path.rmdir()


def _write(path: Path, value: str) -> None:
    # Each write to a cgroup file is one request to the kernel: no buffering, and the error it
    # returns (EBUSY, EINVAL...) surfaces here instead of at close.
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _keyed(path: Path, key: str) -> int:
    """The value of ``key`` in a flat keyed file (``max 3``, ``oom_kill 1``); 0 when absent."""
    try:
        for line in _read(path).splitlines():
            k, _, v = line.partition(" ")
            if k == key and v.strip().isdigit():
                return int(v)
    except FileNotFoundError:
        pass
    return 0


@dataclass(frozen=True)
class _Hierarchy:
    """One place the run's cgroups live: v2's single tree, or one v1 controller's."""

    kind: Literal["v2", "pids", "memory"]
    parent: Path
    """The run's cgroup: ``.../gyre-<run>``."""


class ExecutionCgroup:
    """One execution's cgroup (one directory per hierarchy) and the limits written into it."""

    def __init__(self, *, version: Literal[1, 2], paths: dict[str, Path]) -> None:
        self.version = version
        self.paths = paths
        """{hierarchy kind: directory}: ``{"v2": ...}`` or ``{"pids": ..., "memory": ...}``."""
        self._final_events: dict[str, int] | None = None

    def join_argv(self) -> list[str]:
        """An argv prefix: ``/bin/sh -c`` writes its own pid into each ``cgroup.procs``, then
        ``exec "$@"`` — so the command (a bwrap, say) is inside from its first instruction, and so is
        everything it starts. A failed join runs nothing: one line on stderr, exit 126."""
        joins = " && ".join(f"echo $$ > {shlex.quote(str(p / 'cgroup.procs'))}" for p in self.paths.values())
        script = (f"{joins} || {{ echo gyre cgroup: cannot join {shlex.quote(self.describe())} >&2; "
                  f"exit {JOIN_FAILED_EXIT}; }}; exec \"$@\"")
        return ["/bin/sh", "-c", script, "gyre-cgroup-join"]

    def pids(self) -> set[int]:
        """The processes in it now (each hierarchy's ``cgroup.procs``; none once removed)."""
        found: set[int] = set()
        for path in self.paths.values():
            try:
                found.update(int(p) for p in _read(path / "cgroup.procs").split())
            except FileNotFoundError:
                pass
        return found

    def kill(self) -> None:
        """SIGKILL every process in it and wait until it is empty; a no-op when it already is (or is gone).

        v2 with ``cgroup.kill`` (Linux 5.14+): the kernel kills the whole cgroup at once, forks in
        flight included. Else rounds of SIGKILL to each pid in ``cgroup.procs`` until none is left:
        a child forked between a read and the kills shows in the next read, and ``pids.max`` keeps
        the tree finite. Each pid is signalled through a pidfd opened before the membership is read
        again, so a pid reused by a process outside is never hit. ``CgroupError`` if processes
        remain after ``KILL_TIMEOUT_S``."""
        v2 = self.paths.get("v2")
        kill_file = v2 / "cgroup.kill" if v2 is not None and (v2 / "cgroup.kill").exists() else None
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while pids := self.pids():
            if time.monotonic() > deadline:
                raise CgroupError(f"{self.describe()}: processes {sorted(pids)[:20]} still alive after "
                                  f"{KILL_TIMEOUT_S:.0f} s of SIGKILL")
            if kill_file is None:
                self._kill_round(pids)
            else:
                try:
                    _write(kill_file, "1")
                except FileNotFoundError:  # removed meanwhile: nothing left to kill
                    return
            time.sleep(POLL_S)

    def _kill_round(self, pids: set[int]) -> None:
        handles = {}
        for pid in pids:
            try:
                handles[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            except OSError:  # no pidfds on this kernel (before 5.3): a plain kill, racing pid reuse
                handles[pid] = -1
        try:
            still = self.pids()
            for pid, fd in handles.items():
                if pid not in still:
                    continue
                try:
                    if fd >= 0:
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                    else:
                        os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        finally:
            for fd in handles.values():
                if fd >= 0:
                    os.close(fd)

    def events(self) -> dict[str, int]:
        """What the limits did so far: ``pids_max_hits`` (forks refused at ``pids.max``) and
        ``oom_kills`` (processes the OOM killer ended at the memory cap). After ``remove()``, the
        counts as they were just before. Not counted: how often memory reached its cap and was
        reclaimed (v2 ``memory.events`` max, v1 ``memory.failcnt``), which page cache alone does."""
        if self._final_events is not None:
            return dict(self._final_events)
        pids_dir = self.paths.get("pids") or self.paths.get("v2")
        memory_dir = self.paths.get("memory") or self.paths.get("v2")
        assert pids_dir is not None and memory_dir is not None
        oom_file = memory_dir / ("memory.events" if self.version == 2 else "memory.oom_control")
        return {"pids_max_hits": _keyed(pids_dir / "pids.events", "max"), "oom_kills": _keyed(oom_file, "oom_kill")}

    def remove(self) -> None:
        """``kill()``, then remove its directories; idempotent. ``CgroupError`` if one stays busy."""
        if self._final_events is not None:
            return
        self.kill()
        events = self.events()
        for path in self.paths.values():
            _rmdir(path)
        self._final_events = events

    def describe(self) -> str:
        return f"cgroup v{self.version} " + ", ".join(str(p) for p in self.paths.values())


def _rmdir(path: Path) -> None:
    """rmdir, waiting out the moment after a kill when exiting tasks still count as members."""
    deadline = time.monotonic() + RMDIR_TIMEOUT_S
    while True:
        try:
            _rmdir_once(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise CgroupError(f"cannot remove cgroup {path}: {exc.strerror}") from None
            time.sleep(POLL_S)


class CgroupSupport:
    """The run's parent cgroup(s), made by ``detect``; ``create`` makes one execution's inside."""

    def __init__(self, *, version: Literal[1, 2], hierarchies: tuple[_Hierarchy, ...],
                 leaf: _ControllerLeaf | None = None) -> None:
        self.version = version
        self.hierarchies = hierarchies
        self._leaf = leaf

    def create(self, name: str, *, processes: int, memory_bytes: int) -> ExecutionCgroup:
        """A new, empty cgroup ``name`` with at most ``processes`` processes and threads together
        and ``memory_bytes`` of memory for the tree (0: no limit for that one). ``ValueError`` for a
        bad name or a negative limit; ``CgroupError`` when it exists already or a limit cannot be
        written (nothing of it is left then)."""
        _check_name("name", name)
        if processes < 0 or memory_bytes < 0:
            raise ValueError(f"cgroup {name}: want limits >= 0, got processes={processes} memory_bytes={memory_bytes}")
        made: dict[str, Path] = {}
        group = ExecutionCgroup(version=self.version, paths=made)
        try:
            for h in self.hierarchies:
                path = h.parent / name
                _mkdir(path)
                made[h.kind] = path
                if h.kind in ("v2", "pids"):
                    _write(path / "pids.max", str(processes) if processes else "max")
                if memory_bytes and h.kind == "v2":
                    _write(path / "memory.max", str(memory_bytes))
                    if (path / "memory.swap.max").exists():
                        _write(path / "memory.swap.max", "0")
                if memory_bytes and h.kind == "memory":
                    _write(path / "memory.limit_in_bytes", str(memory_bytes))  # first: memsw may not go below it
                    if (path / "memory.memsw.limit_in_bytes").exists():
                        _write(path / "memory.memsw.limit_in_bytes", str(memory_bytes))
        except OSError as exc:
            for path in made.values():
                _rmdir(path)
            raise CgroupError(f"cannot make cgroup {name} under {self.describe_paths()}: {exc}") from None
        return group

    def cleanup(self) -> None:
        """Kill and remove every execution cgroup left under the run's parent, then the parent, and
        on v2 give the controllers' leaf back (where no other cgroup still uses the controllers we
        enabled: else that leaf, holding this process, stays). Idempotent."""
        names = {p.name for h in self.hierarchies if h.parent.exists() for p in h.parent.iterdir() if p.is_dir()}
        for name in sorted(names):
            ExecutionCgroup(version=self.version, paths={h.kind: h.parent / name for h in self.hierarchies}).remove()
        for h in self.hierarchies:
            _rmdir(h.parent)
        if self._leaf is not None:
            self._leaf.give_back()
            self._leaf = None

    def describe_paths(self) -> str:
        return ", ".join(str(h.parent) for h in self.hierarchies)

    def describe(self) -> str:
        if self.version == 2:
            return (f"cgroup v2 per execution under {self.describe_paths()}: pids.max and memory.max "
                    "(no swap) for each whole process tree")
        return (f"cgroup v1 per execution under {self.describe_paths()}: pids.max and memory.limit_in_bytes "
                "(with swap where accounted) for each whole process tree")


@dataclass
class _ControllerLeaf:
    """The v2 leaf this process moved into so that its own cgroup could enable controllers below."""

    own: Path
    leaf: Path
    enabled: tuple[str, ...]

    def give_back(self) -> None:
        try:
            if self.enabled:
                _write(self.own / "cgroup.subtree_control", " ".join(f"-{c}" for c in self.enabled))
            _write(self.own / "cgroup.procs", str(os.getpid()))
            _rmdir(self.leaf)
        except (OSError, CgroupError) as exc:
            log.info("cgroup v2: leaving this process in %s (%s)", self.leaf, exc)


def detect(run_name: str) -> tuple[CgroupSupport | None, str]:
    """(the support, '') where this node lets this process make cgroups with pids and memory
    limits, its run parent ``gyre-<run_name>`` made; else (None, one line why not). See the module
    doc for what each version takes. ``ValueError`` for a bad ``run_name``."""
    _check_name("run name", run_name)
    try:
        own = parse_proc_cgroup(_read(PROC_SELF / "cgroup"))
        mounts = parse_mountinfo(_read(PROC_SELF / "mountinfo"))
    except OSError as exc:
        return None, f"cannot read /proc/self: {exc}"
    support, why_v2 = _detect_v2(run_name, own, mounts)
    if support is not None:
        return support, ""
    support, why_v1 = _detect_v1(run_name, own, mounts)
    if support is not None:
        return support, ""
    return None, f"cgroup v2: {why_v2}; cgroup v1: {why_v1}"


def _detect_v2(run_name: str, own: dict[str, str], mounts: list[_Mount]) -> tuple[CgroupSupport | None, str]:
    if "" not in own:
        return None, "this process has no cgroup v2 entry in /proc/self/cgroup"
    found = [p for m in mounts if m.fstype == "cgroup2" and (p := _locate(m, own[""])) is not None]
    if not found:
        return None, f"no cgroup2 mount shows this process's cgroup {own['']}"
    cgroup = found[0]
    try:
        offered = set(_read(cgroup / "cgroup.controllers").split())
        enabled = set(_read(cgroup / "cgroup.subtree_control").split())
    except OSError as exc:
        return None, f"{cgroup}: {exc}"
    missing = [c for c in CONTROLLERS if c not in offered]
    if missing:
        return None, (f"{cgroup} offers {' '.join(sorted(offered)) or 'no controllers'}, not {' '.join(missing)} "
                      "(not delegated here, or held by v1 hierarchies)")
    leaf = None
    to_enable = tuple(c for c in CONTROLLERS if c not in enabled)
    if to_enable:
        leaf, why = _enable_below(cgroup, run_name, to_enable)
        if why:
            return None, why
    parent = cgroup / f"gyre-{run_name}"
    try:
        _mkdir(parent, exist_ok=True)
        _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
    except OSError as exc:
        _rmdir_quietly(parent)
        if leaf is not None:
            leaf.give_back()
        return None, f"cannot make the run's cgroup {parent} with pids and memory: {exc}"
    return CgroupSupport(version=2, hierarchies=(_Hierarchy("v2", parent),), leaf=leaf), ""


def _enable_below(cgroup: Path, run_name: str, controllers: tuple[str, ...]) -> tuple[_ControllerLeaf | None, str]:
    """Enable ``controllers`` in ``cgroup``'s subtree_control, moving this process into a leaf
    first when the cgroup holds processes (the kernel's no-internal-process rule)."""
    request = " ".join(f"+{c}" for c in controllers)
    control = cgroup / "cgroup.subtree_control"
    try:
        _write(control, request)
        return None, ""
    except OSError as exc:
        if exc.errno != errno.EBUSY:  # EBUSY: processes in it; anything else (EACCES, EROFS) is final
            hint = f" (not delegated to uid {os.getuid()})" if exc.errno in (errno.EACCES, errno.EPERM) else ""
            return None, f"cannot enable {' '.join(controllers)} in {control}: {exc.strerror}{hint}"
    leaf = cgroup / f"gyre-{run_name}.controller"
    try:
        _mkdir(leaf, exist_ok=True)
        _write(leaf / "cgroup.procs", str(os.getpid()))
    except OSError as exc:
        _rmdir_quietly(leaf)
        return None, f"cannot move this process into {leaf} to free {cgroup} for children: {exc.strerror}"
    try:
        _write(control, request)
    except OSError as exc:
        others = _read(cgroup / "cgroup.procs").split()
        _ControllerLeaf(own=cgroup, leaf=leaf, enabled=()).give_back()
        held = f" (it still holds processes {' '.join(others[:10])}: start the run from a cgroup of its own)" \
            if others else ""
        return None, f"cannot enable {' '.join(controllers)} in {control}: {exc.strerror}{held}"
    return _ControllerLeaf(own=cgroup, leaf=leaf, enabled=controllers), ""


def _detect_v1(run_name: str, own: dict[str, str], mounts: list[_Mount]) -> tuple[CgroupSupport | None, str]:
    hierarchies: list[_Hierarchy] = []
    for controller in CONTROLLERS:
        if controller not in own:
            why = f"this process is in no {controller} hierarchy"
            break
        found = [p for m in mounts if m.fstype == "cgroup" and controller in m.options
                 and (p := _locate(m, own[controller])) is not None]
        if not found:
            why = f"no v1 {controller} mount shows this process's cgroup {own[controller]}"
            break
        parent = found[0] / f"gyre-{run_name}"
        limit = "pids.max" if controller == "pids" else "memory.limit_in_bytes"
        try:
            _mkdir(parent, exist_ok=True)
        except OSError as exc:
            why = f"cannot make {parent}: {exc.strerror}"
            break
        hierarchies.append(_Hierarchy(controller, parent))  # type: ignore[arg-type]
        if not (parent / limit).exists():
            why = f"{parent} has no {limit}"
            break
    else:
        return CgroupSupport(version=1, hierarchies=tuple(hierarchies)), ""
    for h in hierarchies:
        _rmdir_quietly(h.parent)
    return None, why


def _rmdir_quietly(path: Path) -> None:
    try:
        _rmdir_once(path)
    except OSError:
        pass
