"""The reward path, end to end: a pyfix task solved through the real Claude Code binary earns 1.0
from the real hidden tests; the same fix plus a broken neighbouring function earns 0.0.

Everything between the policy and the reward is the real thing: ``ExecutionManager`` lays out each
execution's folder and starts the pinned Claude Code (``ClaudeCodeHarness``) inside a bwrap sandbox
(``BwrapSandbox``); the harness reaches the proxy only through the sandbox's relay to the proxy's
Unix socket; the proxy (the real ``ProxyServer`` of ``LiveProxy``, also listening on a Unix socket
the way ``harness_proxy.main --unix-socket`` does) calls an engine double whose scripted policy
sees only token ids; the task set is ``SweTaskSet`` over the generated pyfix rows, and grading
applies each agent's change to a fresh copy of the template, writes the hidden tests there and
runs them in the sandbox.

The two executions are one group of two on the same task, running side by side. The policy tells
them apart by the workspace path in each prompt (Claude Code states its working directory, and the
sub-agent's prompt names NOTES.md by its absolute path). Each one really works: it runs the visible
tests with Bash, reads the module, applies the gold patch's change with Edit (the second also
breaks the function a PASS_TO_PASS test covers), has a foreground sub-agent write NOTES.md, runs
the visible tests again and answers.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from base import wire
from controller.executions import Execution, ExecutionManager, ProxyEndpoint
from base.typed_config import build
from harness_proxy.main import serve_unix_socket
from tests.harness_proxy import SECRET, TOK, LiveProxy, Step
from tests.harness_proxy.claude_code import CodingScript, engine_ids, tool_call
from workloads.config import ClaudeCodeHarnessConfig, SandboxConfig, WorkloadConfig
from workloads.harnesses.claude_code import ClaudeCodeHarness
from workloads.sandbox.bwrap import BwrapSandbox, bwrap_problem
from workloads.tasksets import pyfix
from workloads.tasksets.swe import SweTask, SweTaskSet, load_tasks

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
GROUP = "s0-g0"
SOLVER, BREAKER = f"{GROUP}-e0", f"{GROUP}-e1"
RUN_DEADLINE_S = 150.0
VISIBLE_TESTS = "python3 -m pytest -rA -p no:cacheprovider tests"
NOTE = "The fix keeps the documented behaviour; see the visible tests."
_TEST_LINE = re.compile(r"^(?:PASSED|FAILED|ERROR) tests/\S+::(test_\w+)", flags=re.M)


def conf(cls: type, path: str, **over):
    return replace(build(cls, yaml.safe_load((ROOT / "conf" / path).read_text())), **over)


# ---------------------------------------------------------------- the task and its fix


def one_line_fix(task: SweTask) -> tuple[str, str, str] | None:
    """(file, removed line, added line) when the gold patch is one hunk changing one line of one file."""
    lines = task.patch.splitlines()
    files = [ln[len("+++ b/"):] for ln in lines if ln.startswith("+++ b/")]
    removed = [ln[1:] for ln in lines if ln.startswith("-") and not ln.startswith("--- ")]
    added = [ln[1:] for ln in lines if ln.startswith("+") and not ln.startswith("+++ ")]
    hunks = [ln for ln in lines if ln.startswith("@@")]
    if len(files) == 1 and len(hunks) == 1 and len(removed) == 1 and len(added) == 1:
        return files[0], removed[0], added[0]
    return None


def _name(test_id: str) -> str:
    return test_id.split("::", 1)[1]


def callable_of(test_id: str) -> str:
    """``tests/test_m.py::test_word_count_2`` -> ``word_count`` (pyfix names tests test_<callable>_<n>)."""
    return _name(test_id)[len("test_"):].rsplit("_", 1)[0]


# ---------------------------------------------------------------- the scripted policies


def script_for(workspace: Path, module: str, fix: tuple[str, str], broken: tuple[str, str] | None) -> CodingScript:
    """The main agent's steps: look, read, fix (and break), delegate, re-run, answer."""
    path = str(workspace / module)
    script = CodingScript(workspace)
    script.sub_task = f"Create {workspace / 'NOTES.md'} containing the line: {NOTE}"  # how its sub-agent is known
    edits = [fix] + ([broken] if broken else [])
    script.main_steps = [
        "<think>\nFirst see which tests the repository ships with, and run them.\n</think>\n\n"
        + tool_call("Bash", {"command": f"ls tests && {VISIBLE_TESTS}",
                             "description": "List and run the visible tests"}),
        tool_call("Read", {"file_path": path}),
        *("I will change this line." + tool_call("Edit", {"file_path": path, "old_string": old, "new_string": new})
          for old, new in edits),
        tool_call("Agent", {"description": "Write NOTES.md", "subagent_type": "general-purpose",
                            "prompt": script.sub_task,
                            "run_in_background": False}),
        tool_call("Bash", {"command": VISIBLE_TESTS, "description": "Run the visible tests again"}),
        f"Done: {module} is fixed and NOTES.md records why.",
    ]
    script.sub_steps = [
        tool_call("Write", {"file_path": str(workspace / "NOTES.md"), "content": NOTE + "\n"}),
        "Created NOTES.md with the requested line.",
    ]
    return script


def by_workspace(scripts: dict[Path, CodingScript], strays: list[str]):
    """One engine policy for both executions: the workspace path in the prompt says whose call it is."""

    def policy(input_ids: list[int]) -> Step:
        prompt = TOK.decode(input_ids)
        owners = [s for ws, s in scripts.items() if str(ws) in prompt]
        if len(owners) != 1:
            strays.append(prompt[-500:])
            return Step(output_ids=engine_ids("I cannot tell which task this is."))
        return owners[0](input_ids)

    return policy


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tasks_file(tmp_path_factory) -> Path:
    return pyfix.generate(tmp_path_factory.mktemp("data"))


@pytest.fixture
def proxy():
    p = LiveProxy(num_engines=1, max_request_bytes=8 << 20, max_context_tokens=400_000, max_new_tokens_cap=4096)
    sock_dir = Path(tempfile.mkdtemp(prefix="gyre-proxy-"))  # short: a Unix socket path has 107 bytes
    p.unix_socket = sock_dir / "proxy.sock"
    p.lt.run(serve_unix_socket(p.server, p.unix_socket))  # a second site on the proxy's runner, as main.py
    yield p
    p.close()
    shutil.rmtree(sock_dir, ignore_errors=True)


def _requirements() -> str:
    problem = bwrap_problem()
    if problem:
        return f"bwrap cannot run here: {problem}"
    missing = ClaudeCodeHarness(conf(ClaudeCodeHarnessConfig, "harness/claude_code.yaml")).check_installed()
    if missing:
        return missing
    if subprocess.run(["/usr/bin/python3", "-c", "import pytest"], capture_output=True).returncode != 0:
        return "the system python3 has no pytest (Debian's python3-pytest): the hidden tests cannot run"
    return ""


# ---------------------------------------------------------------- the test


def test_hidden_tests_reward_a_real_fix_and_punish_a_broken_neighbour(tmp_path, tasks_file, proxy):
    why = _requirements()
    if why:
        pytest.skip(why)
    cfg = conf(WorkloadConfig, "workload/pyfix.yaml", task_file=str(tasks_file), data_dir=str(tasks_file.parent.parent),
               timeout_s=RUN_DEADLINE_S, grader_timeout_s=60.0)
    # host paths: the scripted engine tells the two executions apart by the workspace their prompts name
    sandbox = BwrapSandbox(conf(SandboxConfig, "sandbox/bwrap.yaml", fixed_paths=False))
    taskset = SweTaskSet(cfg, sandbox)
    task, (module, removed, added) = next((t, fix) for t in load_tasks(tasks_file) if (fix := one_line_fix(t)))
    assert task.instance_id == "pyfix__textstats-1"  # the generator is deterministic: the first such task

    # What the agent is given: the template every workspace copies. The hidden tests are not there.
    template = taskset.template(task)
    base_source = (template / module).read_text()
    visible_file = (template / task.fail_to_pass[0].split("::", 1)[0]).read_text()
    hidden_names = {_name(t) for t in task.fail_to_pass}
    visible_names = set(re.findall(r"^def (test_\w+)", visible_file, flags=re.M))
    assert visible_names and not visible_names & hidden_names
    assert not any(name in visible_file for name in hidden_names)
    assert base_source.count(removed) == 1

    # The breaker also breaks the callable of a PASS_TO_PASS test that is not the one being fixed.
    victim = next(t for t in task.pass_to_pass if callable_of(t) not in {callable_of(f) for f in task.fail_to_pass})
    signature = re.search(rf"^def {callable_of(victim)}\(.*\):$", base_source, flags=re.M).group(0)
    broken = (signature, signature + '\n    raise NotImplementedError("being rewritten")')

    harness = ClaudeCodeHarness(conf(ClaudeCodeHarnessConfig, "harness/claude_code.yaml"))  # the pinned binary
    mgr = ExecutionManager(
        workload=cfg, taskset=taskset, harness=harness,
        sandbox=sandbox, work_dir=tmp_path / "work", proxy=ProxyEndpoint(url=proxy.url, unix_socket=proxy.unix_socket),
        model_name=proxy.cfg.model_name, secret=SECRET,
    )
    group = mgr.plan_group(step=0, group_id=GROUP, task=task, train=True, temperature=1.0, size=2)
    assert [ex.execution_id for ex in group] == [SOLVER, BREAKER]
    workspaces = {ex.execution_id: tmp_path / "work" / ex.execution_id / "workspace" for ex in group}
    scripts = {
        SOLVER: script_for(workspaces[SOLVER], module, (removed, added), None),
        BREAKER: script_for(workspaces[BREAKER], module, (removed, added), broken),
    }
    strays: list[str] = []
    proxy.engines[0].policy = by_workspace({workspaces[k]: s for k, s in scripts.items()}, strays)

    for ex in group:
        mgr.launch(ex, time.monotonic())
    try:
        _wait_settled(mgr, group)
    finally:
        mgr.kill_all()
    solver, breaker = group
    for ex in group:
        assert ex.outcome == "finished" and ex.state == "graded", _explain(ex)
    assert not strays, f"calls no script could claim: {strays[:1]}"

    # The harness really did the work, confined: its only way out was the relay to the proxy's socket.
    for ex in group:
        assert Path(ex.proc.args[0]).name == "bwrap" and "--unshare-net" in ex.proc.args
        assert str(proxy.unix_socket.parent) in ex.proc.args  # the socket's own folder, bound whole
        script = scripts[ex.execution_id]
        assert script.calls == {"main": len(script.main_steps), "sub-agent": 2, "summary": 0}, _explain(ex)
        assert (ex.workspace / "NOTES.md").read_text() == NOTE + "\n"
        assert (ex.folder / "stdout.log").read_text().strip() == script.main_steps[-1]
    fixed = (solver.workspace / module).read_text()
    assert fixed == base_source.replace(removed, added)
    assert (breaker.workspace / module).read_text() == fixed.replace(*broken)

    # The rewards, exactly, from the hidden tests.
    assert solver.reward == 1.0 and breaker.reward == 0.0
    good = json.loads((solver.folder / "grade.json").read_text())
    bad = json.loads((breaker.folder / "grade.json").read_text())
    assert good["reward"] == 1.0 and good["error"] == "" and good["detail"]["failed"] == []
    assert set(task.fail_to_pass) <= set(good["detail"]["passed"])
    assert set(good["detail"]["passed"]) == set(task.fail_to_pass + task.pass_to_pass)
    assert bad["reward"] == 0.0 and bad["error"] == ""
    assert set(task.fail_to_pass) <= set(bad["detail"]["passed"])  # the bug itself was fixed
    assert victim in bad["detail"]["failed"] and set(bad["detail"]["failed"]) <= set(task.pass_to_pass)
    # The grader applied the agent's change to a fresh tree of its own: the workspace never held
    # the hidden tests, and the change it applied is the one the agent made.
    for ex in group:
        assert not any(name in (ex.workspace / victim.split("::", 1)[0]).read_text() for name in hidden_names)
        assert f"modified {module}" in json.loads((ex.folder / "grade.json").read_text())["detail"]["kept"]

    # The proxy's records: main and sub-agent lineages, one unbroken main chain per execution.
    records = [m for m in proxy.recv_all(settle_ms=500) if isinstance(m, wire.CallRecord)]
    assert {r.execution_id for r in records} == {SOLVER, BREAKER}
    for ex in group:
        mine = [r for r in records if r.execution_id == ex.execution_id]
        script = scripts[ex.execution_id]
        assert sorted(r.call_index for r in mine) == list(range(len(mine)))
        assert all(r.finish_reason == "stop" for r in mine)
        mains = [r for r in mine if r.lineage == "main"]
        subs = [r for r in mine if r.lineage == "sub-agent"]
        assert len(mains) == len(script.main_steps) and len(subs) == 2 and len(mine) == len(mains) + len(subs)
        assert subs[0].agent_id and subs[0].agent_id == subs[1].agent_id
        # Zero drift: each main call's prompt begins with the previous main call's prompt and output.
        assert all(continues(later, earlier) for earlier, later in zip(mains, mains[1:]))
        assert continues(subs[1], subs[0])

        # The harness never saw a hidden test: the visible run lists only the shipped tests.
        prompts = [TOK.decode(r.prompt_ids) for r in mine]
        assert not any(name in p for p in prompts for name in hidden_names)
        after_look = prompts[mine.index(mains[1])]
        assert set(_TEST_LINE.findall(after_look)) == visible_names


# ---------------------------------------------------------------- helpers


def continues(later: wire.CallRecord, earlier: wire.CallRecord) -> bool:
    n = len(earlier.prompt_ids) + len(earlier.output_ids)
    return later.prompt_ids[:n] == earlier.prompt_ids + earlier.output_ids


def _wait_settled(mgr: ExecutionManager, group: list[Execution]) -> None:
    deadline = time.monotonic() + RUN_DEADLINE_S + 60
    while not all(ex.settled for ex in group):
        if time.monotonic() > deadline:
            raise AssertionError("; ".join(_explain(ex) for ex in group))
        mgr.poll(time.monotonic())
        time.sleep(0.1)


def _explain(ex: Execution) -> str:
    tail = ""
    if ex.folder is not None:
        for name in ("stderr.log", "stdout.log", "grade.json"):
            path = ex.folder / name
            if path.exists():
                tail += f"\n--- {name}: {path.read_text(errors='replace')[-1500:]}"
    return f"{ex.execution_id}: state {ex.state}, outcome {ex.outcome}, reward {ex.reward}, error {ex.error!r}{tail}"
