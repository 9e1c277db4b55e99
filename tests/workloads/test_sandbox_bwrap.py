"""sandbox=bwrap with the real bwrap, real processes and a hostile program inside.

The hostile program is a python3 script run by the system's /usr/bin/python3 in the sandbox. It
tries every escape the sandbox must stop (files outside its workspace, a sibling workspace, the run
folder and its token, the controller's processes, TCP to the node and beyond) and the few things it
must be able to do (its workspace, its home, a private /tmp, the proxy through the relay), and
prints one JSON object: each attempt's result or the exception it met. The fake proxy is a real
HTTP server on a Unix socket (and a TCP port, like the real one). Skipped where bwrap cannot run.
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import statistics
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from tests.workloads import sandbox_config
from workloads.api import ResourceLimits, SandboxSpec
from workloads.sandbox import make_sandbox
from workloads.sandbox.bwrap import BwrapSandbox, bwrap_problem
from workloads.sandbox.none import NoSandbox

pytestmark = pytest.mark.skipif(bwrap_problem("") != "" and os.environ.get("CI") != "true",
                                reason=f"bwrap cannot run here: {bwrap_problem('')}")  # in CI: fail

ROOT = Path(__file__).resolve().parents[2]
PY = "/usr/bin/python3"
CFG = sandbox_config("bwrap")

HOSTILE = r'''
import json, os, signal, socket, sys, threading, urllib.request
a = json.loads(sys.argv[1])
out = {}

def attempt(name, fn):
    try:
        r = fn()
        out[name] = "ok" if r is None else r
    except BaseException as exc:
        out[name] = type(exc).__name__

def write(path):
    with open(path, "w") as f:
        f.write("pwned")

def read(path):
    with open(path) as f:
        return "read:" + f.read()

def connect(host, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect((host, port))
    finally:
        s.close()

def get(path):
    return urllib.request.urlopen(f"http://127.0.0.1:{a['proxy_port']}{path}", timeout=10).read().decode()

def half_close():
    s = socket.create_connection(("127.0.0.1", a["proxy_port"]), timeout=10)
    s.sendall(b"GET /half HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    s.shutdown(socket.SHUT_WR)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    return data.rsplit(b"\r\n\r\n", 1)[-1].decode()

def many(n):
    got = []
    def one(i):
        got.append(get(f"/many/{i}"))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads: t.start()
    for t in threads: t.join()
    return sorted(got) == sorted(f"proxied /many/{i}" for i in range(n))

attempt("write_etc", lambda: write("/etc/gyre-pwned"))
attempt("write_usr", lambda: write("/usr/gyre-pwned"))
attempt("write_project", lambda: write(a["project"] + "/gyre-pwned"))
attempt("mkdir_project", lambda: os.makedirs(a["project"] + "/pwned"))
attempt("list_project", lambda: os.listdir(a["project"]))
attempt("write_ws_parent", lambda: write(a["ws_parent"] + "/gyre-pwned"))
attempt("read_sibling", lambda: read(a["sibling_secret"]))
attempt("list_sibling", lambda: os.listdir(os.path.dirname(a["sibling_secret"])))
attempt("read_token", lambda: read(a["run_token"]))
attempt("read_root_home", lambda: os.listdir("/root"))
attempt("list_socket_dir", lambda: sorted(os.listdir("/run/gyre/proxy")))
attempt("read_shadow", lambda: read("/etc/shadow"))
attempt("write_sysctl", lambda: write("/proc/sys/kernel/hostname"))
attempt("kill_controller", lambda: os.kill(a["controller_pid"], signal.SIGTERM))
attempt("kill_sleeper", lambda: os.kill(a["sleeper_pid"], signal.SIGKILL))
attempt("num_pids", lambda: len([p for p in os.listdir("/proc") if p.isdigit()]))
attempt("tcp_node_listener", lambda: connect("127.0.0.1", a["listener_port"]))
attempt("tcp_node_address", lambda: connect(a["node_ip"], a["listener_port"]))
attempt("tcp_beyond", lambda: connect("1.1.1.1", 443))
attempt("write_ws", lambda: write("result-file"))
attempt("write_home", lambda: write(os.environ["HOME"] + "/state"))
attempt("write_tmp", lambda: write(a["tmp_probe"]))
attempt("read_tmp", lambda: read(a["tmp_probe"]))
attempt("cwd", os.getcwd)
attempt("env", lambda: sorted(os.environ))
attempt("token", lambda: os.environ.get("GYRE_TOKEN"))
attempt("proxy_get", lambda: get("/v1/models"))
attempt("proxy_half_close", half_close)
attempt("proxy_many", lambda: many(40))
print(json.dumps(out))
'''


class _FakeProxy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"proxied {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self) -> str:
        return "proxy-client"  # a Unix socket peer has no (host, port)

    def log_message(self, *args) -> None:
        pass


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _TcpServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def proxy(tmp_path):
    """The fake proxy: HTTP on a Unix socket in the run folder and on a TCP port of this node."""
    sock_path = tmp_path / "run" / "proxy-socket" / "proxy.sock"  # its own folder, as the controller makes it
    sock_path.parent.mkdir(parents=True, exist_ok=True)
    unix, tcp = _UnixServer(str(sock_path), _FakeProxy), _TcpServer(("127.0.0.1", 0), _FakeProxy)
    os.chmod(sock_path, 0o600)
    for srv in (unix, tcp):
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield sock_path, tcp.server_address[1]
    for srv in (unix, tcp):
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def layout(tmp_path):
    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "run" / "token").write_text("run-secret")
    ws, sibling, home = tmp_path / "workspaces" / "ex1", tmp_path / "workspaces" / "ex2", tmp_path / "homes" / "ex1"
    for d in (ws, sibling, home):
        d.mkdir(parents=True)
    (sibling / "secret.txt").write_text("sibling-secret")
    return ws, sibling, home


def _node_ip() -> str:
    """An address of this node other than loopback (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.2"


def test_hostile_program_is_confined(tmp_path, layout, proxy, monkeypatch):
    ws, sibling, home = layout
    sock_path, proxy_port = proxy
    listener = socket.create_server(("0.0.0.0", 0))  # something on the node the harness must not reach
    sleeper = subprocess.Popen(["sleep", "60"])
    tmp_probe = f"/tmp/gyre-sandbox-probe-{uuid.uuid4().hex}"
    monkeypatch.setenv("GYRE_CONTROLLER_SECRET", "controller-only")
    try:
        assert os.getpid() > 20 and sleeper.pid > 20, "pids this small could exist inside the sandbox"
        args = {"project": str(ROOT), "ws_parent": str(ws.parent), "sibling_secret": str(sibling / "secret.txt"),
                "run_token": str(tmp_path / "run" / "token"), "controller_pid": os.getpid(),
                "sleeper_pid": sleeper.pid, "listener_port": listener.getsockname()[1], "node_ip": _node_ip(),
                "proxy_port": proxy_port, "tmp_probe": tmp_probe}
        spec = SandboxSpec(argv=[PY, "-c", HOSTILE, json.dumps(args)], workspace=ws, home=home,
                           env={"PATH": "/usr/bin:/bin", "GYRE_TOKEN": "execution-token"},
                           network="proxy", proxy_port=proxy_port, proxy_socket=sock_path)
        sb = make_sandbox(CFG)
        assert isinstance(sb, BwrapSandbox)
        r = subprocess.run(sb.wrap(spec), env=spec.env, cwd=ws, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)

        # what it must not do
        # A checkout under /tmp has its path inside the sandbox's private /tmp: making a folder
        # there succeeds in the sandbox's memory only (checked on the node below).
        private = ROOT.is_relative_to("/tmp")
        for name in ("write_etc", "write_usr", "write_project", "mkdir_project", "write_sysctl"):
            if not (private and name == "mkdir_project"):
                assert out[name] in ("OSError", "FileNotFoundError", "PermissionError"), (name, out[name])
        for name in ("list_project", "read_sibling", "list_sibling", "read_token", "read_root_home"):
            if not (private and name == "list_project"):
                assert out[name] == "FileNotFoundError", (name, out[name])
        if private:  # it sees at most what it made itself, never the project
            assert out["list_project"] in ("FileNotFoundError", ["pwned"]), out["list_project"]
        assert not (ROOT / "pwned").exists()
        assert out["read_shadow"] in ("read:", "PermissionError")  # masked (a nodev /dev/null): uid 0 could read it
        assert not (ws.parent / "gyre-pwned").exists()  # a write there, if any, went to the private /tmp
        assert not (ROOT / "gyre-pwned").exists() and not Path("/etc/gyre-pwned").exists()
        assert out["kill_controller"] == out["kill_sleeper"] == "ProcessLookupError"
        assert sleeper.poll() is None
        assert out["num_pids"] <= 4  # bwrap's init, the relay, the script
        assert out["tcp_node_listener"] == "ConnectionRefusedError"
        assert out["tcp_node_address"] == out["tcp_beyond"] == "OSError"  # ENETUNREACH: there is no route
        # what it must do
        assert out["write_ws"] == out["write_home"] == out["write_tmp"] == "ok"
        assert (ws / "result-file").read_text() == "pwned" and (home / "state").read_text() == "pwned"
        assert out["read_tmp"] == "read:pwned" and not Path(tmp_probe).exists()  # /tmp is private
        assert out["cwd"] == str(ws)
        assert out["token"] == "execution-token" and "GYRE_CONTROLLER_SECRET" not in out["env"]
        assert set(out["env"]) <= {"PATH", "GYRE_TOKEN", "HOME", "PWD", "LC_CTYPE"}
        assert out["proxy_get"] == "proxied /v1/models"
        assert out["proxy_half_close"] == "proxied /half"
        assert out["proxy_many"] is True
        assert out["list_socket_dir"] == ["proxy.sock"]  # the proxy's folder is bound, and holds only it
    finally:
        sleeper.kill()
        sleeper.wait()
        listener.close()


def _run(spec: SandboxSpec, timeout_s: float = 30) -> subprocess.CompletedProcess:
    argv = BwrapSandbox(CFG).wrap(spec)
    return subprocess.run(argv, env=spec.env, cwd=spec.workspace, capture_output=True, text=True, timeout=timeout_s)


def test_no_network_for_graders(layout, proxy):
    ws, _, _ = layout
    sock_path, proxy_port = proxy
    script = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', %d), timeout=3)\n    print('reached')\n"
              "except OSError as e:\n    print(type(e).__name__)\nimport os; print(os.environ['HOME'])" % proxy_port)
    r = _run(SandboxSpec(argv=[PY, "-c", script], workspace=ws, env={"PATH": "/usr/bin"}, network="none"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ConnectionRefusedError", "/home/sandbox"]  # and a tmpfs home without spec.home
    r = _run(SandboxSpec(argv=[PY, "-c", script], workspace=ws, env={"PATH": "/usr/bin", "HOME": str(ws)}, network="none"))
    assert r.stdout.split() == ["ConnectionRefusedError", str(ws)]  # a HOME the caller chose (graders: the workspace)


def test_relay_passes_exit_codes_and_forwards_signals(layout, proxy):
    ws, _, _ = layout
    sock_path, proxy_port = proxy

    def spec(*argv: str) -> SandboxSpec:
        return SandboxSpec(argv=list(argv), workspace=ws, env={"PATH": "/usr/bin"}, network="proxy",
                           proxy_port=proxy_port, proxy_socket=sock_path)

    assert _run(spec("/usr/bin/true")).returncode == 0  # a harness that never connects
    assert _run(spec("/usr/bin/sh", "-c", "exit 7")).returncode == 7
    missing = _run(spec("/no/such/harness"))
    assert missing.returncode == 127 and "cannot start '/no/such/harness'" in missing.stderr
    # the harness signals its parent (the relay), which forwards SIGTERM back to it
    script = ("import os, signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: (print('got SIGTERM', flush=True), sys.exit(3)))\n"
              "os.kill(os.getppid(), signal.SIGTERM)\ntime.sleep(20)\nsys.exit(1)")
    r = _run(spec(PY, "-c", script))
    assert (r.returncode, r.stdout.strip()) == (3, "got SIGTERM")


def _find(marker: str) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and marker.encode() in (p / "cmdline").read_bytes():
                pids.append(int(p.name))
        except OSError:
            pass
    return pids


def test_killing_bwrap_kills_everything_inside(layout, proxy):
    ws, _, _ = layout
    sock_path, proxy_port = proxy
    marker = f"{time.time() % 1000:.6f}1"  # an argv nothing else on this node has
    spec = SandboxSpec(argv=["/usr/bin/sleep", marker], workspace=ws, env={"PATH": "/usr/bin"}, network="proxy",
                       proxy_port=proxy_port, proxy_socket=sock_path)
    proc = subprocess.Popen(BwrapSandbox(CFG).wrap(spec), env=spec.env, cwd=ws)
    try:
        deadline = time.monotonic() + 20
        while not (inner := [p for p in _find(marker) if p != proc.pid and Path(f"/proc/{p}/exe").exists()
                             and os.readlink(f"/proc/{p}/exe").endswith("sleep")]):
            assert time.monotonic() < deadline and proc.poll() is None, "the sandboxed sleep never started"
            time.sleep(0.02)
        proc.kill()  # the controller's view of a harness: its bwrap; SIGKILL, nothing can be cleaned up
        proc.wait()
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{p}").exists() and _state(p) != "Z" for p in inner):
            assert time.monotonic() < deadline, "the process inside outlived its bwrap"
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def test_wrap_refuses_bad_specs(tmp_path, layout):
    ws, _, _ = layout
    sb = BwrapSandbox(CFG)
    with pytest.raises(ValueError, match="proxy_port and spec.proxy_socket"):
        sb.wrap(SandboxSpec(argv=["true"], workspace=ws, env={}, network="proxy"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sb.wrap(SandboxSpec(argv=["true"], workspace=ws, env={}, network="none", ro_paths=(tmp_path / "nope",)))
    with pytest.raises(ValueError, match="absolute"):
        sb.wrap(SandboxSpec(argv=["true"], workspace=Path("rel"), env={}, network="none"))


def test_ro_paths_are_visible_and_read_only(tmp_path, layout):
    ws, _, _ = layout
    tool = tmp_path / "deep" / "tools" / "harness"
    tool.mkdir(parents=True)
    (tool / "bin.sh").write_text("echo tool-ran\n")
    (tmp_path / "deep" / "tools" / "other-secret").write_text("x")
    script = (f"import os, subprocess; print(subprocess.run(['sh', {str(tool / 'bin.sh')!r}], capture_output=True, "
              f"text=True).stdout.strip()); print(os.listdir({str(tool.parent)!r}))\n"
              f"try:\n    open({str(tool / 'new')!r}, 'w')\nexcept OSError as e:\n    print(e.errno)")
    r = _run(SandboxSpec(argv=[PY, "-c", script], workspace=ws, env={"PATH": "/usr/bin"}, network="none",
                         ro_paths=(tool,)))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0] == "tool-ran" and lines[1] == "['harness']"  # its parents show nothing else
    assert lines[2] == "30"  # EROFS


def test_every_execution_sees_the_same_paths_where_the_spec_shows_them(tmp_path, layout):
    """Two executions' harnesses see one workspace, home and prompt path, so their prompts match."""
    prompt = tmp_path / "prompt.md"
    prompt.write_text("fix the bug")
    script = ("import os, json\nopen('made.txt', 'w').write('x')\nopen(os.environ['HOME'] + '/h.txt', 'w').write('y')\n"
              "try:\n    open('/run/gyre/prompt.md', 'w')\n    ro = 'writable'\nexcept OSError as e:\n    ro = e.errno\n"
              f"print(json.dumps([os.getcwd(), os.environ['HOME'], open('/run/gyre/prompt.md').read(), ro, "
              f"os.path.exists({str(tmp_path)!r})]))")
    seen = []
    for name in ("ex1", "ex2"):
        ws, home = tmp_path / "w" / name, tmp_path / "h" / name
        ws.mkdir(parents=True)
        home.mkdir(parents=True)
        r = _run(SandboxSpec(argv=[PY, "-c", script], workspace=ws, env={"PATH": "/usr/bin"}, network="none", home=home,
                             workspace_inside=Path("/workspace"), home_inside=Path("/home/agent"),
                             ro_binds=((prompt, Path("/run/gyre/prompt.md")),)))
        assert r.returncode == 0, r.stderr
        seen.append(json.loads(r.stdout))
        assert (ws / "made.txt").read_text() == "x" and (home / "h.txt").read_text() == "y"  # the host folders
    assert seen[0] == seen[1] == ["/workspace", "/home/agent", "fix the bug", 30, False]  # EROFS; host paths hidden


def test_sandbox_none_refuses_to_pretend_it_moves_paths(layout):
    ws, _, _ = layout
    with pytest.raises(ValueError, match="sandbox=none shows every path where it is"):
        NoSandbox().wrap(SandboxSpec(argv=["true"], workspace=ws, env={}, workspace_inside=Path("/workspace")))


def test_describe_says_what_it_enforces():
    line = BwrapSandbox(CFG).describe()
    assert "network namespaces" in line and "only the proxy" in line and "read-only system" in line


def test_startup_overhead_smoke(layout, proxy):
    """Not a timing assertion: the launch cost (bwrap + relay vs a plain Popen) is printed with -s."""
    ws, _, _ = layout
    sock_path, proxy_port = proxy
    spec = SandboxSpec(argv=["/usr/bin/true"], workspace=ws, env={"PATH": "/usr/bin"}, network="proxy",
                       proxy_port=proxy_port, proxy_socket=sock_path)
    wrapped = BwrapSandbox(CFG).wrap(spec)

    def median_ms(argv: list[str], n: int = 3) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            subprocess.run(argv, env=spec.env, cwd=ws, check=True)
            times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)

    print(json.dumps({"plain_ms": median_ms(spec.argv), "bwrap_relay_ms": median_ms(wrapped)}), file=sys.stderr)


FILL = ("import json\nout = {}\nfor where in ('/tmp/fill', '/dev/shm/fill'):\n    n = 0\n    try:\n"
        "        with open(where, 'wb') as f:\n            while n < 24 << 20:\n                f.write(b'x' * (1 << 20))\n"
        "                f.flush()\n                n += 1 << 20\n    except OSError:\n        pass\n    out[where] = n\n"
        "print(json.dumps(out))\n")


@pytest.mark.parametrize("tmp_bytes", [8 << 20, 0])
def test_tmp_and_shm_hold_only_their_size(layout, tmp_bytes):
    """``limits.tmp_bytes`` sizes the private /tmp and /dev/shm (tmpfs: memory); 0 leaves them at the
    kernel's default, half the RAM, where filling them is the attack."""
    ws, _, _ = layout
    limits = ResourceLimits(processes=0, memory_bytes=0, cpu_time_s=0, file_bytes=0, open_files=0, tmp_bytes=tmp_bytes)
    spec = SandboxSpec(argv=[PY, "-c", FILL], workspace=ws, env={"PATH": "/usr/bin"}, network="none", limits=limits)
    r = subprocess.run(BwrapSandbox(CFG).wrap(spec), env=spec.env, cwd=ws, capture_output=True, text=True, timeout=60)
    written = json.loads(r.stdout)
    if tmp_bytes:
        assert all(n <= tmp_bytes for n in written.values()), written
    else:
        assert all(n == 24 << 20 for n in written.values()), written


def test_pkill_reaches_only_the_sandbox(layout):
    """``pkill -9 -f python`` from inside kills only the sandbox's own processes; without a sandbox
    the same command kills a process of the node (here, a sleeper standing in for the controller)."""
    ws, _, _ = layout
    marker = f"gyre-victim-{time.time():.6f}"
    for sandbox, survives in ((BwrapSandbox(CFG), True), (NoSandbox(), False)):
        victim = subprocess.Popen(["/usr/bin/python3", "-c", "import time; time.sleep(60)", marker])
        try:
            time.sleep(0.2)
            spec = SandboxSpec(argv=["/usr/bin/pkill", "-9", "-f", marker], workspace=ws, env={"PATH": "/usr/bin"},
                               network="none")
            subprocess.run(sandbox.wrap(spec), env=spec.env, cwd=ws, capture_output=True, timeout=30)
            time.sleep(0.2)
            assert (victim.poll() is None) is survives, sandbox.kind
        finally:
            victim.kill()
            victim.wait()
