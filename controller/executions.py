"""Execution lifecycle: one harness run on one task, in its own workspace, with its own token.

States walk a transition table (queued -> running -> finished | timed_out | crashed -> graded |
grade_failed). A timed-out run is killed and graded from its saved workspace; a crashed run or a
grader failure is excluded from training (reward None), never scored 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from harness_proxy.auth import mint_token
from workloads.config import WorkloadConfig
from workloads.graders.wordmap import grade
from workloads.tasksets.wordmap import Task, write_task_file

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
    proc: subprocess.Popen | None = None
    spawning: Future[subprocess.Popen] | None = None
    """The spawn in flight on the manager's spawner threads; ``proc`` once it is done."""
    started_at: float = 0.0
    ended_at: float = 0.0

    def move(self, new: ExecState) -> None:
        if new not in TRANSITIONS.get(self.state, ()):
            raise RuntimeError(f"execution {self.execution_id}: {self.state} -> {new} is not a transition")
        self.state = new

    @property
    def live(self) -> bool:
        return self.state in ("queued", "running")


class ExecutionManager:
    def __init__(self, *, workload: WorkloadConfig, work_dir: Path, proxy_url: str, model_name: str, secret: bytes):
        self.cfg = workload
        self.work_dir = work_dir
        self.proxy_url = proxy_url
        self.model_name = model_name
        self.secret = secret
        self.executions: dict[str, Execution] = {}
        self.num_crashed = 0
        self.num_timed_out = 0
        self.num_grade_failed = 0
        # Popen returns only once the child has exec'd; on a loaded node that is tens of ms per
        # harness, and a step's burst of launches held the control loop for 2-3 s. Spawning on
        # these threads keeps the loop answering cells and the proxy meanwhile.
        self._spawner = ThreadPoolExecutor(max_workers=SPAWN_THREADS, thread_name_prefix="harness-spawn")

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
        ws = self.work_dir / ex.execution_id
        shutil.rmtree(ws, ignore_errors=True)
        ws.mkdir(parents=True)
        write_task_file(ex.task, ws)
        argv = [
            sys.executable, "-m", "workloads.harness",
            "--base-url", f"{self.proxy_url}/v1",
            "--api-key", mint_token(self.secret, ex.execution_id, min_version=ex.min_version),
            "--workspace", str(ws),
            "--max-turns", str(self.cfg.max_turns),
            "--max-tokens", str(self.cfg.max_new_tokens),
            "--temperature", str(ex.temperature),
            "--model", self.model_name,
        ]
        think = self.cfg.think_time
        if think.kind == "lognormal":  # long-tailed run lengths (workload.think_time, bench.elastic)
            argv += ["--think-median-s", str(think.median_s), "--think-sigma", str(think.sigma),
                     "--think-max-s", str(think.max_s), "--think-seed", str(think.seed)]
        env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
        ex.spawning = self._spawner.submit(self._spawn, argv, env, self.work_dir / f"{ex.execution_id}.log")
        ex.workspace = ws
        ex.started_at = now  # the timeout clock starts now, spawn included
        ex.move("running")

    def _spawn(self, argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
        """On a spawner thread: start one harness (its own session, lower CPU priority)."""
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        if self.cfg.harness_nice:
            # After the spawn rather than in a preexec_fn (which would stop Popen using vfork): the
            # child has at most begun its interpreter's start-up at the controller's priority.
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
        except OSError as exc:
            ex.error = f"harness did not start: {exc}"
        return True

    def poll(self, now: float) -> list[Execution]:
        """Reap ended harness runs, kill overdue ones, grade them; return the newly graded."""
        ended = []
        for ex in self.executions.values():
            if ex.state != "running":
                continue
            if not self._spawn_over(ex):
                continue  # still spawning; its timeout clock runs
            # -1: the spawn failed, a crash, excluded (ex.error says why)
            code = ex.proc.poll() if ex.proc is not None else -1
            if code is None and now - ex.started_at > self.cfg.timeout_s:
                _kill(ex.proc)
                ex.move("timed_out")
                ex.outcome = "timed_out"
                self.num_timed_out += 1
                log.warning("execution %s: timed out after %.1fs; grading its workspace", ex.execution_id, now - ex.started_at)
            elif code is None:
                continue
            elif code == 0:
                ex.move("finished")
                ex.outcome = "finished"
            else:
                ex.move("crashed")
                ex.outcome = "crashed"
                ex.error = ex.error or f"harness exit code {code}"
                self.num_crashed += 1
                log.error("execution %s: harness crashed (exit %s); excluded from training", ex.execution_id, code)
            ex.ended_at = now
            self._grade(ex)
            ended.append(ex)
        return ended

    def _grade(self, ex: Execution) -> None:
        if ex.outcome == "crashed":
            ex.move("grade_failed")
            return
        result = grade(ex.task, ex.workspace)
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


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        log.error("harness pid %d did not die after SIGKILL", proc.pid)


