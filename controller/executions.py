"""Execution lifecycle: one harness run on one task, in its own workspace, with its own token.

States walk a transition table (queued -> running -> finished | timed_out | crashed -> graded |
grade_failed). A timed-out run is killed and graded from its saved workspace; a crashed run or a
grader failure is excluded from training (reward None), never scored 0.

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from harness_proxy.auth import mint_token
from workloads.api import GradeResult, HarnessAdapter, HarnessLaunch, RunArtifacts, Sandbox, SandboxSpec, Task, TaskSet
from workloads.config import WorkloadConfig
from workloads.drift import run_shape
from workloads.harnesses.common import common_env

log = logging.getLogger(__name__)

ExecState = Literal["queued", "running", "finished", "timed_out", "crashed", "graded", "grade_failed"]
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "queued": ("running",),
    "running": ("finished", "timed_out", "crashed"),
    "finished": ("graded", "grade_failed"),
    "timed_out": ("graded", "grade_failed"),
    "crashed": ("grade_failed",),
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
                 work_dir: Path, proxy: ProxyEndpoint, model_name: str, secret: bytes):
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
        launch = HarnessLaunch(
            execution_id=ex.execution_id, workspace=ws, prompt_file=prompt_file, home=home, model=self.model_name,
            base_url=f"{self.proxy.url}/v1", anthropic_base_url=self.proxy.url, token=token,
            max_turns=shape.max_turns, max_new_tokens=self.cfg.max_new_tokens, temperature=ex.temperature,
            think_scale=shape.think_scale,
        )
        cmd = self.harness.command(launch)
        env = {**common_env(launch), **cmd.env}
        spec = SandboxSpec(argv=cmd.argv, workspace=ws, env=env, home=home, ro_paths=(prompt_file, *cmd.ro_paths),
                           network="proxy", proxy_port=self.proxy.port, proxy_socket=self.proxy.unix_socket)
        argv = self.sandbox.wrap(spec)
        with open(folder / "stdout.log", "wb") as out, open(folder / "stderr.log", "wb") as err:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=ws,
                                    start_new_session=True)
        if self.cfg.harness_nice:
            # After the spawn rather than in a preexec_fn (which would stop Popen using vfork): the
            # child has at most begun its start-up at the controller's priority.
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, proc.pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + self.cfg.harness_nice))
        return proc

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
            if ex.state in ("finished", "timed_out") and ex.grading is None:
                ex.grading = self._graders.submit(self._grade, ex)
            if ex.state == "crashed":
                ex.move("grade_failed")
                done.append(ex)
            elif ex.grading is not None and ex.grading.done() and ex.state in ("finished", "timed_out"):
                self._take_grade(ex)
                done.append(ex)
        return done

    def _reap(self, ex: Execution, now: float) -> None:
        if not self._spawn_over(ex):
            return  # still spawning; its timeout clock runs
        # -1: the spawn failed, a crash, excluded (ex.error says why)
        code = ex.proc.poll() if ex.proc is not None else -1
        if code is None and now - ex.started_at > self.cfg.timeout_s:
            _kill(ex.proc)
            ex.move("timed_out")
            ex.outcome = "timed_out"
            self.num_timed_out += 1
            log.warning("execution %s: timed out after %.1fs; grading its workspace", ex.execution_id, now - ex.started_at)
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
            log.error("execution %s: harness crashed (%s; stderr in %s); excluded from training", ex.execution_id,
                      ex.error, ex.folder / "stderr.log" if ex.folder else "-")
        ex.ended_at = now

    def _grade(self, ex: Execution) -> GradeResult:
        """On a grader thread. Whatever goes wrong here is a grader failure, never reward 0."""
        try:
            run = RunArtifacts(stdout_path=ex.folder / "stdout.log", stderr_path=ex.folder / "stderr.log",
                               outcome=ex.outcome)
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
        self._spawner.shutdown(wait=True)  # every spawn in flight lands first, so none escapes
        for ex in self.executions.values():
            if ex.state == "running" and self._spawn_over(ex) and ex.proc is not None:
                _kill(ex.proc)
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


