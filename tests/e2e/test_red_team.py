"""The red team in a real run: every attack on the grader and the node scores 0 and harms nothing.

A short ``gyre`` run on pyfix with ``harness=command`` runs ``tests/e2e/red_team_harness.py`` for
every execution, under the real bwrap, with small limits so that each one is hit within seconds.
Each execution asks the proxy once, then runs one attack picked by its id (every attack of the
harness's list runs at least once over three steps): grader attacks (a conftest hook wrapper, a
pytest.ini or pyproject.toml plugin, an atexit printer, a shadowing pytest.py, os._exit, an import
that loops, a tests/ symlink, deleted tests, sys.modules tampering, .pth and usercustomize in the
home) and node attacks (a setuid binary, a fork bomb, filling /tmp and the disk, gigabytes on
stdout, a memory and a CPU hog, ``pkill -f python``, calls past the proxy budget).

Checked from outside: the run reached its steps; every execution was graded (none excluded) and
scored 0; each attack's grade or log shows the defence that stopped it; no file in the run folder
is setuid or setgid; no workspace holds another execution's files; the run folder is 0700. That
each attack works with its defence off is shown where the defence lives
(tests/workloads/test_grader_tests.py, test_sandbox_inner.py, test_sandbox_cgroups.py,
test_sandbox_bwrap.py, tests/controller/test_executions.py). bwrap must run here; in CI this fails
rather than skips.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest

from tests.e2e import metrics, run_gyre_with
from workloads.sandbox.bwrap import bwrap_problem

pytestmark = pytest.mark.e2e

RED = Path(__file__).resolve().with_name("red_team_harness.py")
STEPS = 3
MiB = 1 << 20
LIMITS = {"processes": 64, "memory_bytes": 512 * MiB, "cpu_time_s": 10, "file_bytes": 64 * MiB,
          "tmp_bytes": 32 * MiB, "log_bytes": 8 * MiB, "disk_bytes": 128 * MiB, "disk_files": 20000,
          "disk_check_s": 0.5}
MAX_CALLS = 6
# What each grader attack leaves, and the file the grader must have dropped for it.
DROPPED = {
    "conftest_hookwrapper": "conftest.py", "ini_plugin": "pytest.ini", "pyproject_plugin": "pyproject.toml",
    "shadow_pytest": "pytest.py", "conftest_exit": "conftest.py", "tests_symlink": "tests",
    "home_site_hooks": "usercustomize.py",
}
MODULE_DROPPED = {"atexit_printer", "sys_modules_tampering"}
EXTRA_FILES = {
    "ini_plugin": {"pytest.ini", "redteam_plugin.py"}, "pyproject_plugin": {"pyproject.toml", "redteam_plugin.py"},
    "conftest_hookwrapper": {"conftest.py"}, "conftest_exit": {"conftest.py"}, "shadow_pytest": {"pytest.py"},
    "home_site_hooks": {"usercustomize.py", "redteam.pth"}, "setuid_binary": {"rootshell", "rootshell2"},
}


def lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def test_every_attack_scores_zero_and_the_run_goes_on():
    problem = bwrap_problem("")
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(f"bwrap must run in CI: {problem}")
        pytest.skip(f"bwrap cannot run here: {problem}")
    base = Path(tempfile.mkdtemp(prefix="gyre-red-", dir="/var/tmp"))
    overrides = [f"sandbox.limits.{k}={v}" for k, v in LIMITS.items()]
    try:
        started = time.monotonic()
        run_dir, _ = run_gyre_with(
            base / "runs", lambda run_dir, done, report: None, f"run.steps={STEPS}", "workload=pyfix",
            f"workload.data_dir={base / 'data'}", "workload.timeout_s=90", "workload.grader_timeout_s=10",
            "sandbox=bwrap", "harness=command", f"harness.argv=[/usr/bin/python3,-I,'{RED}']",
            f"harness.ro_paths=['{RED}']", f"proxy.execution_budget.max_calls={MAX_CALLS}", *overrides,
            timeout_s=600,
        )
        wall_s = time.monotonic() - started

        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == STEPS and summary["grader_failures"] == 0, summary
        events = metrics(run_dir, "execution")
        assert len(events) >= 2 * 4 * STEPS + 8
        for ev in events:  # graded, never excluded, never rewarded
            assert ev["state"] == "graded" and ev["reward"] == 0.0, ev

        seen: dict[str, list[str]] = {}
        found: dict[str, dict] = {}
        work = run_dir / "work"
        for ev in events:
            folder = work / ev["id"]
            said = lines(folder / "stdout.log") if (folder / "stdout.log").stat().st_size < 2 * LIMITS["log_bytes"] else []
            grade = json.loads((folder / "grade.json").read_text())
            attack = next((ln["attack"] for ln in said if "attack" in ln), None) or _attack_of_big_log(folder)
            seen.setdefault(attack, []).append(ev["id"])
            _check_attack(attack, ev, said, grade, folder)
            found.setdefault(attack, _what_stopped_it(ev, said, grade))
        missing = {"conftest_hookwrapper", "ini_plugin", "pyproject_plugin", "atexit_printer", "shadow_pytest",
                   "conftest_exit", "import_loop", "tests_symlink", "delete_tests", "sys_modules_tampering",
                   "home_site_hooks", "setuid_binary", "fork_bomb", "fill_tmp", "fill_disk", "stdout_flood",
                   "memory_hog", "cpu_hog", "pkill_python", "proxy_budget"} - set(seen)
        assert not missing, f"attacks that never ran: {missing}; ran: {seen}"

        # Nothing setuid or setgid anywhere in the run folder, which only its user can enter.
        special = [str(p) for p in run_dir.rglob("*") if not p.is_symlink() and p.exists()
                   and p.stat().st_mode & (stat.S_ISUID | stat.S_ISGID)]
        assert not special, special
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        for attack, what in sorted(found.items()):  # what the grader or the sandbox did, per attack
            print(json.dumps({"attack": attack, **what}))
        print(f"red team: {len(events)} executions, {len(seen)} attacks, {wall_s:.1f}s")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _what_stopped_it(ev: dict, said: list[dict], grade: dict) -> dict:
    """One execution of an attack, as the closing table shows it: its outcome, the grade's outcome
    and canary, what the grader dropped and why, the run's error, and what the attack itself saw."""
    detail = grade["detail"]
    seen_inside = next((ln for ln in said if "attack" in ln), {})
    return {"reward": ev["reward"], "outcome": ev["outcome"], "graded": detail.get("outcome"),
            "dropped": {d["path"]: d["why"][:60] for d in detail.get("dropped", [])},
            "error": (ev.get("error") or "")[:120],
            "inside": {k: str(v)[:100] for k, v in seen_inside.items() if k != "attack"}}


def _attack_of_big_log(folder: Path) -> str:
    head = (folder / "stdout.log").read_bytes()[:4096].decode(errors="replace")
    return "stdout_flood" if "yyyy" in head else "unknown"


def _check_attack(attack: str, ev: dict, said: list[dict], grade: dict, folder: Path) -> None:
    detail = grade["detail"]
    dropped = {d["path"]: d["why"] for d in detail.get("dropped", [])}
    where = f"{ev['id']} ({attack}): {json.dumps(grade)[:1500]}"
    ws = folder / "workspace"
    if attack in DROPPED:
        assert DROPPED[attack] in dropped, where
    if attack in MODULE_DROPPED:
        assert any("forbidden_refs" in why for why in dropped.values()), where
    if attack == "conftest_exit" or attack == "home_site_hooks":
        assert detail["outcome"] == "reported", where
    if attack == "import_loop":
        assert detail["outcome"] == "timeout" and detail["canary"]["ok"], where
    if attack == "delete_tests":
        assert any(path.startswith("tests/") for path in dropped), where
    if attack == "setuid_binary":
        made = next(ln for ln in said if ln.get("attack") == attack)["made"]
        assert all(":" in how for how in made), f"a setuid/setgid file was made inside: {made}"
    if attack == "fork_bomb":
        reached = next(ln for ln in said if ln.get("attack") == attack)["reached"]
        assert reached < LIMITS["processes"], where
    if attack == "fill_tmp":
        written = next(ln for ln in said if ln.get("attack") == attack)["written"]
        assert written <= LIMITS["tmp_bytes"], where
    if attack == "fill_disk":
        assert "disk_bytes" in ev["error"] or "errno 27" in json.dumps(said), where
        assert sum(p.stat().st_size for p in ws.glob("fill*.bin")) < 1024 * MiB
    if attack == "stdout_flood":
        assert (folder / "stdout.log").stat().st_size <= LIMITS["log_bytes"] + 200, where
        assert ev["outcome"] == "crashed", where
    if attack == "memory_hog":
        hog = [ln for ln in said if ln.get("attack") == attack]
        assert not hog or hog[0]["allocated"] == 0, where
    if attack == "cpu_hog":
        assert not any(ln.get("finished") for ln in said) and ev["outcome"] == "crashed", where
    if attack == "pkill_python":
        assert not any(ln.get("survived") for ln in said) and ev["outcome"] == "crashed", where
    if attack == "proxy_budget":
        codes = next(ln for ln in said if ln.get("attack") == attack)["codes"]
        assert codes.count(200) == MAX_CALLS - 1 and codes[MAX_CALLS - 1:] == [403] * (len(codes) - MAX_CALLS + 1), codes
    # Nothing of another execution: only this attack's own files beside the template's.
    extras = {p.name for p in ws.iterdir()} - {"README.md", "tests", ".git"} - {p for p in os.listdir(ws) if p.endswith(".py")
                                                                                  and not p.startswith(("pytest", "redteam"))}
    allowed = EXTRA_FILES.get(attack, set()) | ({f"fill{i}.bin" for i in range(1024)} if attack == "fill_disk" else set())
    assert extras <= allowed, f"{ev['id']} ({attack}): files of another execution? {extras - allowed}"
