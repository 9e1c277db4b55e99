"""Execution lifecycle: one harness run on one task, in its own workspace, with its own token.

States walk a transition table (queued -> running -> finished | timed_out | crashed -> graded |
grade_failed). A run past its timeout, or past a limit of its own (log bytes, disk, files: the
watchdog here), is killed and graded from its saved workspace; so is a crashed run, since a harness
killed from inside is the agent's doing (the processor still excludes a crash before any call was
answered). Only a run whose sandbox never started (no "started" byte from its launcher) or whose
spawn failed is excluded without a grade; a grader failure is excluded too, never scored 0.

Each run gets the sandbox's limits, and a cgroup of its own where the node lets the run make them;
when it ends, whatever is left in its cgroup is killed, setuid/setgid bits are stripped from its
workspace and home, and over-long logs are cut.

What runs is configured, not fixed: the task set lays out each workspace and grades it (on grader
threads, off the control loop), a harness adapter says which program to start, the sandbox
confines it; this module only sequences them and keeps the harness's stdout and stderr in the
execution's folder.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from base.execution_token import mint_token
from workloads.api import (
    HOME_INSIDE, PROMPT_INSIDE, WORKSPACE_INSIDE, GradeResult, HarnessAdapter, HarnessLaunch, RunArtifacts, Sandbox,
    SandboxSpec, Task, TaskSet,
)
from workloads.config import LimitsConfig, WorkloadConfig
from workloads.drift import run_shape
from workloads.harnesses.common import common_env
from workloads.sandbox.aftercare import cut_log, measure, strip_special_bits

log = logging.getLogger(__name__)

ExecState = Literal["queued", "running", "finished", "timed_out", "crashed", "graded", "grade_failed"]
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "queued": ("running",),
    "running": ("finished", "timed_out", "crashed"),
    "finished": ("graded", "grade_failed"),
    "timed_out": ("graded", "grade_failed"),
    "crashed": ("graded", "grade_failed"),
}
PROJECT_ROOT = Path(__file__).resolve().parent.parent
SPAWN_THREADS = 4
GRADE_THREADS = 2
"""Graders run hidden tests (seconds each): off the control loop, two at a time on a 2-core node."""


@dataclass(frozen=True, kw_only=True)
class ProxyEndpoint:
    url: str
    """``http://host:port``, the proxy's root."""
    unix_socket: Path | None = None
    """Where a sandbox with its own network reaches the proxy (workloads/sandbox/relay.py)."""

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 80


@dataclass
class Execution:
    execution_id: str
    task: Task
    step: int
    group_id: str
    group_size: int
    train: bool
    temperature: float
    min_version: int = 0
    """The oldest weight version this execution's calls may come from (in its token, so the proxy
    enforces it on every call): step - staleness for training, the evaluated version for eval."""
    state: ExecState = "queued"
    outcome: Literal["finished", "timed_out", "crashed"] | None = None
    reward: float | None = None
    error: str = ""
    workspace: Path | None = None
    folder: Path | None = None
    """The execution's own folder: ``workspace/``, ``home/``, the prompt, the harness's stdout and
    stderr, ``grade.json``. Only ``workspace/`` and ``home/`` are visible to the harness."""
    proc: subprocess.Popen | None = None
    spawning: Future[subprocess.Popen] | None = None
    """The spawn in flight on the manager's spawner threads; ``proc`` once it is done."""
    grading: Future[GradeResult] | None = None
    started_at: float = 0.0
    ended_at: float = 0.0
    started_pipe: int = -1
    """Read end of the pipe the sandbox's launcher writes its "started" byte to."""
    cgroup: Any = None
    """The run's ``ExecutionCgroup`` while it runs, where there is one."""
    limit_hit: str = ""
    """Set by the watchdog: the limit this run passed (it is then killed and graded)."""

    def move(self, new: ExecState) -> None:
        if new not in TRANSITIONS.get(self.state, ()):
            raise RuntimeError(f"execution {self.execution_id}: {self.state} -> {new} is not a transition")
        self.state = new

    @property
    def live(self) -> bool:
        return self.state in ("queued", "running")

    @property
    def settled(self) -> bool:
        """Graded or excluded: a run that ended may still be with its grader (hidden tests take seconds)."""
        return self.state in ("graded", "grade_failed")


class ExecutionManager:
    """Plans, launches, reaps and grades executions: the task set lays out each workspace, the
    harness adapter says what to run, the sandbox confines it (and its grader)."""

    def __init__(self, *, workload: WorkloadConfig, taskset: TaskSet, harness: HarnessAdapter, sandbox: Sandbox,
                 work_dir: Path, proxy: ProxyEndpoint, model_name: str, secret: bytes,
                 limits: LimitsConfig | None = None, cgroups: Any = None):
        """``limits``: each harness run's (None: none); ``cgroups``: a ``CgroupSupport`` (None: rlimits only)."""
        self.cfg = workload
        self.taskset = taskset
        self.harness = harness
        self.sandbox = sandbox
        self.work_dir = work_dir.resolve()  # sandboxes bind paths as they are: absolute ones
        self.proxy = proxy
        self.model_name = model_name
        self.secret = secret
        self.executions: dict[str, Execution] = {}
        self.num_crashed = 0
        self.num_timed_out = 0
        self.num_grade_failed = 0
        # Popen returns only once the child has exec'd; on a loaded node that is tens of ms per
        # harness, and a step's burst of launches held the control loop for 2-3 s. Spawning (and
        # laying out the workspace, a copy of a repository for coding tasks) on these threads keeps
        # the loop answering cells and the proxy meanwhile.
        self._spawner = ThreadPoolExecutor(max_workers=SPAWN_THREADS, thread_name_prefix="harness-spawn")
        self._graders = ThreadPoolExecutor(max_workers=GRADE_THREADS, thread_name_prefix="grader")
        self.limits = limits
        self.cgroups = cgroups
        self._watchdog_stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        if limits is not None and (limits.log_bytes or limits.disk_bytes or limits.disk_files):
            self._watchdog = threading.Thread(target=self._watch, name="execution-watchdog", daemon=True)
            self._watchdog.start()

    def plan_group(self, *, step: int, group_id: str, task: Task, train: bool, temperature: float, size: int,
                   min_version: int = 0) -> list[Execution]:
        group = [
            Execution(
                execution_id=f"{group_id}-e{i}", task=task, step=step, group_id=group_id,
                group_size=size, train=train, temperature=temperature, min_version=max(0, min_version),
            )
            for i in range(size)
        ]
        for ex in group:
            self.executions[ex.execution_id] = ex
        return group

    def count(self, state: ExecState) -> int:
        return sum(1 for ex in self.executions.values() if ex.state == state)

    def queued_after(self, step: int) -> int:
        """Queued training executions of steps after ``step``."""
        return sum(1 for ex in self.executions.values() if ex.state == "queued" and ex.train and ex.step > step)

    def running_after(self, step: int) -> int:
        """Running training executions of steps after ``step``."""
        return sum(1 for ex in self.executions.values() if ex.state == "running" and ex.train and ex.step > step)

    def ended_groups(self, step: int) -> set[str]:
        """Training groups of ``step`` with every run ended: their data is on its way to training."""
        live: set[str] = set()
        seen: set[str] = set()
        for ex in self.executions.values():
            if ex.train and ex.step == step:
                seen.add(ex.group_id)
                if ex.live:
                    live.add(ex.group_id)
        return seen - live

    def queued(self) -> list[Execution]:
        return [ex for ex in self.executions.values() if ex.state == "queued"]

    def launch(self, ex: Execution, now: float) -> None:
        ex.folder = self.work_dir / ex.execution_id
        ex.workspace = ex.folder / "workspace"
        ex.spawning = self._spawner.submit(self._start, ex)
        ex.started_at = now  # the timeout clock starts now, workspace and spawn included
        ex.move("running")

    def _start(self, ex: Execution) -> subprocess.Popen:
        """On a spawner thread: lay out the execution's folder, then start its harness, sandboxed."""
        folder, ws = ex.folder, ex.workspace
        shutil.rmtree(folder, ignore_errors=True)
        home = folder / "home"
        home.mkdir(parents=True)
        self.taskset.prepare(ex.task, ws)
        prompt_file = folder / "prompt.md"
        prompt_file.write_text(ex.task.prompt, encoding="utf-8")
        token = mint_token(self.secret, ex.execution_id, min_version=ex.min_version, train=ex.train)
        shape = run_shape(self.cfg, ex.step, train=ex.train)
        # Every execution sees the same paths where the sandbox can show them anywhere: harnesses
        # name their working directory and home in the prompt, and a group's prompts then share
        # their prefix (and the engine its KV) up to the task itself.
        fixed = self.sandbox.shows_fixed_paths
        launch = HarnessLaunch(
            execution_id=ex.execution_id, workspace=WORKSPACE_INSIDE if fixed else ws,
            prompt_file=PROMPT_INSIDE if fixed else prompt_file, home=HOME_INSIDE if fixed else home,
            host_home=home, host_prompt_file=prompt_file, model=self.model_name,
            base_url=f"{self.proxy.url}/v1", anthropic_base_url=self.proxy.url, token=token,
            max_turns=shape.max_turns, max_new_tokens=self.cfg.max_new_tokens, temperature=ex.temperature,
            think_scale=shape.think_scale,
        )
        cmd = self.harness.command(launch)
        env = {**common_env(launch), **cmd.env}
        ro_paths, image = self._task_environment(ex.task, env)
        read_fd, write_fd = os.pipe()
        spec = SandboxSpec(argv=cmd.argv, workspace=ws, env=env, home=home,
                           workspace_inside=WORKSPACE_INSIDE if fixed else None,
                           home_inside=HOME_INSIDE if fixed else None,
                           ro_binds=((prompt_file, PROMPT_INSIDE),) if fixed else (),
                           ro_paths=(*(() if fixed else (prompt_file,)), *cmd.ro_paths, *ro_paths), network="proxy",
                           proxy_port=self.proxy.port, proxy_socket=self.proxy.unix_socket,
                           limits=self.limits.resources() if self.limits is not None else None, started_fd=write_fd,
                           image=image)
        try:
            argv = self.sandbox.wrap(spec)
            if self.cgroups is not None and self.limits is not None:
                ex.cgroup = self.cgroups.create(ex.execution_id, processes=self.limits.processes,
                                                memory_bytes=self.limits.memory_bytes)
                argv = [*ex.cgroup.join_argv(), *argv]
            with open(folder / "stdout.log", "wb") as out, open(folder / "stderr.log", "wb") as err:
                proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=ws,
                                        start_new_session=True, pass_fds=(write_fd,))
        except BaseException:
            os.close(read_fd)
            self._release_cgroup(ex)
            raise
        finally:
            os.close(write_fd)
        ex.started_pipe = read_fd
        if self.cfg.harness_nice:
            # After the spawn rather than in a preexec_fn (which would stop Popen using vfork): the
            # child has at most begun its start-up at the controller's priority.
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, proc.pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + self.cfg.harness_nice))
        return proc

    def _task_environment(self, task: Task, env: dict[str, str]) -> tuple[tuple[Path, ...], str]:
        """(read-only paths, image) for the task's environment: a folder is bound and its ``bin/``
        put first on ``PATH`` (in ``env``); an image replaces the sandbox's (apptainer)."""
        environment = getattr(self.taskset, "environment", None)
        where = environment(task) if environment is not None else None
        if where is None:
            return (), ""
        if where.is_file():
            return (), str(where)
        env["PATH"] = f"{where}/bin:{env['PATH']}"
        return (where,), ""

    def _spawn_over(self, ex: Execution) -> bool:
        """Whether ``ex``'s spawn has finished: ``ex.proc`` is set, or, when it failed, ``ex.error``."""
        if ex.proc is not None or ex.error:
            return True
        if ex.spawning is None or not ex.spawning.done():
            return False
        try:
            ex.proc = ex.spawning.result()
        except Exception as exc:  # a workspace that cannot be laid out, a harness that cannot start
            ex.error = f"harness did not start: {type(exc).__name__}: {exc}"
        return True

    def poll(self, now: float) -> list[Execution]:
        """Reap ended harness runs, kill overdue ones, start their grading; return the newly graded
        (or excluded) executions."""
        done = []
        for ex in self.executions.values():
            if ex.state == "running":
                self._reap(ex, now)
            if ex.state in ("finished", "timed_out", "crashed") and ex.proc is None and ex.grading is None:
                # never ran in a sandbox (a failed spawn, a sandbox that did not start): nothing to grade
                ex.move("grade_failed")
                done.append(ex)
                continue
            if ex.state in ("finished", "timed_out", "crashed") and ex.grading is None:
                ex.grading = self._graders.submit(self._grade, ex)
            if ex.grading is not None and ex.grading.done() and ex.state in ("finished", "timed_out", "crashed"):
                self._take_grade(ex)
                done.append(ex)
        return done

    def _reap(self, ex: Execution, now: float) -> None:
        if not self._spawn_over(ex):
            return  # still spawning; its timeout clock runs
        # -1: the spawn failed, a crash, excluded (ex.error says why)
        code = ex.proc.poll() if ex.proc is not None else -1
        if code is None and (ex.limit_hit or now - ex.started_at > self.cfg.timeout_s):
            _kill(ex.proc)
            self._release_cgroup(ex)
            if ex.limit_hit:  # the agent's doing: graded from its workspace, like any crash
                ex.move("crashed")
                ex.outcome = "crashed"
                ex.error = f"killed: {ex.limit_hit}"
                self.num_crashed += 1
                log.warning("execution %s: %s; killed, grading its workspace", ex.execution_id, ex.error)
            else:
                ex.move("timed_out")
                ex.outcome = "timed_out"
                self.num_timed_out += 1
                log.warning("execution %s: timed out after %.1fs; grading its workspace", ex.execution_id,
                            now - ex.started_at)
        elif code is None:
            return
        elif code == 0:
            ex.move("finished")
            ex.outcome = "finished"
        else:
            ex.move("crashed")
            ex.outcome = "crashed"
            ex.error = ex.error or f"harness exit code {code}"
            self.num_crashed += 1
            log.error("execution %s: harness crashed (%s; stderr in %s); graded from its workspace", ex.execution_id,
                      ex.error, ex.folder / "stderr.log" if ex.folder else "-")
        ex.ended_at = now
        self._release_cgroup(ex)
        if ex.proc is not None and not self._sandbox_started(ex):
            ex.error = (f"the sandbox did not start ({ex.error or f'exit {code}'}); stderr in "
                        f"{ex.folder / 'stderr.log' if ex.folder else '-'}")
            ex.proc = None  # a node's or Gyre's failure: excluded, never graded
        self._aftercare(ex)

    def _sandbox_started(self, ex: Execution) -> bool:
        if ex.started_pipe < 0:
            return False
        try:
            os.set_blocking(ex.started_pipe, False)
            return os.read(ex.started_pipe, 1) == b"1"
        except BlockingIOError:
            return False
        finally:
            os.close(ex.started_pipe)
            ex.started_pipe = -1

    def _release_cgroup(self, ex: Execution) -> None:
        """Kill whatever is left of the run (a child that left its process group too), drop its cgroup."""
        group, ex.cgroup = ex.cgroup, None
        if group is None:
            return
        hit = {k: v for k, v in group.events().items() if v}
        if hit:
            log.warning("execution %s: cgroup limits hit: %s", ex.execution_id, hit)
            if not ex.limit_hit:
                ex.limit_hit = ", ".join(f"{k} {v}" for k, v in hit.items())
        group.remove()

    def _aftercare(self, ex: Execution) -> None:
        if ex.folder is None:
            return
        for sub in ("workspace", "home"):
            stripped = strip_special_bits(ex.folder / sub)
            if stripped:
                log.warning("execution %s: setuid/setgid bits stripped from %s: %s", ex.execution_id, sub, stripped[:5])
        if self.limits is not None and self.limits.log_bytes:
            for name in ("stdout.log", "stderr.log"):
                cut_log(ex.folder / name, self.limits.log_bytes)

    def _watch(self) -> None:
        """The watchdog thread: logs, disk and files of every running execution, every
        ``limits.disk_check_s``; a run past one is marked, and ``poll`` kills it."""
        assert self.limits is not None
        lim = self.limits
        while not self._watchdog_stop.wait(lim.disk_check_s):
            for ex in list(self.executions.values()):
                if ex.state != "running" or ex.proc is None or ex.limit_hit or ex.folder is None:
                    continue
                ex.limit_hit = over_limits(ex.folder, lim)
                if ex.limit_hit:
                    log.warning("execution %s: over its limits: %s", ex.execution_id, ex.limit_hit)

    def _grade(self, ex: Execution) -> GradeResult:
        """On a grader thread. Whatever goes wrong here is a grader failure, never reward 0."""
        try:
            run = RunArtifacts(stdout_path=ex.folder / "stdout.log", stderr_path=ex.folder / "stderr.log",
                               outcome=ex.outcome, grade_dir=ex.folder / "grade")
            result = self.taskset.grade(ex.task, ex.workspace, run)
        except Exception as exc:
            result = GradeResult(reward=None, error=f"grader raised {type(exc).__name__}: {exc}")
        with contextlib.suppress(OSError, TypeError, ValueError):
            (ex.folder / "grade.json").write_text(json.dumps(
                {"reward": result.reward, "error": result.error, "detail": getattr(result, "detail", {})}))
        return result

    def _take_grade(self, ex: Execution) -> None:
        result = ex.grading.result()
        if result.reward is None:
            ex.move("grade_failed")
            ex.error = result.error
            self.num_grade_failed += 1
            log.error("execution %s: grader failed: %s (excluded, not scored 0)", ex.execution_id, result.error)
        else:
            ex.reward = result.reward
            ex.move("graded")

    def kill_all(self) -> None:
        self._watchdog_stop.set()
        self._spawner.shutdown(wait=True)  # every spawn in flight lands first, so none escapes
        for ex in self.executions.values():
            if ex.state == "running" and self._spawn_over(ex) and ex.proc is not None:
                _kill(ex.proc)
            self._release_cgroup(ex)
            if ex.started_pipe >= 0:
                os.close(ex.started_pipe)
                ex.started_pipe = -1
        self._graders.shutdown(wait=True, cancel_futures=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        log.error("harness pid %d did not die after SIGKILL", proc.pid)


def over_limits(folder: Path, lim: LimitsConfig) -> str:
    """The first of ``lim``'s log, disk and file limits ``folder`` (an execution's) is past, or ''."""
    if lim.log_bytes:
        for name in ("stdout.log", "stderr.log"):
            with contextlib.suppress(OSError):
                size = (folder / name).stat().st_size
                if size > lim.log_bytes:
                    return f"{name} at {size} bytes, over sandbox.limits.log_bytes {lim.log_bytes}"
    if lim.disk_bytes or lim.disk_files:
        usage = measure([folder / "workspace", folder / "home"], max_entries=lim.disk_files or 10**9)
        if lim.disk_files and not usage.complete:
            return f"over sandbox.limits.disk_files {lim.disk_files} files and folders in its workspace and home"
        if lim.disk_bytes and usage.num_bytes > lim.disk_bytes:
            return f"{usage.num_bytes} bytes in its workspace and home, over sandbox.limits.disk_bytes {lim.disk_bytes}"
    return ""
