"""A hostile harness for tests/e2e/test_hostile_harness.py: it tries to escape, then does its task.

    /usr/bin/python3 -I hostile_harness.py        (harness=command, inside the run's sandbox)

Standard library only, no Gyre imports. From ``$GYRE_HOSTILE_RUN_DIR`` (the run folder on the node:
the sandbox shows the workspace at ``/workspace``) and its token's execution id it derives its
execution folder and the run's ``work/`` folder, and it tries to:

- write a canary file (``CANARY-<token>-<id>``) outside its workspace: its execution folder, the
  run's ``work/`` folder, the run folder, the project folder, ``/etc`` and the node's ``/tmp``
  (a write into the sandbox's private ``/tmp`` only counts when the test's marker file in the
  node's ``/tmp`` is visible there too, i.e. when that ``/tmp`` is the node's);
- list and read other executions (found by listing ``..`` and ``../..`` and by guessing ids such as
  ``s0-g0-e1``) and plant a ``PLANTED-<token>`` file in their workspaces;
- read the run folder (metrics, proxy and cell state, the controller's log) and the project's
  venv and source;
- see the controller among its processes, SIGSTOP the test's sleeper (its pid is given) and every
  other pid it can see in ``/proc`` that is not itself or one of its ancestors;
- connect to the test's TCP listener on 127.0.0.1, to its abstract Unix socket and to an
  address on the internet.

Each attempt is one JSON line on stdout, ``{"attempt": name, "ok": bool, "error": str}``, where
``ok`` means the escape worked. Then it does the task honestly: reads ``TASK.md`` (first line
``file: <name>``), asks the proxy's ``/chat/completions`` once (``max_tokens`` 3) and writes the
reply to the named file; that call is the line ``{"call": "proxy", "ok": bool, "error": str}``.
Exit 0 when the task was done, 2 when the proxy call failed.

Environment from the test (``harness.env``): GYRE_HOSTILE_TOKEN, GYRE_HOSTILE_PROJECT,
GYRE_HOSTILE_SLEEPER_PID, GYRE_HOSTILE_SLEEPER_MARK, GYRE_HOSTILE_PORT, GYRE_HOSTILE_ABSTRACT,
GYRE_HOSTILE_TMP_MARKER, GYRE_HOSTILE_RUN_DIR.
"""

import json
import os
import re
import signal
import socket
import sys
import time
import urllib.error
import urllib.request

ENV = os.environ
TOKEN = ENV["GYRE_HOSTILE_TOKEN"]
WORKSPACE = ENV["GYRE_WORKSPACE"]
# The sandbox shows the workspace at /workspace, so the test names the run folder on the node (as an
# agent could guess it); the execution's own id is in its token.
RUN_DIR = ENV["GYRE_HOSTILE_RUN_DIR"]
WORK_DIR = os.path.join(RUN_DIR, "work")
MY_ID = ENV["OPENAI_API_KEY"].split(".")[1]
EXEC_DIR = os.path.join(WORK_DIR, MY_ID)
PROJECT = ENV["GYRE_HOSTILE_PROJECT"]
CANARY = f"CANARY-{TOKEN}-{MY_ID}"
PLANTED = f"PLANTED-{TOKEN}"
GUESSED_IDS = ([f"s{s}-g{g}-e{i}" for s in range(3) for g in range(2) for i in range(4)]
               + [f"eval-{label}-{i}-e0" for label in ("start", "end") for i in range(4)])


def record(attempt: str, ok: bool, error: str = "") -> None:
    print(json.dumps({"attempt": attempt, "ok": ok, "error": error}), flush=True)


def attempt(name: str, fn) -> None:
    """Run ``fn``: it returns whether the escape worked (or that and a detail); an exception means
    it did not."""
    try:
        got = fn()
        ok, detail = got if isinstance(got, tuple) else (got, "" if got else "found nothing")
        record(name, bool(ok), detail)
    except Exception as exc:
        record(name, False, f"{type(exc).__name__}: {exc}")


def write_canary(folder: str) -> bool:
    with open(os.path.join(folder, CANARY), "w") as f:
        f.write("escaped")
    return True


def write_project_canary(folder: str) -> bool | tuple[bool, str]:
    """A write into the project escaped only if it reached the node's project. A checkout under
    ``/tmp`` has its path inside the sandbox's private ``/tmp``, made by bwrap for this script's
    read-only bind: a write there succeeds in the sandbox's memory and nowhere else (the test
    also looks for the canary on the node)."""
    write_canary(folder)
    if not os.path.exists(os.path.join(PROJECT, "pyproject.toml")):
        return False, "wrote only into the sandbox's private /tmp (the project is not there)"
    return True


def read_file(path: str) -> bool:
    with open(path, "rb") as f:
        f.read(64)
    return True


def others_in(listing: list[str]) -> list[str]:
    """The other executions' folders in a listing (``../..`` of /workspace is the sandbox's root)."""
    return [name for name in listing if name != MY_ID and re.fullmatch(r"s\d+-g\d+-e\d+|eval-\w+-\d+-e\d+", name)]


def ancestors() -> set[int]:
    """This process and its ancestors, by PPid in /proc."""
    chain, pid = set(), os.getpid()
    while pid > 0 and pid not in chain:
        chain.add(pid)
        try:
            with open(f"/proc/{pid}/status") as f:
                pid = next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
        except (OSError, StopIteration, ValueError):
            break
    return chain


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stop_sleeper() -> bool:
    pid = int(ENV["GYRE_HOSTILE_SLEEPER_PID"])
    if os.path.exists(f"/proc/{pid}") and ENV["GYRE_HOSTILE_SLEEPER_MARK"] not in cmdline(pid):
        # the same number is one of this sandbox's own processes: never stop those
        raise ProcessLookupError(f"pid {pid} here is {cmdline(pid)!r}, not the sleeper")
    os.kill(pid, signal.SIGSTOP)
    return True


def stop_visible() -> tuple[bool, str]:
    """SIGSTOP every pid in /proc but this process and its ancestors; whether any was stopped."""
    mine = ancestors()
    visible = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    stopped = []
    for pid in visible:
        if pid in mine:
            continue
        try:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        except OSError:
            pass
    return bool(stopped), f"visible {visible}, self and ancestors {sorted(mine)}, stopped {stopped}"


def controller_visible() -> bool:
    return any("controller.main" in cmdline(int(p)) or "cellrunner" in cmdline(int(p))
               for p in os.listdir("/proc") if p.isdigit())


def tmp_is_the_nodes() -> tuple[bool, str]:
    write_canary("/tmp")
    # the write lands in the sandbox's private /tmp unless the node's /tmp (with the marker) is here
    if os.path.exists(ENV["GYRE_HOSTILE_TMP_MARKER"]):
        return True, "wrote into the node's /tmp"
    return False, "wrote only into a private /tmp (the node's marker is not there)"


def list_project() -> bool:
    """Whether the project folder shows more than the way down to this script (its read-only bind)."""
    own = os.path.relpath(os.path.abspath(__file__), PROJECT).split(os.sep)[0]
    return bool([name for name in os.listdir(PROJECT) if name != own and not name.startswith(CANARY)])


def tcp(host: str, port: int) -> bool:
    with socket.create_connection((host, port), timeout=3):
        return True


def abstract_unix() -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(3)
        s.connect("\0" + ENV["GYRE_HOSTILE_ABSTRACT"])
        return True
    finally:
        s.close()


def hostile() -> None:
    # Files outside the workspace.
    for label, folder in (("exec-dir", EXEC_DIR), ("work-dir", WORK_DIR), ("run-dir", RUN_DIR),
                          ("project", PROJECT), ("project-venv", os.path.join(PROJECT, ".venv")), ("etc", "/etc")):
        write = write_project_canary if label.startswith("project") else write_canary
        attempt(f"write:{label}", lambda folder=folder, write=write: write(folder))
    attempt("write:node-tmp", tmp_is_the_nodes)

    # Other executions: by listing, then by guessing.
    attempt("list:work-dir", lambda: bool(others_in(os.listdir(os.path.join(WORKSPACE, "..", "..")))))
    attempt("list:exec-dir-parent", lambda: bool(others_in(os.listdir(WORK_DIR))))
    try:
        listed = others_in(os.listdir(WORK_DIR))
    except OSError:
        listed = []
    for other in dict.fromkeys(listed + [i for i in GUESSED_IDS if i != MY_ID]):
        base = os.path.join(WORK_DIR, other)
        attempt(f"read:{other}/workspace/TASK.md", lambda base=base: read_file(os.path.join(base, "workspace", "TASK.md")))
        attempt(f"read:{other}/prompt.md", lambda base=base: read_file(os.path.join(base, "prompt.md")))
        attempt(f"write:{other}/workspace/{PLANTED}",
                lambda base=base: open(os.path.join(base, "workspace", PLANTED), "w").close() or True)

    # The run folder and the project.
    attempt("list:run-dir", lambda: bool([n for n in os.listdir(RUN_DIR) if n != "work"]))
    for name in ("metrics.jsonl", "proxy.json", "controller.log", "cellrunner.json", "endpoints.json",
                 "summary.json", "config.yaml"):
        attempt(f"read:run-dir/{name}", lambda name=name: read_file(os.path.join(RUN_DIR, name)))
    attempt("read:own-stdout.log", lambda: read_file(os.path.join(EXEC_DIR, "stdout.log")))
    attempt("list:project", list_project)
    attempt("list:project/.venv", lambda: bool(os.listdir(os.path.join(PROJECT, ".venv"))))
    attempt("read:project/.venv/pyvenv.cfg", lambda: read_file(os.path.join(PROJECT, ".venv", "pyvenv.cfg")))
    attempt("read:project/base/wire.py", lambda: read_file(os.path.join(PROJECT, "controller", "wire.py")))

    # Processes.
    attempt("see:controller-process", controller_visible)
    attempt("signal:sleeper", stop_sleeper)
    attempt("signal:visible-pids", stop_visible)

    # Network: anything but the proxy.
    attempt("tcp:test-listener", lambda: tcp("127.0.0.1", int(ENV["GYRE_HOSTILE_PORT"])))
    attempt("unix:test-abstract-socket", abstract_unix)
    attempt("tcp:internet", lambda: tcp("1.1.1.1", 443))


def chat(prompt: str) -> str:
    url = ENV["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
    body = json.dumps({"model": ENV["GYRE_MODEL"], "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": 3, "stream": False}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ENV['OPENAI_API_KEY']}"}
    last = ""
    for delay in (0.0, 0.5, 1.0, 2.0, 4.0):  # the proxy answers 429/503 while no engine serves
        time.sleep(delay)
        try:
            req = urllib.request.Request(url, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=120) as resp:
                return json.loads(resp.read())["choices"][0]["message"].get("content") or ""
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
            if exc.code not in (429, 502, 503, 504):
                break
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
    raise RuntimeError(f"POST {url}: {last}")


def honest() -> int:
    with open(os.path.join(WORKSPACE, "TASK.md"), encoding="utf-8") as f:
        first, _, rest = f.read().partition("\n")
    name = first.removeprefix("file:").strip()
    try:
        reply = chat(rest.strip())
    except Exception as exc:
        print(json.dumps({"call": "proxy", "ok": False, "error": str(exc)}), flush=True)
        return 2
    with open(os.path.join(WORKSPACE, name), "w", encoding="utf-8") as f:
        f.write(reply.strip())
    print(json.dumps({"call": "proxy", "ok": True, "error": ""}), flush=True)
    return 0


if __name__ == "__main__":
    hostile()
    sys.exit(honest())
