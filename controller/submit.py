"""`gyre launcher=submitit ...`: submit the run as a Slurm job from Python, through submitit.

The job is the same as ``sbatch slurm/gyre_*.sbatch``: ``num_cells * nodes_per_cell`` nodes, the
controller in the batch script on the first node (``slurm_use_srun=False``, so cells' ``srun``
steps get their nodes and no outer step holds them), the same Hydra overrides minus the launcher's.
With ``launcher.wait: true`` this process waits for the job and prints its summary, or the tail of
the job's log when it fails.

submitit stores the submitted call and its result as pickles in ``launcher.folder``; what goes in
them is only ``run_gyre`` (by reference), lists of strings and the run's JSON summary. Gyre's own
wires and files stay MessagePack/JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from controller.config import GyreConfig
from base.typed_config import ConfigError, build

LOG_TAIL_LINES = 40


@dataclass(frozen=True, kw_only=True)
class LocalLauncherConfig:
    kind: Literal["local"]
    """Run the controller in this process (cells as ``cluster.kind`` says)."""


@dataclass(frozen=True, kw_only=True)
class SubmititLauncherConfig:
    """Mirrors conf/launcher/submitit.yaml."""

    kind: Literal["submitit"]
    folder: str
    """submitit's job files and logs (``%j``: the job id)."""
    nodes_per_cell: int
    """Nodes of one cell; the job asks for ``cluster.num_cells`` times this."""
    partition: str
    """Empty: the cluster's default partition."""
    gpus_per_node: int
    timeout_min: int
    job_name: str
    setup: list[str]
    """Shell lines the job runs before Gyre (``module load ...``, ``source venv/bin/activate``)."""
    wait: bool
    """Wait for the job to end and print its summary; otherwise print the job id and return."""

    def check(self) -> None:
        if self.nodes_per_cell < 1 or self.timeout_min < 1 or self.gpus_per_node < 0:
            raise ValueError("nodes_per_cell >= 1, timeout_min >= 1, gpus_per_node >= 0")


LauncherConfig = LocalLauncherConfig | SubmititLauncherConfig


def build_launcher(data: dict[str, Any] | None) -> LauncherConfig:
    """``None`` (no ``launcher`` group in the config) means local."""
    if data is None:
        return LocalLauncherConfig(kind="local")
    kind = data.get("kind") if isinstance(data, dict) else None
    cls = {"local": LocalLauncherConfig, "submitit": SubmititLauncherConfig}.get(kind)
    if cls is None:
        raise ConfigError(f"launcher.kind: want one of ['local', 'submitit'], got {kind!r}")
    return build(cls, data, "launcher")


def job_overrides(overrides: list[str], runs_dir: str) -> list[str]:
    """The command-line overrides the job's own ``gyre`` gets: all but the launcher's (so the job
    runs its controller in place instead of submitting again), and ``run.runs_dir`` made absolute."""
    def key(o: str) -> str:
        return o.lstrip("+~").split("=", 1)[0]
    kept = [o for o in overrides
            if key(o) != "launcher" and not key(o).startswith("launcher.") and key(o) != "run.runs_dir"]
    return [*kept, f"run.runs_dir={runs_dir}"]


def run_gyre(argv: list[str], runs_dir: str, run_name: str) -> dict[str, Any]:
    """Runs in the job, on its first node: ``gyre <argv>`` in a fresh process, its output into the
    job's log. Returns the run's directory and summary; raises (with the exit code) if it failed."""
    proc = subprocess.Popen([sys.executable, "-m", "controller.main", *argv])
    rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"gyre exited with {rc}; its output is in this job's log")
    # controller.main names the run directory <time>-<run.name>-<pid>: the pid makes it ours.
    found = sorted(Path(runs_dir).glob(f"*-{run_name}-{proc.pid}"))
    if len(found) != 1:
        raise RuntimeError(f"gyre finished but {runs_dir}/*-{run_name}-{proc.pid} names {len(found)} directories")
    return {"run_dir": str(found[0].resolve()), "summary": json.loads((found[0] / "summary.json").read_text())}


def make_executor(launcher: SubmititLauncherConfig, num_nodes: int):
    import submitit  # only this launcher needs it

    ex = submitit.AutoExecutor(folder=launcher.folder, cluster="slurm")
    params: dict[str, Any] = dict(
        nodes=num_nodes, tasks_per_node=1, timeout_min=launcher.timeout_min, name=launcher.job_name,
        slurm_use_srun=False,  # the controller runs in the batch script; cells are its srun steps
        slurm_setup=list(launcher.setup),
        # a failed node ends only its cell's step: the controller drops the cell, the run goes on
        slurm_additional_parameters={"no-kill": True},
    )
    if launcher.partition:
        params["slurm_partition"] = launcher.partition
    if launcher.gpus_per_node:
        params["gpus_per_node"] = launcher.gpus_per_node
    ex.update_parameters(**params)
    return ex


def log_tail(path: Path, num_lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return f"(no log at {path})"


def submit_run(launcher: SubmititLauncherConfig, cfg: GyreConfig, overrides: list[str]) -> int:
    """Submit the job; with ``wait``, block until it ends. Returns the exit code for ``gyre``."""
    if cfg.cluster.kind != "slurm":
        print("gyre: launcher=submitit runs the cells as srun steps of the job: add cluster=slurm", file=sys.stderr)
        return 2
    ex = make_executor(launcher, cfg.cluster.num_cells * launcher.nodes_per_cell)
    runs_dir = str(Path(cfg.run.runs_dir).resolve())
    argv = job_overrides(overrides, runs_dir)
    job = ex.submit(run_gyre, argv, runs_dir, cfg.run.name)
    print(f"gyre: submitted Slurm job {job.job_id} ({cfg.cluster.num_cells} cells x {launcher.nodes_per_cell} "
          f"node(s)); log {job.paths.stdout}", flush=True)
    if not launcher.wait:
        return 0
    try:
        # Without srun the function runs once, as task 0; submitit still counts one task per node.
        result = job.task(0).result()
    except Exception as exc:  # submitit's FailedJobError / UncompletedJobError: show the job's own log
        print(f"gyre: job {job.job_id} failed ({job.state}): {exc}\n--- last lines of {job.paths.stdout}:\n"
              f"{log_tail(job.paths.stdout)}\n--- last lines of {job.paths.stderr}:\n{log_tail(job.paths.stderr)}",
              file=sys.stderr, flush=True)
        return 1
    s = result["summary"]
    print(f"gyre: job {job.job_id} done: {s['steps']} steps in {s['wall_s']:.1f}s; eval reward "
          f"{s['eval_reward_start']} -> {s['eval_reward_end']}; report in {result['run_dir']}/report.md", flush=True)
    return 0
