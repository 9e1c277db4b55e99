"""The trusted launcher that runs first inside every sandbox, then becomes the sandboxed command.

``/usr/bin/python3 -I -S inner.py [--rlimit NAME=VALUE]... [--no-setuid] [--started-fd N] -- ARGV...``

Standard library only, run with ``-I -S`` from a read-only bind of this one file (``/run/gyre/inner.py``
in bwrap; in place for ``sandbox=none``), so nothing of Gyre's tree is imported. In this order:

1. ``--rlimit NAME=VALUE`` (repeatable; NAME one of ``RLIMITS``, VALUE an integer >= 0): soft and
   hard limit both set to VALUE, so nothing in the tree can raise it again. Each is PER PROCESS
   (inherited by every child, each child counted on its own), except ``nproc``, which counts every
   process and thread of the real user id on the whole node (other executions and the controller
   included, unless the sandbox made a user namespace of its own) and which the kernel never
   enforces for uid 0. A per-tree cap on processes or memory is a cgroup's job (``cgroups.py``).
   ``as`` caps virtual address space: V8 (Node.js) and the JVM reserve far more than they use and
   fail under it; ``data`` is the memory limit to use per process.
2. ``--no-setuid``: ``no_new_privs`` (exec never grants privileges: setuid/setgid bits and file
   capabilities are ignored for the whole tree, so a setuid binary found or made in reach gives
   nothing here) and a seccomp filter (``build_filter``) with which no process of the tree can make
   a file with S_ISUID or S_ISGID: chmod/fchmod/fchmodat/fchmodat2 with either bit, and
   open/openat/creat/mknod/mknodat creating a file with either bit in its mode, fail with EPERM.
   openat2 and io_uring_setup fail with ENOSYS (BPF cannot read openat2's mode, which sits in a
   struct in user memory, nor see io_uring's operations; glibc and libuv fall back to the plain
   calls, and Node.js, git and the Claude Code binary run unchanged). On x86_64, x32 syscalls and
   every non-x86_64 entry (``int 0x80``, i386) fail with ENOSYS, so no other syscall table gets
   round the filter; on aarch64, arm32 compat entries likewise. Everything else is allowed. The
   filter and ``no_new_privs`` are inherited across fork and exec and cannot be removed.
   Why: a setuid file made by the tree outlives the sandbox and gives its owner's uid (root, where
   the sandbox runs as uid 0 without capabilities: it may still set S_ISUID on its own files) to
   whoever on the node runs it. Not covered: a setuid file made by anything outside the tree, a
   hard link to an existing setuid file (the same inode, with the rights it already had), file
   capabilities (setting them needs CAP_SETFCAP, which no process of a bwrap sandbox holds), and,
   with ``sandbox=none`` as root with every capability, the many other ways root has. Setuid
   files left in a workspace are for the controller to strip afterwards. Only x86_64 and aarch64
   have syscall tables here; on any other machine ``--no-setuid`` refuses (exit 126).
3. ``--started-fd N``: one byte ``b"1"`` written to the inherited fd N, and N closed, just before
   the exec, once every limit holds: the controller reads it to tell "the sandbox ran the command"
   from "the sandbox never started" (a failure of the node or of Gyre, never of the agent).
4. ``os.execvp(ARGV[0], ARGV)`` with SIGPIPE and SIGXFSZ back at their defaults (Python ignores
   both for itself and an ignored signal stays ignored across exec), so a write past RLIMIT_FSIZE
   kills the writer as it would outside.

Failures, each one line ``gyre inner: ...`` on stderr and no started byte: a bad option, or a
setrlimit/prctl error (exit 126); ARGV[0] not found on PATH or not executable (exit 127). An exec
that fails after the byte was written (rare: ENOEXEC, E2BIG, or ENOMEM under a tight ``as``) also
exits 127 with one line. Written for any Python from 3.7 (a node's or an image's system python).
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import shutil
import signal
import struct
import sys
from dataclasses import dataclass
from typing import Tuple

RLIMITS = {
    "nproc": resource.RLIMIT_NPROC, "as": resource.RLIMIT_AS, "data": resource.RLIMIT_DATA,
    "cpu": resource.RLIMIT_CPU, "fsize": resource.RLIMIT_FSIZE, "nofile": resource.RLIMIT_NOFILE,
    "core": resource.RLIMIT_CORE, "stack": resource.RLIMIT_STACK,
}
EXIT_FAILURE = 126
EXIT_NOT_FOUND = 127

# prctl(2), seccomp(2), linux/filter.h, linux/audit.h
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
EPERM, ENOSYS = 1, 38
BPF_LD_W_ABS = 0x20     # A = 32-bit word at offset k of struct seccomp_data
BPF_JEQ_K = 0x15        # pc += (A == k) ? jt : jf
BPF_JSET_K = 0x45       # pc += (A & k) ? jt : jf
BPF_RET_K = 0x06        # return k
OFFSET_NR, OFFSET_ARCH = 0, 4


def _arg_low(i: int) -> int:
    """Offset of the low 32 bits of syscall argument i (both machines are little-endian): modes and
    open flags are 32-bit ints, and the kernel ignores the register's upper half for them."""
    return 16 + 8 * i


SETID_BITS = 0o6000                 # S_ISUID | S_ISGID
CREATE_FLAGS = 0o100 | 0o20000000   # O_CREAT | __O_TMPFILE (same values on x86_64 and aarch64)
X32_BIT = 0x40000000


@dataclass(frozen=True)
class Machine:
    """One syscall table: its audit arch, whether it has x32 numbers beside it, the calls the filter checks."""

    arch: int
    x32: bool
    calls: dict[str, int]


MACHINES = {
    # arch/x86/entry/syscalls/syscall_64.tbl
    "x86_64": Machine(arch=0xC000003E, x32=True, calls={
        "open": 2, "creat": 85, "chmod": 90, "fchmod": 91, "mknod": 133, "openat": 257, "mknodat": 259,
        "fchmodat": 268, "io_uring_setup": 425, "openat2": 437, "fchmodat2": 452}),
    # include/uapi/asm-generic/unistd.h: no open, creat, chmod or mknod there
    "aarch64": Machine(arch=0xC00000B7, x32=False, calls={
        "mknodat": 33, "fchmod": 52, "fchmodat": 53, "openat": 56, "io_uring_setup": 425, "openat2": 437,
        "fchmodat2": 452}),
}
# (syscall, index of its mode argument) for calls that set a mode outright
MODE_CALLS = (("chmod", 1), ("fchmod", 1), ("fchmodat", 2), ("fchmodat2", 2),
              ("creat", 1), ("mknod", 1), ("mknodat", 2))
# (syscall, index of flags, index of mode) for calls whose mode counts only when they create
OPEN_CALLS = (("open", 1, 2), ("openat", 2, 3))
# calls whose mode BPF cannot see: refused as if the kernel lacked them
UNSEEN_CALLS = ("openat2", "io_uring_setup")

Insn = Tuple[int, int, int, int]  # struct sock_filter: code, jt, jf, k (typing: the system python may be 3.7)


def _ld(offset: int) -> Insn:
    return (BPF_LD_W_ABS, 0, 0, offset)


def _ret(k: int) -> Insn:
    return (BPF_RET_K, 0, 0, k)


def _refuse_if_mode_setid(mode_arg: int) -> list[Insn]:
    return [_ld(_arg_low(mode_arg)),
            (BPF_JSET_K, 0, 1, SETID_BITS),
            _ret(SECCOMP_RET_ERRNO | EPERM),
            _ret(SECCOMP_RET_ALLOW)]


def build_filter(machine: str) -> list[Insn]:
    """The classic BPF program for ``machine`` (``platform.machine()``); ``ValueError`` for one
    without a table here. Each syscall's check is ``JEQ nr`` over a block that ends in RET, so the
    accumulator still holds the syscall number whenever the next check is reached."""
    table = MACHINES.get(machine)
    if table is None:
        raise ValueError(f"no seccomp syscall table for machine {machine!r} (only {', '.join(MACHINES)})")
    nosys = _ret(SECCOMP_RET_ERRNO | ENOSYS)
    # Another arch's numbers mean other calls (i386's 15 is chmod): refuse that whole table.
    prog = [_ld(OFFSET_ARCH), (BPF_JEQ_K, 1, 0, table.arch), nosys, _ld(OFFSET_NR)]
    if table.x32:  # x32 calls share the x86_64 arch but carry this bit: same calls, other numbers
        prog += [(BPF_JSET_K, 0, 1, X32_BIT), nosys]

    def on(call: str, block: list[Insn]) -> None:
        nr = table.calls.get(call)
        if nr is not None:
            prog.extend([(BPF_JEQ_K, 0, len(block), nr), *block])

    for call, mode_arg in MODE_CALLS:  # sets the mode it is given: refuse setuid/setgid bits
        on(call, _refuse_if_mode_setid(mode_arg))
    for call, flags_arg, mode_arg in OPEN_CALLS:  # the mode matters only when the call creates the file
        # not creating: jump over LD and JSET, past the EPERM, to the ALLOW that ends the block
        on(call, [_ld(_arg_low(flags_arg)), (BPF_JSET_K, 0, 3, CREATE_FLAGS), *_refuse_if_mode_setid(mode_arg)])
    for call in UNSEEN_CALLS:  # its mode is out of BPF's reach: callers fall back to the calls above
        on(call, [nosys])
    prog.append(_ret(SECCOMP_RET_ALLOW))
    return prog


class _Failure(Exception):
    """One line for stderr; the launcher exits with ``code`` and writes no started byte."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _Filter:
    """A BPF program packed and libc loaded ahead of ``install``, which then only calls prctl."""

    def __init__(self, prog: list[Insn]) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        code = b"".join(struct.pack("=HBBI", *insn) for insn in prog)
        self.code = ctypes.create_string_buffer(code, len(code))
        self.fprog = _SockFprog(len(prog), ctypes.addressof(self.code))

    def install(self) -> None:
        # no_new_privs first: without CAP_SYS_ADMIN the kernel takes a filter only with it set.
        if self.libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise _Failure(f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
        if self.libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(self.fprog), 0, 0) != 0:
            raise _Failure(f"prctl(PR_SET_SECCOMP): {os.strerror(ctypes.get_errno())}")


class Options:
    def __init__(self) -> None:
        self.rlimits: list[tuple[str, int]] = []
        self.no_setuid = False
        self.started_fd = -1
        self.argv: list[str] = []


def parse(args: list[str]) -> Options:
    """The options before ``--`` and the command after it; ``_Failure`` for anything else."""
    opts = Options()
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            opts.argv = args[i + 1:]
            if not opts.argv:
                raise _Failure("no command after --")
            return opts
        if arg == "--no-setuid":
            opts.no_setuid = True
            i += 1
            continue
        if arg not in ("--rlimit", "--started-fd") or i + 1 >= len(args):
            raise _Failure(f"bad option {arg!r} (want --rlimit NAME=VALUE, --no-setuid, --started-fd N, -- ARGV...)")
        value = args[i + 1]
        if arg == "--rlimit":
            name, _, number = value.partition("=")
            if name not in RLIMITS or not number.isdigit():
                raise _Failure(f"bad --rlimit {value!r} (want NAME=VALUE, NAME one of {', '.join(RLIMITS)})")
            opts.rlimits.append((name, int(number)))
        else:
            if not value.isdigit() or int(value) < 3:  # 0-2 are the command's stdio: never closed here
                raise _Failure(f"bad --started-fd {value!r} (want an inherited fd >= 3)")
            opts.started_fd = int(value)
        i += 2
    raise _Failure("no -- before the command")


def _prepare(opts: Options) -> _Filter | None:
    """Everything that may fail before a limit is set, so a tight ``as`` or ``nofile`` cannot keep
    ctypes from loading once the limits hold."""
    if opts.started_fd >= 0:
        try:
            os.fstat(opts.started_fd)
        except OSError as exc:
            raise _Failure(f"--started-fd {opts.started_fd}: {exc.strerror}") from None
    if shutil.which(opts.argv[0]) is None:
        raise _Failure(f"cannot run {opts.argv[0]!r}: not found or not executable", EXIT_NOT_FOUND)
    if not opts.no_setuid:
        return None
    try:
        return _Filter(build_filter(platform.machine()))
    except ValueError as exc:
        raise _Failure(f"--no-setuid: {exc}") from None


def main(args: list[str]) -> int:
    try:
        opts = parse(args)
        seccomp = _prepare(opts)
        for name, value in opts.rlimits:
            try:
                resource.setrlimit(RLIMITS[name], (value, value))
            except (OSError, ValueError, OverflowError) as exc:
                raise _Failure(f"setrlimit {name}={value}: {exc}") from None
        if seccomp is not None:
            seccomp.install()
        if opts.started_fd >= 0:  # still with SIGPIPE ignored: a closed read end is EPIPE here, not a death
            try:
                os.write(opts.started_fd, b"1")
            except OSError as exc:  # the controller closed its end: nobody waits for this command
                raise _Failure(f"--started-fd {opts.started_fd}: {exc.strerror}") from None
            finally:
                os.close(opts.started_fd)
    except _Failure as exc:
        print(f"gyre inner: {exc}", file=sys.stderr, flush=True)
        return exc.code
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execvp(opts.argv[0], opts.argv)
    except OSError as exc:
        print(f"gyre inner: cannot exec {opts.argv[0]!r}: {exc.strerror}", file=sys.stderr, flush=True)
    return EXIT_NOT_FOUND


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
