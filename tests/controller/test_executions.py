"""Execution lifecycle with the real bundled harness: a run past its timeout is killed and graded
from its workspace (partial grading), and so is a crashed one; a run that never started is excluded,
never scored 0."""

import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from controller.executions import ExecutionManager, ProxyEndpoint
from base.typed_config import build
from workloads.config import BundledHarnessConfig, WorkloadConfig
from workloads.harnesses.bundled import BundledHarness
from workloads.sandbox.none import NoSandbox
from workloads.tasksets.wordmap import make_tasks
from workloads.tasksets.wordmap_set import WordmapTaskSet

ROOT = Path(__file__).resolve().parents[2]


def workload(**over) -> WorkloadConfig:
    return replace(build(WorkloadConfig, yaml.safe_load((ROOT / "conf/workload/wordmap.yaml").read_text())), **over)


def manager(tmp_path: Path, cfg: WorkloadConfig, proxy_url: str, harness=None) -> ExecutionManager:
    """The bundled harness, unconfined (the sandboxes have tests of their own), against ``proxy_url``."""
    return ExecutionManager(
        workload=cfg, taskset=WordmapTaskSet(cfg), harness=harness or BundledHarness(BundledHarnessConfig(kind="bundled")),
        sandbox=NoSandbox(), work_dir=tmp_path / "work", proxy=ProxyEndpoint(url=proxy_url), model_name="m",
        secret=b"k" * 32,
    )


def wait_ended(mgr: ExecutionManager, deadline_s: float = 30.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        ended = mgr.poll(time.monotonic())
        if ended:
            return ended
        time.sleep(0.05)
    raise AssertionError("no execution ended")


def launch_one(tmp_path: Path, cfg: WorkloadConfig, proxy_url: str):
    """Plan and launch one execution of the first training task against ``proxy_url``."""
    task = make_tasks(cfg)[0][0]
    mgr = manager(tmp_path, cfg, proxy_url)
    (ex,) = mgr.plan_group(step=0, group_id="s0-g0", task=task, train=True, temperature=1.0, size=1)
    mgr.launch(ex, time.monotonic())
    return mgr, ex, task


def test_timed_out_run_is_graded_from_its_workspace(tmp_path):
    silent = socket.socket()  # accepts connections, never answers: the harness hangs on its call
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    mgr, ex, task = launch_one(tmp_path, workload(timeout_s=1.0), f"http://127.0.0.1:{silent.getsockname()[1]}")
    ex.spawning.result(timeout=30)  # the workspace is laid out on a spawner thread
    (ex.workspace / task.file_name).write_text(task.target)  # work the run left before it hung
    (ended,) = wait_ended(mgr)
    silent.close()
    assert ended.outcome == "timed_out" and ended.state == "graded"
    assert ended.reward == pytest.approx(1.0) and mgr.num_timed_out == 1
    assert ended.proc.poll() is not None  # killed, not left behind


def test_a_harness_that_cannot_start_is_a_crash_not_a_hang(tmp_path, monkeypatch):
    """The spawn runs off the control loop; when it fails, the execution is excluded as crashed."""
    import workloads.harnesses.bundled as bundled

    cfg = workload(timeout_s=60.0)
    mgr = manager(tmp_path, cfg, "http://127.0.0.1:9")
    (ex,) = mgr.plan_group(step=0, group_id="s0-g0", task=make_tasks(cfg)[0][0], train=True, temperature=1.0, size=1)
    monkeypatch.setattr(bundled, "SYSTEM_PYTHON", tmp_path / "no-such-python")
    monkeypatch.setattr(bundled.sys, "executable", str(tmp_path / "no-such-python"))
    mgr.launch(ex, time.monotonic())
    (ended,) = wait_ended(mgr)
    assert ended.outcome == "crashed" and ended.reward is None and "did not start" in ended.error


def test_a_crashed_run_is_graded_from_its_workspace(tmp_path):
    """A harness that exits non-zero may have been killed by its agent: it gets the grade its
    workspace earns (the processor still excludes a crash before any call was answered)."""
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens: the harness gives up and exits non-zero
    mgr, _, _ = launch_one(tmp_path, workload(timeout_s=60.0), f"http://127.0.0.1:{port}")
    (ended,) = wait_ended(mgr, 60.0)
    assert ended.outcome == "crashed" and ended.state == "graded"
    assert ended.reward == 0.0 and mgr.num_crashed == 1


def test_harnesses_run_below_the_control_plane_and_carry_their_version_floor(tmp_path):
    """workload.harness_nice: a step's burst of harness start-ups must not starve the controller
    (it delayed routing of the new weights by ~2 s per step in bench.elastic). The token the
    harness is given carries the execution's weight-version floor."""
    import os

    from base.execution_token import verify_token

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    cfg = workload(timeout_s=5.0)
    task = make_tasks(cfg)[0][0]
    mgr = manager(tmp_path, cfg, f"http://127.0.0.1:{silent.getsockname()[1]}")
    (ex,) = mgr.plan_group(step=4, group_id="s4-g0", task=task, train=True, temperature=1.0, size=1, min_version=3)
    mgr.launch(ex, time.monotonic())
    try:
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        proc = ex.spawning.result(timeout=30)  # spawned on the manager's spawner threads
        assert cfg.harness_nice > 0 and os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, ours + cfg.harness_nice)
        # The token travels in the environment, never on argv (readable by any local user in /proc).
        token = _harness_environ(proc.pid)["OPENAI_API_KEY"]
        assert verify_token(b"k" * 32, token) == ("s4-g0-e0", 3, True)  # a training run: sampled at algo.rollout
        assert token not in " ".join(proc.args)
    finally:
        ex.spawning.result().kill()
        ex.spawning.result().wait()
        silent.close()


def planned(tmp_path: Path, *groups: tuple[int, str, int]):
    """A manager (its proxy unreachable: nothing launches) and the executions of each (step,
    group id, size) planned on the first training task; ``eval-`` groups are held-out ones."""
    cfg = workload()
    task = make_tasks(cfg)[0][0]
    mgr = manager(tmp_path, cfg, "http://127.0.0.1:9")
    return mgr, [mgr.plan_group(step=step, group_id=gid, task=task, train=not gid.startswith("eval-"),
                                temperature=0.0 if gid.startswith("eval-") else 1.0, size=size)
                 for step, gid, size in groups]


def test_ended_groups_are_those_whose_every_run_has_ended(tmp_path):
    mgr, (a, b, _, _) = planned(tmp_path, (0, "s0-g0", 2), (0, "s0-g1", 2), (1, "s1-g0", 1), (0, "eval-0", 1))
    assert mgr.ended_groups(0) == set()
    for ex in a + b[:1]:
        ex.move("running")
        ex.move("timed_out")
    assert mgr.ended_groups(0) == {"s0-g0"}  # s0-g1 still has a queued run; eval groups never count
    b[1].move("running")
    b[1].move("crashed")
    assert mgr.ended_groups(0) == {"s0-g0", "s0-g1"}
    assert mgr.ended_groups(1) == set()


def test_running_after_counts_the_live_training_runs_of_later_steps(tmp_path):
    # The scheduler's running_ahead: runs no microstep of the trainable step waits on.
    mgr, (now, later, ev) = planned(tmp_path, (0, "s0-g0", 1), (1, "s1-g0", 3), (1, "eval-1", 1))
    for ex in now + later[:2] + ev:
        ex.move("running")
    assert mgr.running_after(0) == 2  # not the queued one, not step 0's, not the eval run
    later[0].move("finished")
    assert (mgr.running_after(0), mgr.running_after(1)) == (1, 0)


def _harness_environ(pid: int, timeout_s: float = 10.0) -> dict[str, str]:
    """The environment of ``pid`` once it runs the harness itself. The sandbox's launcher (inner.py)
    exec's the harness: read during that exec, /proc/PID/environ is empty, so wait for the
    harness's command line first."""
    deadline = time.monotonic() + timeout_s
    while True:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        if b"sandbox/inner.py" not in cmdline and b"harness.py" in cmdline and raw:
            return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
        assert time.monotonic() < deadline, f"pid {pid} never ran the harness: {cmdline!r}"
        time.sleep(0.01)


def test_harness_output_and_grade_are_kept_in_the_execution_folder(tmp_path):
    """stdout and stderr apart, the prompt as a file outside the workspace, grade.json beside them."""
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    mgr, ex, task = launch_one(tmp_path, workload(timeout_s=60.0), f"http://127.0.0.1:{port}")
    (ended,) = wait_ended(mgr, 60.0)
    folder = tmp_path / "work" / ex.execution_id
    assert "harness: error" in (folder / "stderr.log").read_text()
    assert (folder / "stdout.log").exists() and (folder / "prompt.md").read_text() == task.prompt
    assert ex.workspace == folder / "workspace" and (folder / "workspace" / "TASK.md").exists()


def test_workspaces_are_absolute_even_under_a_relative_runs_dir(tmp_path, monkeypatch):
    """runs_dir defaults to the relative `runs`; a sandbox binds paths as given, so they must be absolute."""
    monkeypatch.chdir(tmp_path)
    cfg = workload()
    mgr = ExecutionManager(
        workload=cfg, taskset=WordmapTaskSet(cfg), harness=BundledHarness(BundledHarnessConfig(kind="bundled")),
        sandbox=NoSandbox(), work_dir=Path("runs/r1/work"), proxy=ProxyEndpoint(url="http://127.0.0.1:9"),
        model_name="m", secret=b"k" * 32,
    )
    (ex,) = mgr.plan_group(step=0, group_id="s0-g0", task=make_tasks(cfg)[0][0], train=True, temperature=1.0, size=1)
    mgr.launch(ex, time.monotonic())
    try:
        assert ex.workspace == tmp_path / "runs/r1/work/s0-g0-e0/workspace"
    finally:
        mgr.kill_all()


MiB = 1 << 20
WRITER = ("import os, sys\nkind, total = sys.argv[1], int(sys.argv[2])\nchunk = b'x' * (1 << 20)\n"
          "if kind == 'disk':\n    for i in range(total):\n        with open(f'{os.environ[\"GYRE_WORKSPACE\"]}/f{i}', 'wb') as f:\n"
          "            f.write(chunk)\n        if i % 8 == 7:\n            import time; time.sleep(0.05)\n"
          "else:\n    for i in range(total):\n        sys.stdout.buffer.write(chunk)\n        sys.stdout.buffer.flush()\n"
          "        if i % 8 == 7:\n            import time; time.sleep(0.05)\n")


def _limited(tmp_path: Path, kind: str, total_mib: int, limits):
    from workloads.config import CommandHarnessConfig
    from workloads.harnesses.command import CommandHarness

    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    cfg = workload(timeout_s=60.0)
    harness = CommandHarness(CommandHarnessConfig(kind="command", argv=("/usr/bin/python3", str(script), kind,
                                                                           str(total_mib)), env={}, ro_paths=()))
    mgr = ExecutionManager(
        workload=cfg, taskset=WordmapTaskSet(cfg), harness=harness, sandbox=NoSandbox(), work_dir=tmp_path / "work",
        proxy=ProxyEndpoint(url="http://127.0.0.1:9"), model_name="m", secret=b"k" * 32, limits=limits,
    )
    (ex,) = mgr.plan_group(step=0, group_id="s0-g0", task=make_tasks(cfg)[0][0], train=True, temperature=1.0, size=1)
    mgr.launch(ex, time.monotonic())
    try:
        (ended,) = wait_ended(mgr, 60.0)
    finally:
        mgr.kill_all()
    return ended


def _harness_limits(**over):
    from tests.workloads import sandbox_config

    return replace(sandbox_config("none").limits, disk_check_s=0.2, **over)


@pytest.mark.parametrize("kind", ["disk", "log"])
def test_a_run_past_its_disk_or_log_limit_is_killed_and_graded(tmp_path, kind):
    over = {"disk_bytes": 8 * MiB} if kind == "disk" else {"log_bytes": 4 * MiB}
    ended = _limited(tmp_path / "on", kind, 64, _harness_limits(**over))
    assert ended.outcome == "crashed" and ended.state == "graded", ended.error
    assert ("disk_bytes" if kind == "disk" else "log_bytes") in ended.error
    if kind == "log":  # cut back to the limit, with a line saying so
        log = (ended.folder / "stdout.log").read_bytes()
        assert len(log) < 4 * MiB + 200 and b"[gyre: cut at" in log
    else:
        assert sum(p.stat().st_size for p in ended.workspace.glob("f*")) < 64 * MiB
    # The same run without the limit writes everything: the watchdog is what stopped it.
    free = _limited(tmp_path / "off", kind, 64, _harness_limits(disk_bytes=0, log_bytes=0, disk_files=0))
    written = (sum(p.stat().st_size for p in free.workspace.glob("f*")) if kind == "disk"
               else (free.folder / "stdout.log").stat().st_size)
    assert written == 64 * MiB and not free.error.startswith("killed")



SHOW_PATHS = """import json, os, sys
seen = [os.getcwd(), os.environ["HOME"], os.environ["GYRE_WORKSPACE"], os.environ["GYRE_PROMPT_FILE"],
        open(os.environ["GYRE_PROMPT_FILE"]).read(), sys.argv[1]]
open("seen.json", "w").write(json.dumps(seen))
"""


def test_every_execution_of_a_group_sees_the_same_paths_under_bwrap(tmp_path):
    """Harnesses name their working directory and home in the prompt: under a sandbox that can show
    paths anywhere, each execution sees /workspace and /home/agent, so a group's prompts agree."""
    import json
    import os

    from tests.workloads import sandbox_config
    from workloads.config import CommandHarnessConfig
    from workloads.harnesses.command import CommandHarness
    from workloads.sandbox import make_sandbox
    from workloads.sandbox.bwrap import bwrap_problem

    if bwrap_problem("") and os.environ.get("CI") != "true":
        pytest.skip(f"bwrap cannot run here: {bwrap_problem('')}")
    script = tmp_path / "show_paths.py"
    script.write_text(SHOW_PATHS)
    socket_dir = tmp_path / "proxy"
    socket_dir.mkdir()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(socket_dir / "proxy.sock"))  # never answered: the harness only looks around
    cfg = workload(timeout_s=60.0)
    harness = CommandHarness(CommandHarnessConfig(kind="command", argv=("/usr/bin/python3", str(script), "{workspace}"),
                                                  env={}, ro_paths=(str(script),)))
    mgr = ExecutionManager(
        workload=cfg, taskset=WordmapTaskSet(cfg), harness=harness, sandbox=make_sandbox(sandbox_config("bwrap")),
        work_dir=tmp_path / "work", model_name="m", secret=b"k" * 32,
        proxy=ProxyEndpoint(url="http://127.0.0.1:8123", unix_socket=socket_dir / "proxy.sock"),
    )
    group = mgr.plan_group(step=0, group_id="s0-g0", task=make_tasks(cfg)[0][0], train=True, temperature=1.0, size=2)
    for ex in group:
        mgr.launch(ex, time.monotonic())
    try:
        ended = wait_ended(mgr, 60.0)
        while len(ended) < 2:
            ended += wait_ended(mgr, 60.0)
    finally:
        mgr.kill_all()
        listener.close()
    seen = [json.loads((ex.workspace / "seen.json").read_text()) for ex in group]  # written to each host workspace
    assert seen[0] == seen[1] == ["/workspace", "/home/agent", "/workspace", "/run/gyre/prompt.md",
                                  group[0].task.prompt, "/workspace"]
