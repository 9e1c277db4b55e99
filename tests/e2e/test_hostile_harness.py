"""A hostile harness in a real run: sandbox=bwrap keeps every execution to its own workspace.

A short embedded run with ``harness=command`` runs ``tests/e2e/hostile_harness.py`` for every
execution, under ``sandbox=bwrap``. Each execution tries to write outside its workspace, read and
plant files in other executions, read the run folder and the project, stop processes of the node
and reach addresses other than the proxy, logging each attempt on stdout; then it does its
wordmap task honestly through the proxy. The test then checks, from outside: the run finished its
steps; every attempt of every execution failed and its proxy call worked; no canary or planted file
exists on the node; the sleeper process the test started (a stand-in for the controller, whose
pid the harness is given) still runs unstopped; the test's TCP listener and abstract Unix socket
saw no connection; every execution was graded from an intact workspace.

The runs folder is made outside ``/tmp`` (like the default ``runs/`` in the project), so that the
execution folder's parents exist inside the sandbox only as the read-only skeleton bwrap makes for
its binds, not inside its private ``/tmp``, where a write would succeed without ever reaching the
node. Skipped where bwrap cannot run.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e import ROOT, metrics, run_gyre_with
from workloads.sandbox.bwrap import bwrap_problem

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(bwrap_problem("") != "" and os.environ.get("CI") != "true",
                                 reason=f"bwrap cannot run here: {bwrap_problem('')}")]  # in CI: fail

HOSTILE = Path(__file__).resolve().with_name("hostile_harness.py")
STEPS = 2
# Every execution must have logged these (the guessed sibling ids add more): a script that broke
# early would otherwise pass by trying nothing.
EXPECTED_ATTEMPTS = {
    "write:exec-dir", "write:work-dir", "write:run-dir", "write:project", "write:project-venv", "write:etc",
    "write:node-tmp", "list:work-dir", "list:exec-dir-parent", "list:run-dir", "read:run-dir/metrics.jsonl",
    "read:run-dir/proxy.json", "read:run-dir/controller.log", "read:run-dir/cellrunner.json",
    "read:own-stdout.log", "list:project", "list:project/.venv", "read:project/.venv/pyvenv.cfg",
    "read:project/base/wire.py", "see:controller-process", "signal:sleeper", "signal:visible-pids",
    "tcp:test-listener", "unix:test-abstract-socket", "tcp:internet",
    "read:s0-g0-e1/workspace/TASK.md", "write:s0-g1-e2/workspace/PLANTED-{token}",
}


class Listener:
    """Counts the connections accepted on a listening socket until closed."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.accepted = sock, []
        sock.listen(16)
        sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted.append(peer)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


def log_lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_hostile_harness_stays_in_its_sandbox():
    t0 = time.monotonic()
    token = uuid.uuid4().hex[:12]
    if not os.access("/var/tmp", os.W_OK):
        pytest.skip("wants a writable /var/tmp for a runs folder outside /tmp")
    base = Path(tempfile.mkdtemp(prefix="gyre-hostile-", dir="/var/tmp"))
    runs = base / "runs"
    tmp_marker = Path("/tmp") / f"gyre-hostile-marker-{token}"
    tmp_marker.write_text("the node's /tmp")
    mark = f"gyre-hostile-sleeper-{token}"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", mark])
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    abstract_name = f"gyre-hostile-{token}"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind("\0" + abstract_name)
    listeners = [Listener(tcp), Listener(unix)]
    env = {
        "GYRE_HOSTILE_TOKEN": token, "GYRE_HOSTILE_PROJECT": str(ROOT), "GYRE_HOSTILE_SLEEPER_PID": str(sleeper.pid),
        "GYRE_HOSTILE_SLEEPER_MARK": mark, "GYRE_HOSTILE_PORT": str(tcp.getsockname()[1]),
        "GYRE_HOSTILE_ABSTRACT": abstract_name, "GYRE_HOSTILE_TMP_MARKER": str(tmp_marker),
        "GYRE_HOSTILE_RUN_DIR": str(runs / "hostile"),
    }
    env_overrides = [f"+harness.env.{k}='{v}'" for k, v in env.items()]  # quoted: a port stays a string
    try:
        run_dir, _ = run_gyre_with(
            runs, lambda run_dir, done, report: None, f"run.steps={STEPS}", "run.run_id=hostile", "sandbox=bwrap",
            "harness=command",
            f"harness.argv=[/usr/bin/python3,-I,'{HOSTILE}']", f"harness.ro_paths=['{HOSTILE}']", *env_overrides,
            timeout_s=240,
        )
        wall_s = time.monotonic() - t0

        # The run reached its steps and every execution was graded, none crashed.
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == STEPS
        events = metrics(run_dir, "execution")
        assert len(events) >= 2 * 4 * STEPS  # SMALL: 2 groups of 4 a step, plus the evals
        for ev in events:
            assert ev["outcome"] == "finished" and ev["state"] == "graded", ev
            assert isinstance(ev["reward"], (int, float)), ev

        # Every execution tried everything, got nothing, and did its task through the proxy.
        work = run_dir / "work"
        folders = sorted(p for p in work.iterdir() if p.is_dir())
        assert {p.name for p in folders} == {ev["id"] for ev in events}
        expected = {name.format(token=token) for name in EXPECTED_ATTEMPTS}
        for folder in folders:
            lines = log_lines(folder / "stdout.log")
            attempts = {ln["attempt"]: ln for ln in lines if "attempt" in ln}
            missing = expected - set(attempts) - {f"read:{folder.name}/workspace/TASK.md",
                                                  f"write:{folder.name}/workspace/PLANTED-{token}"}
            assert not missing, f"{folder.name}: attempts missing from stdout.log: {sorted(missing)}"
            escaped = [ln for ln in attempts.values() if ln["ok"] is not False]
            assert not escaped, f"{folder.name}: the sandbox let these through: {escaped}"
            calls = [ln for ln in lines if ln.get("call") == "proxy"]
            assert len(calls) == 1 and calls[0]["ok"], f"{folder.name}: proxy call: {calls}"

            # Graded from an intact workspace: TASK.md, the answer file and nothing else.
            grade = json.loads((folder / "grade.json").read_text())
            assert isinstance(grade["reward"], (int, float)) and not grade["error"], grade
            task_file = (folder / "workspace/TASK.md").read_text()
            answer = task_file.partition("\n")[0].removeprefix("file:").strip()
            assert sorted(p.name for p in (folder / "workspace").iterdir()) == sorted(["TASK.md", answer])

        # Nothing reached the node: no canary anywhere it was written, nothing planted.
        canary = f"CANARY-{token}-*"
        places = [run_dir, work, *folders, ROOT, ROOT / ".venv", Path("/etc"), Path("/tmp")]
        found = [str(p) for place in places for p in place.glob(canary)]
        found += [str(p) for p in base.rglob(f"*{token}*")]
        assert not found, f"files written from inside the sandbox: {found}"

        # The sleeper runs and is not stopped; no connection reached the test's listeners.
        assert sleeper.poll() is None
        state = next(ln for ln in Path(f"/proc/{sleeper.pid}/status").read_text().splitlines()
                     if ln.startswith("State:"))
        assert state.split()[1] in ("S", "R"), state
        assert [ls.accepted for ls in listeners] == [[], []]
        print(f"hostile harness run: {len(folders)} executions, {wall_s:.1f}s")
    finally:
        for ls in listeners:
            ls.close()
        sleeper.kill()
        sleeper.wait()
        tmp_marker.unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)
