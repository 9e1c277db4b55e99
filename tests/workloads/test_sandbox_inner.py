"""The sandbox launcher (workloads/sandbox/inner.py) with real processes, with and without bwrap.

Each test runs the launcher as the sandboxes do (``/usr/bin/python3 -I -S inner.py ... -- ARGV``),
either directly (``sandbox=none``) or inside a real bwrap (uid 0 without capabilities here, which
may still set S_ISUID on its own files: the filter is what stops it). The setuid attacks are shown
to work with the filter off, so a filter that stopped nothing could not pass. The BPF program is
also checked instruction by instruction, with a small interpreter, for both syscall tables.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from workloads.sandbox import inner
from workloads.sandbox.bwrap import bwrap_problem

ROOT = Path(__file__).resolve().parents[2]
INNER = ROOT / "workloads" / "sandbox" / "inner.py"
PY = "/usr/bin/python3"
CLAUDE = ROOT / ".tools" / "claude-code" / "node_modules" / ".bin" / "claude"
IN_CI = os.environ.get("CI") == "true"
SETID = stat.S_ISUID | stat.S_ISGID


def _unavailable(why: str) -> None:
    """Skip where a developer lacks a part; in CI, which installs every part, fail instead."""
    if IN_CI:
        pytest.fail(f"CI must run this: {why}")
    pytest.skip(why)


@pytest.fixture(params=["none", "bwrap"])
def where(request) -> str:
    if request.param == "bwrap" and bwrap_problem(""):
        _unavailable(f"bwrap cannot run here: {bwrap_problem('')}")
    return request.param


def launch(where: str, workspace: Path, opts: list[str], argv: list[str]) -> list[str]:
    """The launcher's argv, inside a bwrap like bwrap.py's (read-only system, own PID and network
    namespaces, no capabilities, only ``workspace`` writable) when ``where`` is ``bwrap``."""
    command = [PY, "-I", "-S", str(INNER), *opts, "--", *argv]
    if where == "none":
        return command
    return ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
            "--bind", str(workspace), str(workspace), "--unshare-pid", "--unshare-net", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--chdir", str(workspace), "--", *command]


def run(where: str, workspace: Path, opts: list[str], argv: list[str], **kw) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workspace), "LANG": "C.UTF-8"}
    return subprocess.run(launch(where, workspace, opts, argv), cwd=workspace, env=env, capture_output=True,
                          text=True, timeout=kw.pop("timeout", 30), **kw)


def killed_by(where: str, returncode: int) -> int:
    """The signal that ended the command: Popen says -SIG, bwrap exits 128+SIG."""
    return -returncode if where == "none" else returncode - 128


# --- the setuid attacks -------------------------------------------------------------------------

def _setuid_binary() -> str:
    for path in ("/usr/bin/passwd", "/usr/bin/su", "/usr/bin/mount", "/bin/su"):
        if os.path.isfile(path) and os.stat(path).st_mode & stat.S_ISUID:
            return path
    pytest.fail("no setuid binary on this machine to copy")


ATTACKS = r'''
import json, os, stat, subprocess, sys
setuid_binary = sys.argv[1]
out = {}

def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as exc:
        out[name] = os.strerror(exc.errno)

def sh(*argv):
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode:
        raise OSError(1, r.stderr)  # the tools print EPERM's text; the file is checked afterwards anyway

def touch(path):
    open(path, "w").close()
    return path

def tmpfile():
    os.close(os.open(".", os.O_TMPFILE | os.O_WRONLY, 0o4755))

def fchmod(path):
    fd = os.open(touch(path), os.O_WRONLY)
    try:
        os.fchmod(fd, 0o2755)
    finally:
        os.close(fd)

attempt("chmod u+s", lambda: sh("chmod", "u+s", touch("a")))
attempt("chmod g+s", lambda: sh("chmod", "g+s", touch("b")))
attempt("os.chmod 4755", lambda: os.chmod(touch("c"), 0o4755))
attempt("os.fchmod 2755", lambda: fchmod("d"))
attempt("os.open O_CREAT 4755", lambda: os.close(os.open("e", os.O_CREAT | os.O_WRONLY, 0o4755)))
attempt("os.mknod 4755", lambda: os.mknod("f", stat.S_IFREG | 0o4755))
attempt("O_TMPFILE 4755", tmpfile)
attempt("install -m 4755", lambda: sh("install", "-m", "4755", "/bin/true", "g"))
attempt("cp --preserve=mode", lambda: sh("cp", "--preserve=mode", setuid_binary, "h"))
print(json.dumps(out))
'''


def _setid_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.lstat().st_mode & SETID)


def test_no_setuid_or_setgid_file_can_be_made(where, tmp_path):
    r = run(where, tmp_path, ["--no-setuid"], [PY, "-c", ATTACKS, _setuid_binary()])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out) == 9
    assert all(v == "Operation not permitted" for v in out.values()), out
    assert _setid_files(tmp_path) == []


def test_the_attacks_work_without_the_filter(where, tmp_path):
    """The control: the same attempts, launcher without ``--no-setuid``, each leave a setuid/setgid file."""
    r = run(where, tmp_path, [], [PY, "-c", ATTACKS, _setuid_binary()])
    try:
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert all(v == "ok" for v in out.values()), out
        assert _setid_files(tmp_path) == list("abcdefgh")  # O_TMPFILE's file has no name to find
    finally:
        for p in tmp_path.iterdir():  # no setuid copy of a system binary outlives the test
            p.chmod(p.lstat().st_mode & 0o777)


# --- what must keep working ---------------------------------------------------------------------

NODE_FS = r'''
const fs = require("fs"), path = require("path");
const dir = fs.mkdtempSync(path.join(process.cwd(), "node-"));
fs.writeFileSync(path.join(dir, "a.txt"), "sync");
fs.copyFileSync(path.join(dir, "a.txt"), path.join(dir, "b.txt"));
fs.chmodSync(path.join(dir, "b.txt"), 0o755);
(async () => {
  await fs.promises.writeFile(path.join(dir, "c.txt"), "async");
  const s = fs.createWriteStream(path.join(dir, "d.txt"));
  await new Promise((ok) => s.end("stream", ok));
  const got = ["a.txt", "b.txt", "c.txt", "d.txt"].map((f) => fs.readFileSync(path.join(dir, f), "utf8"));
  got.push(await fs.promises.readFile(path.join(dir, "c.txt"), "utf8"));
  console.log(JSON.stringify({got, mode: (fs.statSync(path.join(dir, "b.txt")).mode & 0o7777).toString(8)}));
})();
'''

ORDINARY = f'''set -e
echo plain > plain.txt
chmod 755 plain.txt && test -x plain.txt && echo chmod-ok
mkdir -p sub/deeper && echo ok > sub/deeper/f && echo mkdir-ok
{PY} -c 'open("py.txt", "w").write("py"); print(open("py.txt").read() + "-ok")'
git init -q repo && cd repo && echo x > f && git add f
git -c user.name=t -c user.email=t@example.com commit -qm init && git log --format=%s && cd ..
node -e '{NODE_FS}'
'''


def test_ordinary_work_runs_under_the_filter(where, tmp_path):
    for tool in ("git", "node"):
        if not shutil.which(tool):
            _unavailable(f"no {tool} on PATH (make system-packages)")
    r = run(where, tmp_path, ["--no-setuid", "--rlimit", "core=0", "--rlimit", "nofile=1024"],
            ["/bin/sh", "-c", ORDINARY])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:4] == ["chmod-ok", "mkdir-ok", "py-ok", "init"]  # "init": the commit's subject, from git log
    node = json.loads(lines[4])
    assert node == {"got": ["sync", "sync", "async", "stream", "async"], "mode": "755"}
    assert stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o755


def test_claude_code_runs_under_the_filter(where, tmp_path):
    if not CLAUDE.exists():
        _unavailable(f"no {CLAUDE} (make claude-code)")
    r = run(where, tmp_path, ["--no-setuid"], [str(CLAUDE), "--version"])
    assert r.returncode == 0, r.stderr
    assert "Claude Code" in r.stdout


def test_status_shows_no_new_privs_and_seccomp(where, tmp_path):
    r = run(where, tmp_path, ["--no-setuid"], ["cat", "/proc/self/status"])
    assert r.returncode == 0, r.stderr
    status = dict(re.findall(r"^(\w+):\s+(\S+)", r.stdout, re.M))
    assert (status["NoNewPrivs"], status["Seccomp"]) == ("1", "2")
    plain = run(where, tmp_path, [], ["cat", "/proc/self/status"])
    assert "Seccomp:\t0" in plain.stdout  # without the option, no filter


# --- rlimits ------------------------------------------------------------------------------------

LIMITS = {"nproc": (4096, "Max processes"), "as": (8 << 30, "Max address space"), "data": (4 << 30, "Max data size"),
          "cpu": (100, "Max cpu time"), "fsize": (1 << 30, "Max file size"), "nofile": (512, "Max open files"),
          "core": (0, "Max core file size"), "stack": (16 << 20, "Max stack size")}


def test_each_rlimit_is_set_soft_and_hard(where, tmp_path):
    opts = [a for name, (value, _) in LIMITS.items() for a in ("--rlimit", f"{name}={value}")]
    r = run(where, tmp_path, opts, ["cat", "/proc/self/limits"])
    assert r.returncode == 0, r.stderr
    shown = {}
    for line in r.stdout.splitlines()[1:]:
        cols = re.split(r"\s{2,}", line.strip())
        shown[cols[0]] = tuple(cols[1:3])
    for name, (value, label) in LIMITS.items():
        assert shown[label] == (str(value), str(value)), (name, shown[label])


def test_fsize_stops_a_write_past_it(where, tmp_path):
    # head gets SIGXFSZ's default back (Python ignores it for itself): killed, the file at the limit
    r = run(where, tmp_path, ["--rlimit", "fsize=1048576"],
            ["/bin/sh", "-c", "head -c 4194304 /dev/zero > big; echo $?"])
    assert r.stdout.strip() == str(128 + signal.SIGXFSZ), (r.stdout, r.stderr)
    assert (tmp_path / "big").stat().st_size == 1 << 20


def test_cpu_kills_a_busy_loop(where, tmp_path):
    r = run(where, tmp_path, ["--rlimit", "cpu=1"], [PY, "-c", "while True: pass"], timeout=60)
    assert killed_by(where, r.returncode) in (signal.SIGXCPU, signal.SIGKILL), (r.returncode, r.stderr)


# --- the started byte and failures --------------------------------------------------------------

def _started(where: str, workspace: Path, opts: list[str],
             argv: list[str]) -> tuple[subprocess.CompletedProcess, bytes]:
    read_fd, write_fd = os.pipe()
    try:
        argv_full = launch(where, workspace, [*opts, "--started-fd", str(write_fd)], argv)
        r = subprocess.run(argv_full, cwd=workspace, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                           timeout=30, pass_fds=(write_fd,))
        os.close(write_fd)
        write_fd = -1
        return r, os.read(read_fd, 16)
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        os.close(read_fd)


def test_started_byte_on_success_and_fd_closed_before_the_command(where, tmp_path):
    r, got = _started(where, tmp_path, ["--no-setuid", "--rlimit", "nofile=256"],
                      ["/bin/sh", "-c", 'ls /proc/self/fd | tr "\\n" " "'])
    assert (r.returncode, got) == (0, b"1"), r.stderr
    fds = r.stdout.split()
    assert len(fds) <= 4, fds  # 0, 1, 2 and ls's own listing fd: the started fd is gone


@pytest.mark.parametrize(("opts", "argv", "code", "says"), [
    (["--frobnicate"], ["true"], 126, "bad option '--frobnicate'"),
    (["--rlimit", "bogus=1"], ["true"], 126, "bad --rlimit 'bogus=1'"),
    (["--rlimit", "nofile=-1"], ["true"], 126, "bad --rlimit"),
    (["--rlimit", f"nofile={1 << 40}"], ["true"], 126, "setrlimit nofile="),
    (["--no-setuid"], [], 126, "no command after --"),
    (["--no-setuid"], ["/no/such/program"], 127, "cannot run '/no/such/program'"),
])
def test_a_failure_writes_no_started_byte(where, tmp_path, opts, argv, code, says):
    r, got = _started(where, tmp_path, opts, argv)
    assert (r.returncode, got) == (code, b"")
    assert r.stderr.startswith("gyre inner: ") and says in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_missing_separator_and_bad_started_fd_are_refused(tmp_path):
    for args in (["--no-setuid", "true"], ["--started-fd", "x", "--", "true"], ["--started-fd", "999", "--", "true"]):
        r = subprocess.run([PY, "-I", "-S", str(INNER), *args], capture_output=True, text=True, timeout=30)
        assert r.returncode == 126 and r.stderr.startswith("gyre inner: "), (args, r.stderr)


# --- the BPF program itself ---------------------------------------------------------------------

ALLOW, EPERM, ENOSYS = inner.SECCOMP_RET_ALLOW, inner.SECCOMP_RET_ERRNO | 1, inner.SECCOMP_RET_ERRNO | 38
I386, ARM = 0x40000003, 0x40000028


def evaluate(prog: list[tuple[int, int, int, int]], *, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """Classic BPF as the kernel runs it over struct seccomp_data, for the four opcodes the builder uses."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    pc, acc = 0, 0
    for _ in range(len(prog)):  # no backward jumps: each step moves on
        code, jt, jf, k = prog[pc]
        if code == inner.BPF_LD_W_ABS:
            acc, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code == inner.BPF_JEQ_K:
            pc += 1 + (jt if acc == k else jf)
        elif code == inner.BPF_JSET_K:
            pc += 1 + (jt if acc & k else jf)
        elif code == inner.BPF_RET_K:
            return k
        else:
            raise AssertionError(f"opcode {code:#x}")
    raise AssertionError("ran off the program")


@pytest.mark.parametrize("machine", sorted(inner.MACHINES))
def test_filter_shape(machine):
    prog = inner.build_filter(machine)
    assert 10 < len(prog) < 100  # one block per checked call; jump offsets are 8-bit
    assert prog[0] == (inner.BPF_LD_W_ABS, 0, 0, inner.OFFSET_ARCH)  # the arch before any number is trusted
    assert prog[-1] == (inner.BPF_RET_K, 0, 0, ALLOW)
    for pc, (code, jt, jf, _) in enumerate(prog):
        assert code in (inner.BPF_LD_W_ABS, inner.BPF_JEQ_K, inner.BPF_JSET_K, inner.BPF_RET_K)
        if code in (inner.BPF_JEQ_K, inner.BPF_JSET_K):
            assert pc + 1 + max(jt, jf) < len(prog)
    assert len(b"".join(struct.pack("=HBBI", *i) for i in prog)) == 8 * len(prog)  # struct sock_filter


@pytest.mark.parametrize("machine", sorted(inner.MACHINES))
def test_filter_decisions(machine):
    prog, table = inner.build_filter(machine), inner.MACHINES[machine]
    calls, arch = table.calls, table.arch

    def verdict(call: str, *args: int, nr_bits: int = 0, on_arch: int = arch) -> int:
        return evaluate(prog, nr=calls[call] | nr_bits, arch=on_arch, args=args)

    high = 0xFFFF_FFFF_0000_0000  # garbage in the upper half of a 32-bit argument is ignored by the kernel
    for call, mode_arg in inner.MODE_CALLS:
        if call in calls:
            for mode, want in ((0o4755, EPERM), (0o2755, EPERM), (0o6000, EPERM), (0o1777, ALLOW), (0o755, ALLOW),
                               (high | 0o755, ALLOW), (high | 0o4000, EPERM)):
                args = [0] * 6
                args[mode_arg] = mode
                assert verdict(call, *args) == want, (call, oct(mode))
    opens = ((os.O_CREAT | os.O_WRONLY, 0o4755, EPERM), (os.O_TMPFILE | os.O_RDWR, 0o2700, EPERM),
             (os.O_CREAT, 0o644, ALLOW), (os.O_RDONLY, 0o4755, ALLOW), (os.O_WRONLY, 0o6777, ALLOW))  # no create: mode unused
    for call, flags_arg, mode_arg in inner.OPEN_CALLS:
        if call in calls:
            for flags, mode, want in opens:
                args = [0] * 6
                args[flags_arg], args[mode_arg] = flags, mode
                assert verdict(call, *args) == want, (call, oct(flags), oct(mode))
    assert verdict("openat2") == verdict("io_uring_setup") == ENOSYS
    assert evaluate(prog, nr=0, arch=arch) == evaluate(prog, nr=999, arch=arch) == ALLOW  # read, an unknown call
    foreign = I386 if machine == "x86_64" else ARM
    assert evaluate(prog, nr=15, arch=foreign, args=(0, 0o644)) == ENOSYS  # i386's chmod, whatever its mode
    if table.x32:
        assert verdict("chmod", 0, 0o644, nr_bits=inner.X32_BIT) == ENOSYS
        assert evaluate(prog, nr=0 | inner.X32_BIT, arch=arch) == ENOSYS


def test_filter_refuses_an_unknown_machine(tmp_path):
    with pytest.raises(ValueError, match="riscv64"):
        inner.build_filter("riscv64")
    assert platform.machine() in inner.MACHINES  # the machines these tests run on have a table


def test_the_launcher_needs_nothing_beyond_the_standard_library():
    imported = re.findall(r"^(?:import|from) (\w+)", INNER.read_text(), re.M)
    assert set(imported) <= {"__future__", *sys.stdlib_module_names}, imported
    assert shutil.which(PY), "the system python the sandboxes run the launcher with"
