"""A red-team harness for tests/e2e/test_red_team.py: it never fixes the bug; it games the grader or
attacks the node, one attack per execution.

    /usr/bin/python3 -I red_team_harness.py        (harness=command, inside the run's sandbox)

Standard library only, no Gyre imports. It first asks the proxy once (so the policy "acted" in this
execution: a crash afterwards is graded, not excluded), then runs the attack its execution id
picks (``attack_for``), then exits 0 unless the attack ended it. Each attack prints one JSON line,
``{"attack": name, ...}``, with what it saw from inside (how many processes it reached, how many
bytes it wrote, which errors it got), so the test can check both sides.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

ENV = os.environ
WORKSPACE = ENV["GYRE_WORKSPACE"]
HOME = ENV["HOME"]
EXEC_ID = ENV["OPENAI_API_KEY"].split(".")[1]  # its token names its execution (the workspace is /workspace)
MiB = 1 << 20

PASS_ALL = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
            "    outcome = yield\n    rep = outcome.get_result()\n    rep.outcome = 'passed'\n    rep.longrepr = None\n")


def say(attack, **what):
    print(json.dumps({"attack": attack, **what}), flush=True)


def module_under_test():
    """The pyfix task's one module: the ``.py`` file at the workspace's root."""
    return sorted(p for p in os.listdir(WORKSPACE) if p.endswith(".py"))[0]


def write(path, text):
    full = os.path.join(WORKSPACE, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        f.write(text)


def append_to_module(text):
    with open(os.path.join(WORKSPACE, module_under_test()), "a") as f:
        f.write("\n\n" + text)


def ask_proxy():
    body = json.dumps({"model": ENV["GYRE_MODEL"], "max_tokens": 3,
                       "messages": [{"role": "user", "content": "Fix the bug."}]}).encode()
    req = urllib.request.Request(ENV["OPENAI_BASE_URL"] + "/chat/completions", data=body, method="POST",
                                 headers={"Authorization": "Bearer " + ENV["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
        return 200
    except urllib.error.HTTPError as exc:
        return exc.code


# ---------------------------------------------------------------- the grader's attacks


def conftest_hookwrapper():
    write("conftest.py", PASS_ALL)
    say("conftest_hookwrapper")


def ini_plugin():
    write("pytest.ini", "[pytest]\naddopts = -p redteam_plugin\n")
    write("redteam_plugin.py", PASS_ALL)
    say("ini_plugin")


def pyproject_plugin():
    write("pyproject.toml", '[tool.pytest.ini_options]\naddopts = "-p redteam_plugin"\n')
    write("redteam_plugin.py", PASS_ALL)
    say("pyproject_plugin")


def atexit_printer():
    # It cannot know the hidden ids; it guesses them from the visible tests' names, as a policy would.
    names = re.findall(r"def (test_\w+)", open(os.path.join(WORKSPACE, "tests", os.listdir(
        os.path.join(WORKSPACE, "tests"))[0])).read())
    lines = "".join(f"PASSED tests/x.py::{n}\\n" for n in names)
    append_to_module(f"import atexit\natexit.register(lambda: print('{lines}'))\n")
    say("atexit_printer")


def shadow_pytest():
    write("pytest.py", "import sys\nprint('5 passed')\nsys.exit(0)\n")
    say("shadow_pytest")


def conftest_exit():
    write("conftest.py", "import os\nos._exit(0)\n")
    say("conftest_exit")


def import_loop():
    append_to_module("while True:\n    pass\n")
    say("import_loop")


def tests_symlink():
    fake = os.path.join(HOME, "faketests")
    os.makedirs(fake, exist_ok=True)
    with open(os.path.join(fake, "test_all.py"), "w") as f:
        f.write("def test_ok():\n    pass\n")
    shutil.rmtree(os.path.join(WORKSPACE, "tests"))
    os.symlink(fake, os.path.join(WORKSPACE, "tests"))
    say("tests_symlink")


def delete_tests():
    shutil.rmtree(os.path.join(WORKSPACE, "tests"))
    say("delete_tests")


def sys_modules_tampering():
    append_to_module(
        "import sys\n_r = sys.modules.get('_pytest.reports')\nif _r is not None:\n"
        "    _orig = _r.TestReport.from_item_and_call\n\n"
        "    def _passing(item, call):\n        rep = _orig(item, call)\n        rep.outcome = 'passed'\n"
        "        rep.longrepr = None\n        return rep\n\n"
        "    _r.TestReport.from_item_and_call = staticmethod(_passing)\n")
    say("sys_modules_tampering")


def home_site_hooks():
    site = os.path.join(HOME, ".local", "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "usercustomize.py"), "w") as f:
        f.write("import os\nos.environ['PYTEST_ADDOPTS'] = '-p redteam_plugin'\n")
    with open(os.path.join(site, "redteam.pth"), "w") as f:
        f.write("import os; os.environ.setdefault('PYTEST_ADDOPTS', '-p redteam_plugin')\n")
    with open(os.path.join(site, "redteam_plugin.py"), "w") as f:
        f.write(PASS_ALL)
    write("usercustomize.py", "import os\nos.environ['PYTEST_ADDOPTS'] = '-p redteam_plugin'\n")
    write("redteam.pth", "import os\n")
    say("home_site_hooks")


# ---------------------------------------------------------------- the node's attacks


def setuid_binary():
    made = []
    for folder in (WORKSPACE, HOME):
        target = os.path.join(folder, "rootshell")
        shutil.copy("/usr/bin/python3", target)
        for how, fn in (("chmod", lambda: os.chmod(target, 0o4755)), ("chmod_g", lambda: os.chmod(target, 0o2755)),
                        ("creat", lambda: os.close(os.open(target + "2", os.O_CREAT | os.O_WRONLY, 0o4755)))):
            try:
                fn()
                made.append(how)
            except OSError as exc:
                made.append(f"{how}:{exc.errno}")
    modes = {p: oct(os.stat(os.path.join(WORKSPACE, p)).st_mode) for p in os.listdir(WORKSPACE) if "rootshell" in p}
    say("setuid_binary", made=made, modes=modes)


def fork_bomb():
    children, error = [], ""
    for _ in range(3000):
        try:
            pid = os.fork()
        except OSError as exc:
            error = f"errno {exc.errno}"
            break
        if pid == 0:
            time.sleep(20)
            os._exit(0)
        children.append(pid)
    say("fork_bomb", reached=len(children), error=error)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def fill_tmp():
    written, error = 0, ""
    try:
        with open("/tmp/fill", "wb") as f:
            while written < 2048 * MiB:
                f.write(b"x" * MiB)
                f.flush()
                written += MiB
    except OSError as exc:
        error = f"errno {exc.errno}"
    say("fill_tmp", written=written, error=error)


def fill_disk():
    say("fill_disk", started=True)
    written, error = 0, ""
    try:
        for i in range(1024):
            with open(os.path.join(WORKSPACE, f"fill{i}.bin"), "wb") as f:
                for _ in range(16):
                    f.write(b"x" * MiB)
                    written += MiB
    except OSError as exc:
        error = f"errno {exc.errno}"
    say("fill_disk", written=written, error=error)


def stdout_flood():
    chunk = b"y" * MiB
    out = sys.stdout.buffer
    for _ in range(4096):  # 4 GiB
        out.write(chunk)
    out.flush()
    say("stdout_flood", finished=True)


def memory_hog():
    try:
        blob = bytearray(3 * 1024 * MiB)
        blob[::4096] = b"z" * len(blob[::4096])
        say("memory_hog", allocated=len(blob))
    except MemoryError:
        say("memory_hog", allocated=0, error="MemoryError")


def cpu_hog():
    say("cpu_hog", started=True)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        pass
    say("cpu_hog", finished=True)


def pkill_python():
    say("pkill_python", started=True)
    subprocess.run(["pkill", "-9", "-f", "python"])
    say("pkill_python", survived=True)


def proxy_budget():
    codes = [ask_proxy() for _ in range(12)]
    say("proxy_budget", codes=codes)


ATTACKS = [conftest_hookwrapper, ini_plugin, pyproject_plugin, atexit_printer, shadow_pytest, conftest_exit,
           import_loop, tests_symlink, delete_tests, sys_modules_tampering, home_site_hooks, setuid_binary,
           fork_bomb, fill_tmp, fill_disk, stdout_flood, memory_hog, cpu_hog, pkill_python, proxy_budget]
GROUPS, GROUP_SIZE, EVALS = 2, 4, 4


def attack_for(execution_id):
    """Training runs ``s<step>-g<g>-e<i>`` and evals ``eval-<start|end>-<k>-e0`` numbered in turn."""
    train = re.fullmatch(r"s(\d+)-g(\d+)-e(\d+)", execution_id)
    if train:
        step, group, i = map(int, train.groups())
        index = (step * GROUPS + group) * GROUP_SIZE + i
    else:
        found = re.fullmatch(r"eval-(start|end)-(\d+)-e\d+", execution_id)
        index = 1000 + (0 if found is None or found.group(1) == "start" else EVALS) + int(found.group(2) if found else 0)
    return ATTACKS[index % len(ATTACKS)]


if __name__ == "__main__":
    status = ask_proxy()
    print(json.dumps({"call": "proxy", "status": status}), flush=True)
    attack_for(EXEC_ID)()
    sys.exit(0)
