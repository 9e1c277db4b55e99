"""workloads/sandbox/cgroups.py with the node's real cgroups and real processes.

Every attack is bounded (200 forks, 600 MiB, children that sleep 60 s at most) and shown to work
in a cgroup without the limit first, so a limit that held nothing back could not pass. Where the
node offers no cgroups these tests skip on a developer's machine and fail in CI (``CI=true``),
which runs as root with writable hierarchies: a check that cannot run there must not pass quietly.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from workloads.sandbox import cgroups
from workloads.sandbox.bwrap import bwrap_problem
from workloads.sandbox.cgroups import CgroupError, ExecutionCgroup

PY = "/usr/bin/python3"
IN_CI = os.environ.get("CI") == "true"

# Forks N children that each sleep (60 s at most), counts the forks the kernel allowed, prints the
# count and sleeps too, so the whole tree is in the cgroup while the test looks.
BOMB = r'''
import os, sys, time
started = 0
for _ in range(int(sys.argv[1])):
    try:
        pid = os.fork()
    except OSError:
        continue
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    started += 1
print(started, flush=True)
time.sleep(60)
'''
HOG = "b = b'x' * (600 << 20)\nprint('survived', len(b))"  # multiplying writes, so every page is touched


def _unavailable(why: str) -> None:
    if IN_CI:
        pytest.fail(f"CI must run this: {why}")
    pytest.skip(why)


def _run_name() -> str:
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def support():
    found, why = cgroups.detect(_run_name())
    if found is None:
        _unavailable(f"no cgroups for this process here: {why}")
    yield found
    found.cleanup()


@pytest.fixture
def group_factory(support):
    made: list[ExecutionCgroup] = []

    def make(*, processes: int = 0, memory_bytes: int = 0) -> ExecutionCgroup:
        group = support.create(f"ex-{uuid.uuid4().hex[:8]}", processes=processes, memory_bytes=memory_bytes)
        made.append(group)
        return group

    yield make
    for group in made:
        group.remove()


def spawn(group: ExecutionCgroup, argv: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([*group.join_argv(), *argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def read_line(proc: subprocess.Popen, timeout_s: float = 30) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no output within {timeout_s} s"
    return proc.stdout.readline().strip()


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def finish(proc: subprocess.Popen) -> int:
    proc.kill()
    proc.communicate(timeout=30)
    return proc.returncode


def test_detect_makes_the_run_parent(support):
    assert support.version in (1, 2)
    assert all(h.parent.is_dir() and h.parent.name.startswith("gyre-test-") for h in support.hierarchies)
    kinds = {h.kind for h in support.hierarchies}
    assert kinds == ({"v2"} if support.version == 2 else {"pids", "memory"})
    assert f"cgroup v{support.version}" in support.describe() and "pids.max" in support.describe()


def test_fork_bomb_is_held_at_pids_max(group_factory):
    open_, capped = group_factory(processes=0), group_factory(processes=32)
    attack = spawn(open_, [PY, "-I", "-S", "-c", BOMB, "200"])
    held = spawn(capped, [PY, "-I", "-S", "-c", BOMB, "200"])
    try:
        assert int(read_line(attack)) == 200  # the attack works where nothing holds it
        assert len(open_.pids()) == 201 and open_.events()["pids_max_hits"] == 0
        started = int(read_line(held))
        assert started <= 31  # 32 with the forking parent itself
        assert len(capped.pids()) <= 32
        assert capped.events()["pids_max_hits"] >= 200 - started
    finally:
        open_.kill()
        capped.kill()
        assert finish(attack) == finish(held) == -signal.SIGKILL


def test_memory_hog_is_stopped_at_the_memory_limit(group_factory):
    free, capped = group_factory(), group_factory(memory_bytes=128 << 20)
    ok = subprocess.run([*free.join_argv(), PY, "-I", "-S", "-c", HOG], capture_output=True, text=True, timeout=60)
    assert (ok.returncode, ok.stdout.strip()) == (0, f"survived {600 << 20}"), ok.stderr  # works without the limit
    r = subprocess.run([*capped.join_argv(), PY, "-I", "-S", "-c", HOG], capture_output=True, text=True, timeout=60)
    assert "survived" not in r.stdout
    if r.returncode == -signal.SIGKILL:
        assert capped.events()["oom_kills"] >= 1
    else:
        assert "MemoryError" in r.stderr, (r.returncode, r.stderr)
    assert free.events()["oom_kills"] == 0


def test_kill_leaves_no_process(group_factory):
    group = group_factory(processes=64)
    # children that leave the process group and the session too: a group kill would miss them
    proc = spawn(group, ["/bin/sh", "-c", "setsid sleep 60 & (sleep 60 &); sleep 60 & echo up; wait"],
                 start_new_session=True)
    try:
        assert read_line(proc) == "up"
        deadline = time.monotonic() + 10
        while len(group.pids()) < 4:
            assert time.monotonic() < deadline, group.pids()
            time.sleep(0.01)
        inside = group.pids()
        group.kill()
        assert group.pids() == set()
        assert not any(alive(p) for p in inside)
        group.kill()  # again: nothing left, returns at once
    finally:
        assert finish(proc) == -signal.SIGKILL


def test_remove_leaves_no_directory(support):
    group = support.create(f"ex-{uuid.uuid4().hex[:8]}", processes=8, memory_bytes=64 << 20)
    paths = list(group.paths.values())
    assert len(paths) == len(support.hierarchies) and all(p.is_dir() for p in paths)
    proc = spawn(group, ["sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while proc.pid not in group.pids():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        group.remove()  # with a process inside: killed first
        assert not any(p.exists() for p in paths)
        assert all(h.parent.is_dir() for h in support.hierarchies)  # the run's parent stays
        group.remove()
        assert group.events() == {"pids_max_hits": 0, "oom_kills": 0}
    finally:
        assert finish(proc) == -signal.SIGKILL


def test_cleanup_removes_every_level_it_made():
    second, why = cgroups.detect(_run_name())
    assert second is not None, why
    a, b = second.create("a", processes=4, memory_bytes=0), second.create("b", processes=0, memory_bytes=32 << 20)
    procs = [spawn(g, ["sleep", "60"]) for g in (a, b)]
    try:
        deadline = time.monotonic() + 10
        while not all(p.pid in g.pids() for p, g in zip(procs, (a, b))):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        second.cleanup()
        assert not any(h.parent.exists() for h in second.hierarchies)
        assert not any(alive(p.pid) for p in procs)
        second.cleanup()
    finally:
        second.cleanup()
        for p in procs:
            finish(p)


def test_join_prefix_puts_bwrap_and_everything_inside_in_the_cgroup(group_factory, tmp_path):
    if bwrap_problem(""):
        _unavailable(f"bwrap cannot run here: {bwrap_problem('')}")
    group = group_factory(processes=32)
    bwrap = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid", "--unshare-net",
             "--unshare-cgroup-try", "--die-with-parent", "--cap-drop", "ALL", "--bind", str(tmp_path), str(tmp_path),
             "--"]
    proc = spawn(group, [*bwrap, PY, "-I", "-S", "-c", BOMB, "200"])
    try:
        started = int(read_line(proc))
        inside = group.pids()
        assert proc.pid in inside  # the bwrap process itself: the sh exec'd it in place
        assert started <= 29 and len(inside) <= 32  # bwrap outside, bwrap's init, the bomb's parent, its children
        assert group.events()["pids_max_hits"] >= 1
        group.kill()
        # out of the cgroup means exiting; on a loaded machine /proc shows the exit a moment later
        deadline = time.monotonic() + 5
        while any(alive(p) for p in inside) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(alive(p) for p in inside)
    finally:
        finish(proc)


def test_names_are_checked(support):
    for bad in ("", ".", "..", "a/b", "x" * 101, "sp ace", "ü"):
        with pytest.raises(ValueError):
            support.create(bad, processes=0, memory_bytes=0)
    with pytest.raises(ValueError):
        cgroups.detect("../escape")
    with pytest.raises(ValueError):
        support.create("fine", processes=-1, memory_bytes=0)
    group = support.create(f"twice-{uuid.uuid4().hex[:8]}", processes=0, memory_bytes=0)
    try:
        with pytest.raises(CgroupError, match="exists"):
            support.create(group.paths[support.hierarchies[0].kind].name, processes=0, memory_bytes=0)
    finally:
        group.remove()


def test_join_failure_runs_nothing(support, tmp_path):
    group = support.create(f"gone-{uuid.uuid4().hex[:8]}", processes=0, memory_bytes=0)
    group.remove()
    marker = tmp_path / "ran"
    r = subprocess.run([*group.join_argv(), "touch", str(marker)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 126 and "gyre cgroup: cannot join" in r.stderr
    assert not marker.exists()


# --- parsing, on texts from real nodes (runs everywhere) -----------------------------------------

V2_CGROUP = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/gyre.scope\n"
HYBRID_CGROUP = "9:name=systemd:/\n8:pids:/\n4:memory:/process_api/fd11\n2:cpu,cpuacct:/x\n0::/\n"
MOUNTINFO = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "39 31 0:36 / /sys/fs/cgroup/pids rw,relatime shared:5 - cgroup cgroup rw,pids\n"
    "41 31 0:38 /job_7 /sys/fs/cgroup/uni\\040fied rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
    "22 1 8:1 / / rw - ext4 /dev/vda rw\n"
)


def test_parse_proc_cgroup():
    assert cgroups.parse_proc_cgroup(V2_CGROUP) == {"": V2_CGROUP.strip()[3:]}
    assert cgroups.parse_proc_cgroup(HYBRID_CGROUP) == {
        "name=systemd": "/", "pids": "/", "memory": "/process_api/fd11", "cpu": "/x", "cpuacct": "/x", "": "/"}


def test_parse_mountinfo():
    mounts = cgroups.parse_mountinfo(MOUNTINFO)
    assert [(m.fstype, m.root, m.mountpoint) for m in mounts] == [
        ("cgroup", "/", "/sys/fs/cgroup/memory"), ("cgroup", "/", "/sys/fs/cgroup/pids"),
        ("cgroup2", "/job_7", "/sys/fs/cgroup/uni fied")]
    assert "pids" in mounts[1].options and "memory" in mounts[0].options
    v2 = mounts[2]  # a mount of a subtree: paths are found relative to its root
    assert cgroups._locate(v2, "/job_7/step_0") == Path("/sys/fs/cgroup/uni fied/step_0")
    assert cgroups._locate(v2, "/job_7") == Path("/sys/fs/cgroup/uni fied")
    assert cgroups._locate(v2, "/job_70") is None



# --- cgroup v2, on a model of the kernel's rules (this machine's controllers are all on v1) -------

class FakeCgroup2:
    """cgroup v2's rules for a delegated subtree, kept on plain files: a child gets a controller's
    files only if its parent's ``cgroup.subtree_control`` enables it; enabling one is EBUSY in a
    cgroup (other than the root) that holds processes, and so is moving a process into a cgroup
    that enables any; disabling one is EBUSY while a child enables it; a process moves by writing
    its pid to ``cgroup.procs``; rmdir is EBUSY while processes or children remain; ``cgroup.kill``
    SIGKILLs the processes listed. ``read_only``: every write is EACCES (a tree not delegated)."""

    FILES = {"pids": {"pids.max": "max\n", "pids.events": "max 0\n"},
             "memory": {"memory.max": "max\n", "memory.swap.max": "max\n",
                        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n"}}

    def __init__(self, root: Path, *, offered: tuple[str, ...] = ("cpu", "memory", "pids")) -> None:
        self.root = root
        self.read_only = False
        root.mkdir()
        self._populate(root, offered)

    def _populate(self, path: Path, controllers: list[str] | tuple[str, ...]) -> None:
        (path / "cgroup.controllers").write_text(" ".join(sorted(controllers)) + "\n")
        for name in ("cgroup.subtree_control", "cgroup.procs", "cgroup.kill"):
            (path / name).write_text("")
        for c in controllers:
            for name, text in self.FILES.get(c, {}).items():
                (path / name).write_text(text)

    @staticmethod
    def words(path: Path) -> list[str]:
        return path.read_text().split()

    def mkdir(self, path: Path, *, exist_ok: bool = False) -> None:
        path.mkdir(exist_ok=exist_ok)
        if not (path / "cgroup.procs").exists():
            self._populate(path, self.words(path.parent / "cgroup.subtree_control"))

    def rmdir(self, path: Path) -> None:
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        if self.words(path / "cgroup.procs") or any(p.is_dir() for p in path.iterdir()):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
        for f in path.iterdir():
            f.unlink()
        path.rmdir()

    def write(self, path: Path, value: str) -> None:
        cg, name = path.parent, path.name
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        if self.read_only:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        busy = OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
        if name == "cgroup.subtree_control":
            enabled = set(self.words(path))
            for word in value.split():
                op, controller = word[0], word[1:]
                if controller not in self.words(cg / "cgroup.controllers"):
                    raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
                if op == "+" and cg != self.root and self.words(cg / "cgroup.procs"):
                    raise busy
                if op == "-" and any(controller in self.words(c / "cgroup.subtree_control")
                                     for c in cg.iterdir() if c.is_dir()):
                    raise busy
                (enabled.add if op == "+" else enabled.discard)(controller)
            path.write_text(" ".join(sorted(enabled)) + "\n")
        elif name == "cgroup.procs":
            if cg != self.root and self.words(cg / "cgroup.subtree_control"):
                raise busy
            pid = value.strip()
            for procs in self.root.rglob("cgroup.procs"):
                procs.write_text("".join(f"{p}\n" for p in self.words(procs) if p != pid))
            path.write_text(path.read_text() + pid + "\n")
        elif name == "cgroup.kill":
            for pid in map(int, self.words(cg / "cgroup.procs")):
                assert pid != os.getpid(), "the model was asked to kill the test itself"
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            (cg / "cgroup.procs").write_text("")
        else:
            path.write_text(value)


@pytest.fixture
def fake_v2(tmp_path, monkeypatch):
    """This process in ``/job/step`` of a cgroup2 tree whose ``/job`` enables memory and pids."""
    kernel = FakeCgroup2(tmp_path / "cgroup2")
    kernel.write(kernel.root / "cgroup.subtree_control", "+memory +pids")
    kernel.mkdir(kernel.root / "job")
    kernel.write(kernel.root / "job" / "cgroup.subtree_control", "+memory +pids")
    kernel.mkdir(kernel.root / "job" / "step")
    kernel.write(kernel.root / "job" / "step" / "cgroup.procs", str(os.getpid()))
    proc = tmp_path / "proc-self"
    proc.mkdir()
    proc.joinpath("cgroup").write_text("0::/job/step\n")
    proc.joinpath("mountinfo").write_text(f"41 31 0:38 / {kernel.root} rw,relatime - cgroup2 cgroup2 rw\n")
    monkeypatch.setattr(cgroups, "PROC_SELF", proc)
    monkeypatch.setattr(cgroups, "_write", kernel.write)
    monkeypatch.setattr(cgroups, "_mkdir", kernel.mkdir)
    monkeypatch.setattr(cgroups, "_rmdir_once", kernel.rmdir)
    return kernel


def test_v2_moves_the_controller_into_a_leaf_and_gives_it_back(fake_v2):
    step = fake_v2.root / "job" / "step"
    support, why = cgroups.detect("run1")
    assert support is not None, why
    assert support.version == 2 and [h.parent for h in support.hierarchies] == [step / "gyre-run1"]
    assert fake_v2.words(step / "gyre-run1.controller" / "cgroup.procs") == [str(os.getpid())]
    assert fake_v2.words(step / "cgroup.procs") == []
    assert fake_v2.words(step / "cgroup.subtree_control") == ["memory", "pids"]
    assert fake_v2.words(step / "gyre-run1" / "cgroup.subtree_control") == ["memory", "pids"]

    group = support.create("ex1", processes=32, memory_bytes=128 << 20)
    ex = step / "gyre-run1" / "ex1"
    assert group.paths == {"v2": ex}
    assert [(ex / f).read_text() for f in ("pids.max", "memory.max", "memory.swap.max")] == ["32", str(128 << 20), "0"]
    unlimited = support.create("ex2", processes=0, memory_bytes=0)
    assert (unlimited.paths["v2"] / "pids.max").read_text() == "max"
    assert (unlimited.paths["v2"] / "memory.max").read_text() == "max\n"  # untouched

    sleeper = subprocess.Popen([*group.join_argv(), "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while group.pids() != {sleeper.pid}:  # the join's sh wrote its own pid, then became sleep
            assert time.monotonic() < deadline, group.pids()
            time.sleep(0.01)
        (ex / "pids.events").write_text("max 7\n")
        (ex / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
        assert group.events() == {"pids_max_hits": 7, "oom_kills": 1}
        group.remove()  # cgroup.kill, then rmdir
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        assert not ex.exists() and group.events() == {"pids_max_hits": 7, "oom_kills": 1}
    finally:
        sleeper.kill()
        sleeper.wait()

    support.cleanup()  # ex2 too, the run's parent, then the leaf
    assert sorted(p.name for p in step.iterdir() if p.is_dir()) == []
    assert fake_v2.words(step / "cgroup.procs") == [str(os.getpid())]
    assert fake_v2.words(step / "cgroup.subtree_control") == []


def test_v2_gives_up_while_another_process_holds_the_cgroup(fake_v2):
    step = fake_v2.root / "job" / "step"
    (step / "cgroup.procs").write_text(f"{os.getpid()}\n4242\n")  # the shell that started the run
    support, why = cgroups.detect("run2")
    assert support is None
    assert "cgroup v2: cannot enable pids memory" in why and "4242" in why and "cgroup v1:" in why
    assert sorted(fake_v2.words(step / "cgroup.procs")) == sorted([str(os.getpid()), "4242"])  # moved back
    assert [p.name for p in step.iterdir() if p.is_dir()] == []


def test_v2_says_why_when_not_delegated(fake_v2):
    fake_v2.read_only = True
    support, why = cgroups.detect("run3")
    assert support is None and f"not delegated to uid {os.getuid()}" in why, why
    fake_v2.read_only = False
    (fake_v2.root / "job" / "step" / "cgroup.controllers").write_text("memory\n")  # /job delegates memory only
    support, why = cgroups.detect("run4")
    assert support is None and "offers memory, not pids" in why, why


def test_v2_in_the_root_cgroup_needs_no_leaf(fake_v2, tmp_path):
    (tmp_path / "proc-self" / "cgroup").write_text("0::/\n")
    fake_v2.write(fake_v2.root / "cgroup.procs", str(os.getpid()))
    support, why = cgroups.detect("run5")
    assert support is not None, why
    assert [h.parent for h in support.hierarchies] == [fake_v2.root / "gyre-run5"]
    assert not (fake_v2.root / "gyre-run5.controller").exists()
    support.cleanup()
    assert not (fake_v2.root / "gyre-run5").exists()


def test_runs_of_one_run_id_in_two_runs_folders_get_two_cgroups(tmp_path):
    """Two soaks started in the same second with one seed shared ``gyre-<run_id>``: the first to end
    removed the other's cgroup under it."""
    from workloads.parts import cgroup_run_name
    from workloads.sandbox.cgroups import NAME_PATTERN

    a, b = tmp_path / "a" / "soak-0-1796524970", tmp_path / "b" / "soak-0-1796524970"
    assert cgroup_run_name(a) != cgroup_run_name(b)
    assert cgroup_run_name(a) == cgroup_run_name(tmp_path / "a" / "." / "soak-0-1796524970")  # a resume: the same
    assert NAME_PATTERN.fullmatch(cgroup_run_name(tmp_path / ("x" * 200)))
