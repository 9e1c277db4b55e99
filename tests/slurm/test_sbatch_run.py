"""Gyre as real Slurm jobs on the local cluster (slurm/local-cluster.sh): 8 virtual nodes.

1. `sbatch slurm/gyre_local.sbatch` runs the embedded default on 4 cells x 2 nodes to the end;
   every cell serves and trains, each cell is its own srun step on its own two nodes.
2. Mid-run, one cell's step is cancelled (`scancel <job>.<step>`) and a node of another cell is
   set DOWN (the job has `--no-kill`): the controller drops both cells and the run finishes.
3. `gyre launcher=submitit cluster=slurm ...` submits a short job through submitit and prints its
   summary; a job that fails shows the job's log; `cluster=local` is refused before submitting.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHORT_RUN = ["workload.groups_per_step=2", "workload.group_size=4", "workload.min_usable_per_group=2",
             "workload.num_eval_tasks=4", "run.progress_every_s=5"]
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def slurm(env: dict, *argv: str, timeout: float = 30) -> str:
    out = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(argv)}: {out.stderr}"
    return out.stdout


def sbatch(env: dict, tmp: Path, *args: str) -> str:
    return slurm(env, "sbatch", "--parsable", f"--output={tmp}/slurm-%j.out", f"--chdir={ROOT}",
                 str(ROOT / "slurm/gyre_local.sbatch"), *args).strip().split(";")[0]


def wait_job(env: dict, job_id: str, timeout_s: float) -> tuple[str, str]:
    """(State, ExitCode) of the job once it has ended, from accounting. A job that lost a node
    has two records (RESIZING, then the shrunk job): the last one is the job's end."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = slurm(env, "sacct", "-X", "-n", "-P", "-j", job_id, "--format=State,ExitCode").strip()
        last = out.splitlines()[-1] if out else ""
        if last and last.split("|")[0].split()[0] in TERMINAL:
            state, code = last.split("|")
            return state, code
        time.sleep(1)
    subprocess.run(["scancel", job_id], env=env, timeout=30)
    raise AssertionError(f"job {job_id} still running after {timeout_s}s")


def steps_of(env: dict, job_id: str) -> dict[str, tuple[str, str]]:
    """{step name: (node list, state)} of the job's steps, from accounting."""
    out = slurm(env, "sacct", "-n", "-P", "-j", job_id, "--format=JobID,JobName,NodeList,State")
    rows = [line.split("|") for line in out.strip().splitlines()]
    return {name: (nodes, state) for jid, name, nodes, state in rows if "." in jid}


def run_dir_of(runs: Path, timeout_s: float = 60) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [p for p in runs.glob("*") if p.is_dir() and not p.is_symlink()] if runs.exists() else []
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no run directory under {runs}")


def events(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [e for e in (json.loads(x) for x in lines if x.endswith("}")) if e["kind"] == kind]


@pytest.mark.e2e
def test_embedded_default_as_an_sbatch_job(slurm_env, tmp_path):
    # The embedded default's workload (4 groups x 8 a step), so every satellite's training is
    # needed and every cell both serves and trains; fewer steps and eval tasks keep it short.
    steps = 8
    job = sbatch(slurm_env, tmp_path, f"run.steps={steps}", f"run.runs_dir={tmp_path}/runs",
                 "workload.num_eval_tasks=4", "run.progress_every_s=5")
    state, code = wait_job(slurm_env, job, timeout_s=240)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert (state, code) == ("COMPLETED", "0:0"), log[-3000:]
    run_dir = run_dir_of(tmp_path / "runs")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    for cell in summary["cells"]:
        assert cell["served_s"] > 0 and cell["trained_s"] > 0, cell
    assert (run_dir / f"checkpoints/v{steps}/model.safetensors").stat().st_size > 0
    # One srun step per cell, on that cell's own two nodes; task 0 of each ran the cellrunner.
    by_name = steps_of(slurm_env, job)
    for i in range(4):
        assert by_name[f"gyre-cell{i}"][0] == f"n[{2 * i + 1}-{2 * i + 2}]", by_name
        cell_log = (run_dir / f"logs/cell{i}.log").read_text()
        assert f"task 0 on n{2 * i + 1} of step {job}." in cell_log
        assert f"task 1 on n{2 * i + 2}" in cell_log
    assert not events(run_dir, "cell_lost")


@pytest.mark.e2e
def test_a_lost_cell_step_and_a_down_node_leave_the_run_going(slurm_env, tmp_path):
    # (sacct cannot tell the steps' ends here: a job that lost a node keeps them as RESIZING.)
    steps = 16  # long enough that both losses land while steps are still to come
    job = sbatch(slurm_env, tmp_path, f"run.steps={steps}", f"run.runs_dir={tmp_path}/runs", *SHORT_RUN)
    try:
        run_dir = run_dir_of(tmp_path / "runs")
        deadline = time.monotonic() + 180
        while not events(run_dir, "step") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert events(run_dir, "step"), "the run never applied a step"
        # Cell 2: its step is cancelled. Cell 3: one of its nodes goes DOWN.
        step_ids = {name: sid for sid, name in (line.split() for line in slurm(
            slurm_env, "squeue", "-s", "-h", "-j", job, "-o", "%i %j").splitlines())}
        slurm(slurm_env, "scancel", step_ids["gyre-cell2"])
        slurm(slurm_env, "scontrol", "update", "NodeName=n8", "State=DOWN", "Reason=gyre-test")
        state, code = wait_job(slurm_env, job, timeout_s=240)
    finally:
        subprocess.run(["scontrol", "update", "NodeName=n8", "State=RESUME"], env=slurm_env, capture_output=True,
                       timeout=30)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert (state, code) == ("COMPLETED", "0:0"), log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    lost = {e["cell"]: e for e in events(run_dir, "cell_lost")}
    assert set(lost) == {2, 3}, lost
    assert all("exited with" in e["why"] for e in lost.values())
    # The run went on: steps were applied after both cells were gone.
    last_loss = max(e["t"] for e in lost.values())
    assert any(e["t"] > last_loss for e in events(run_dir, "step"))
    ctl_log = (run_dir / "controller.log").read_text()
    assert "cell 2 exited with" in ctl_log and "cell 3 exited with" in ctl_log


def gyre(env: dict, *overrides: str, timeout: float = 240) -> subprocess.CompletedProcess:
    # `launcher=submitit` once conf/config.yaml lists the launcher group; `+launcher=` until then.
    has_default = "launcher:" in (ROOT / "conf/config.yaml").read_text()
    overrides = tuple(o if has_default or not o.startswith("launcher=") else "+" + o for o in overrides)
    return subprocess.run([sys.executable, "-m", "controller.main", *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.e2e
def test_submitit_launcher_runs_a_short_job(slurm_env, tmp_path):
    folder = f"launcher.folder={tmp_path}/submitit/%j"
    out = gyre(slurm_env, "launcher=submitit", folder, "cluster=slurm", "cluster.host=127.0.0.1",
               "cluster.num_cells=2", "run.steps=2", f"run.runs_dir={tmp_path}/runs", *SHORT_RUN)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gyre: submitted Slurm job" in out.stdout and "done: 2 steps" in out.stdout
    summary = json.loads((run_dir_of(tmp_path / "runs") / "summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["cells"]) == 2

    # A job whose run fails: the error shows the job's own log (here: an address no node has).
    bad = gyre(slurm_env, "launcher=submitit", folder, "cluster=slurm", "cluster.host=192.0.2.1",
               "cluster.num_cells=2", f"run.runs_dir={tmp_path}/runs-bad", *SHORT_RUN)
    assert bad.returncode == 1
    assert "failed" in bad.stderr and "last lines of" in bad.stderr
    assert "192.0.2.1" in bad.stderr  # the bind error, read back from the job's log

    refused = gyre(slurm_env, "launcher=submitit", folder, "cluster.num_cells=2")
    assert refused.returncode == 2 and "add cluster=slurm" in refused.stderr


@pytest.mark.e2e
def test_requeued_job_resumes_from_its_checkpoint(slurm_env, tmp_path):
    """`scontrol requeue` mid-run: the job starts again with the same id, finds runs/slurm-<id>/, and
    the core resumes from its newest checkpoint instead of step 0."""
    steps = 8
    runs = tmp_path / "runs"
    job = sbatch(slurm_env, tmp_path, f"run.steps={steps}", f"run.runs_dir={runs}", "run.checkpoint_every=1",
                 "run.eval_at_end=false", *SHORT_RUN)
    run_dir = run_dir_of(runs)
    assert run_dir.name == f"slurm-{job}"
    deadline = time.monotonic() + 180
    while not any(e["weight_version"] >= 2 for e in events(run_dir, "step")):
        assert time.monotonic() < deadline, "no step 2 within 180 s"
        time.sleep(0.2)
    slurm(slurm_env, "scontrol", "requeue", job)
    # A requeued job waits ~2 min in PENDING (BeginTime) on this Slurm; start it now.
    deadline = time.monotonic() + 60
    while "BeginTime" not in slurm(slurm_env, "squeue", "-h", "-j", job, "-o", "%r"):
        assert time.monotonic() < deadline, "the job did not go back to PENDING"
        time.sleep(0.5)
    slurm(slurm_env, "scontrol", "update", f"JobId={job}", "StartTime=now")
    state, code = wait_job(slurm_env, job, timeout_s=300)
    assert (state, code) == ("COMPLETED", "0:0"), (tmp_path / f"slurm-{job}.out").read_text()[-3000:]
    resumed = [e["weight_version"] for e in events(run_dir, "resumed")]
    assert len(resumed) == 1 and 2 <= resumed[0] < steps, resumed
    versions = [e["weight_version"] for e in events(run_dir, "step")]
    assert versions[-1] == steps and set(range(1, steps + 1)) <= set(versions)
    assert (run_dir / "processor.1").is_dir() and (run_dir / f"checkpoints/v{steps}/model.safetensors").is_file()


@pytest.mark.e2e
def test_megatron_cells_run_their_ranks_across_nodes(slurm_env, tmp_path):
    """2 cells x 2 nodes x 2 ranks per node: each cell is a 4-rank Megatron layout (TP=2, DP=2)
    spread over two virtual nodes, rank 0 leading; every step's srun tasks take their ranks
    from Slurm, the core's ranks checkpoint together, and both steps end COMPLETED."""
    env = {**slurm_env, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests/support/megatron_cpu'}",
           "GYRE_TEST_MEGATRON_CPU_SHIMS": "1"}  # megatron-core's CPU shims in every rank (test support)
    steps = 3
    job = slurm(env, "sbatch", "--parsable", "--nodes=4", "--ntasks-per-node=2", f"--output={tmp_path}/slurm-%j.out",
                f"--chdir={ROOT}", str(ROOT / "slurm/gyre_local.sbatch"), f"run.runs_dir={tmp_path}/runs",
                f"run.steps={steps}", "cluster.num_cells=2", "cluster.ranks_per_node=2", "trainer=megatron",
                "trainer.tensor_model_parallel_size=2", "trainer.params_dtype=float32",
                "trainer.offload_when_serving=false", "algo.tree_packing=false", "run.eval_at_start=false",
                "run.eval_at_end=false", "scheduler=colocate", *SHORT_RUN,
                "workload.groups_per_step=4").strip().split(";")[0]
    state, code = wait_job(slurm_env, job, timeout_s=300)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert (state, code) == ("COMPLETED", "0:0"), log[-3000:]
    run_dir = run_dir_of(tmp_path / "runs")
    versions = [e["weight_version"] for e in events(run_dir, "step")]
    assert versions == list(range(1, steps + 1))
    # colocate: the satellite turns to training with the core (elastic would leave that to the
    # load) and loads the step's version from the core. Whether it then gets one of a step's 4 shards
    # before the core has taken them all is a race (CI once saw the core take all 12), so what is
    # asserted is the switch; a satellite's microsteps are checked where they are deterministic
    # (tests/cellrunner/test_megatron_trainer.py::test_core_plus_satellite_is_one_replica).
    to_train = [e for e in events(run_dir, "switch") if e["cell"] == 1 and e["role"] == "train"]
    assert to_train, events(run_dir, "switch")
    assert all(set(e["trainers"]) <= {0, 1} and 0 in e["trainers"] for e in events(run_dir, "step"))
    by_name = steps_of(slurm_env, job)
    for cell, nodes in ((0, ("n1", "n2")), (1, ("n3", "n4"))):
        assert by_name[f"gyre-cell{cell}"] == (f"n[{nodes[0][1]}-{nodes[1][1]}]", "COMPLETED"), by_name
        cell_log = (run_dir / f"logs/cell{cell}.log").read_text()
        for rank in range(4):
            node = nodes[rank // 2]
            assert f"task {rank} on {node} of step {job}." in cell_log and f"runs rank {rank} of 4" in cell_log
            assert f"cell {cell}: rank {rank} done" in cell_log
        assert f"cell {cell}: rank 3 of 4 (node 1, local rank 1) follows rank 0" in cell_log
        if cell == 1:  # each satellite rank loaded its peer's shard of the core, across nodes
            for rank in range(4):
                assert re.search(f"rank {rank}: started on version \\d+ from the core's rank {rank} ", cell_log)
    shards = sorted(p.name for p in (run_dir / f"checkpoints/v{steps}").iterdir())
    assert shards == ["checkpoint.json", "gyre_megatron.json", "tp00_pp00_ep00.safetensors",
                      "tp01_pp00_ep00.safetensors"]
