"""The node list -> cells split, the srun command, the launcher config and the sbatch scripts.

Pure parts are checked directly; the parts that talk to Slurm (`scontrol show hostnames`,
`sbatch --test-only`, a step's membership check under a real `srun`) run on the local cluster.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from controller import slurm_launch
from controller.processes import StartError
from base.ranks import ranks_from_env
from controller.slurm_launch import SlurmCells, rank_env_of_task, split_cells, srun_argv
from controller.submit import LocalLauncherConfig, SubmititLauncherConfig, build_launcher, job_overrides
from base.typed_config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def names(n: int, prefix: str = "gpu") -> list[str]:
    return [f"{prefix}{i:03d}" for i in range(n)]


def test_split_gives_equal_groups_of_consecutive_nodes():
    assert split_cells([f"n{i}" for i in range(1, 9)], 4) == [["n1", "n2"], ["n3", "n4"], ["n5", "n6"], ["n7", "n8"]]
    cells = split_cells(names(192), 4)  # the 2.4T recipe
    assert [len(c) for c in cells] == [48] * 4
    assert cells[0][0] == "gpu000" and cells[3][-1] == "gpu191"
    assert sum(cells, []) == names(192)


def test_split_leaves_the_remainder_idle_and_refuses_too_few_nodes():
    cells = split_cells(names(30), 4)  # gyre_122b.sbatch may get any of 24..32 nodes
    assert [len(c) for c in cells] == [7] * 4 and sum(cells, []) == names(28)
    with pytest.raises(ValueError, match="cannot hold 4 cells"):
        split_cells(names(3), 4)


def test_srun_command_holds_exactly_the_cells_nodes():
    argv = srun_argv(job_id="42", cell_id=2, nodes=["n5", "n6"], python="/py", cell_args=["--cell-id", "2"],
                     extra_args=["--container-image=x.sqsh"])
    assert argv[0] == "srun"
    for flag in ("--jobid=42", "--job-name=gyre-cell2", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                 "--nodelist=n5,n6", "--overlap", "--kill-on-bad-exit=1"):
        assert flag in argv, flag
    assert "--exact" not in argv  # a cell gets every CPU/GPU of its nodes
    py = argv.index("/py")
    assert argv.index("--container-image=x.sqsh") < py  # site flags go to srun, not to Python
    assert argv[py:] == ["/py", "-m", "controller.slurm_launch", "--cell-nodes", "n5,n6", "--ranks", "1",
                         "--dist-port", "0", "--", "--cell-id", "2"]


def test_a_multi_rank_cell_runs_its_ranks_node_by_node():
    cells = SlurmCells(job_id="9", nodes=("n1", "n2", "n3", "n4"), cells=(("n1", "n2"), ("n3", "n4")),
                       srun_extra_args=(), ranks_per_node=4, multi_rank=True, dist_port=29500)
    assert cells.cell_ranks(1) == 8
    argv = srun_argv(job_id="9", cell_id=1, nodes=["n3", "n4"], python="/py", cell_args=[], extra_args=[],
                     ranks_per_node=4, cell_ranks=cells.cell_ranks(1), dist_port=29501)
    for flag in ("--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--distribution=block"):
        assert flag in argv, flag
    assert argv[argv.index("--ranks"):argv.index("--ranks") + 4] == ["--ranks", "8", "--dist-port", "29501"]
    # an embedded cell is one process whatever the node count
    assert SlurmCells(job_id="9", nodes=cells.nodes, cells=cells.cells, srun_extra_args=()).cell_ranks(1) == 1


def test_each_task_gets_its_rank_from_slurm():
    env = {"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURMD_NODENAME": "n4"}
    got = rank_env_of_task(env, nodes=["n3", "n4"], cell_ranks=8, master_addr="10.1.0.3", dist_port=29501)
    r = ranks_from_env(got)
    assert (r.rank, r.world_size, r.node_rank, r.local_rank, r.nnodes) == (6, 8, 1, 2, 2)
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("10.1.0.3", "29501")
    with pytest.raises(ValueError, match="node by node"):  # a cyclic layout is caught, not misnumbered
        ranks_from_env(rank_env_of_task({**env, "SLURM_LOCALID": "1"}, nodes=["n3", "n4"], cell_ranks=8,
                                        master_addr="x", dist_port=1))
    with pytest.raises(ValueError, match="not one of the cell's nodes"):
        rank_env_of_task({**env, "SLURMD_NODENAME": "n9"}, nodes=["n3", "n4"], cell_ranks=8, master_addr="x",
                         dist_port=1)


def test_outside_an_allocation_is_a_clear_error():
    with pytest.raises(StartError, match="SLURM_JOB_NODELIST"):
        SlurmCells.from_env(4, env={})


def test_an_scontrol_that_does_not_answer_is_a_clear_error(tmp_path, monkeypatch):
    """On a node loaded past answering (1,536 ranks on 2 cores did it), ``scontrol`` times out: one
    line naming it, not a traceback from every rank."""
    stuck = tmp_path / "scontrol"
    stuck.write_text("#!/bin/sh\nexec sleep 60\n")
    stuck.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    real_run = subprocess.run
    monkeypatch.setattr(slurm_launch.subprocess, "run",
                        lambda *a, **kw: real_run(*a, **{**kw, "timeout": 0.5}))  # not 30 s in a test
    with pytest.raises(StartError, match="did not answer"):
        slurm_launch.expand_nodelist("n[1-2]")


def test_cells_from_a_real_node_list(slurm_env, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])  # scontrol reads it
    cells = SlurmCells.from_env(4, env={"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-8]",
                                        "GYRE_SRUN_ARGS": "--mpi=none '--comment=a b'"})
    assert cells.cells == (("n1", "n2"), ("n3", "n4"), ("n5", "n6"), ("n7", "n8"))
    assert cells.srun_extra_args == ("--mpi=none", "--comment=a b")
    with pytest.raises(StartError, match="cannot hold 4 cells"):
        SlurmCells.from_env(4, env={"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]"})


def test_a_step_on_other_nodes_than_its_cell_refuses_to_start(slurm_env):
    """Membership comes from SLURM_STEP_NODELIST: a step placed on n5 that was meant for n6 stops."""
    out = subprocess.run(["srun", "--nodes=1", "--ntasks=1", "--nodelist=n5", sys.executable, "-m",
                          "controller.slurm_launch", "--cell-nodes", "n6", "--", "--cell-id", "0"],
                         cwd=ROOT, env=slurm_env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "this step runs on ['n5'], the cell was given ['n6']" in out.stderr + out.stdout


def test_launcher_config():
    assert build_launcher(None) == LocalLauncherConfig(kind="local")
    assert build_launcher(yaml.safe_load((ROOT / "conf/launcher/local.yaml").read_text())).kind == "local"
    sub = build_launcher(yaml.safe_load((ROOT / "conf/launcher/submitit.yaml").read_text()))
    assert isinstance(sub, SubmititLauncherConfig) and sub.nodes_per_cell == 1 and sub.wait
    with pytest.raises(ConfigError, match="launcher.kind"):
        build_launcher({"kind": "ray"})
    with pytest.raises(ConfigError, match="unknown key"):
        build_launcher({**yaml.safe_load((ROOT / "conf/launcher/submitit.yaml").read_text()), "gpus": 1})


def test_the_job_gets_the_same_overrides_minus_the_launcher():
    got = job_overrides(["cluster=slurm", "+launcher=submitit", "launcher.nodes_per_cell=2", "run.steps=3",
                         "run.runs_dir=runs"], "/abs/runs")
    assert got == ["cluster=slurm", "run.steps=3", "run.runs_dir=/abs/runs"]


def run_script(script: str, *args: str, cwd: Path, in_job: bool = True) -> subprocess.CompletedProcess:
    """The script as the job's first node runs it (``GYRE_PYTHON=echo`` prints the gyre command),
    or, ``in_job=False``, as a user runs it on the login node."""
    env = {**os.environ, "GYRE_PYTHON": "echo", "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "1",
           "SLURM_JOB_NODELIST": "n[1-8]", "SLURM_JOB_NUM_NODES": "8"}
    if not in_job:
        env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    return subprocess.run(["bash", str(ROOT / "slurm" / script), *args], env=env, capture_output=True, text=True,
                          timeout=30, cwd=cwd)


@pytest.mark.parametrize("script,nodes,stack", [
    ("gyre_local.sbatch", "8", []),
    ("gyre_2p4t.sbatch", "192", ["model=qwen3_hf", "engine=sglang", "trainer=megatron", "transfer=mooncake"]),
    ("gyre_122b.sbatch", "24-32", ["model=qwen3_hf", "engine=sglang", "trainer=megatron", "transfer=mooncake"]),
])
def test_sbatch_scripts_pass_overrides_through(script, nodes, stack, tmp_path):
    text = (ROOT / "slurm" / script).read_text()
    assert f"#SBATCH --nodes={nodes}\n" in text
    model = ["model.path=/shared/models/m"] if stack else []
    out = run_script(script, *model, "scheduler=async", "run.steps=7", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    command = out.stdout.strip().splitlines()[-1].split()
    assert command[:2] == ["-m", "controller.main"] and "cluster=slurm" in command
    assert "cluster.num_cells=4" in command
    assert command[-3 if stack else -2:] == [*model, "scheduler=async", "run.steps=7"]
    assert all(s in command for s in stack) and ("engine=sglang" in command) == bool(stack)
    # a cell's servers on its other nodes load each version from a folder every node sees
    assert (f"engine.weight_dir={ROOT}/runs/weights-1" in command) == bool(stack)


@pytest.mark.parametrize("script", ["gyre_2p4t.sbatch", "gyre_122b.sbatch"])
def test_cluster_scripts_want_a_checkpoint_and_say_so_in_one_line(script, tmp_path):
    out = run_script(script, "run.steps=7", cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "model.path=" in out.stderr and "is required" in out.stderr
    # A preset keeps its parallel layout: the script does not add model=qwen3_hf over it.
    command = run_script(script, "model=qwen3_8b", "model.path=/m", cwd=tmp_path).stdout.split()
    assert "model=qwen3_8b" in command and "model=qwen3_hf" not in command
    # Run on the login node, the script checks the folder before it queues a job.
    out = run_script(script, f"model.path={tmp_path}/missing", cwd=tmp_path, in_job=False)
    assert out.returncode == 2 and "has no config.json" in out.stderr


def test_local_sbatch_header_is_accepted_by_slurm(slurm_env):
    out = subprocess.run(["sbatch", "--test-only", str(ROOT / "slurm/gyre_local.sbatch")], cwd=ROOT,
                         env=slurm_env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "to start at" in out.stderr, out.stderr


def test_each_rank_of_a_cell_binds_to_its_own_node(tmp_path, monkeypatch):
    """``host: auto``: every task writes its own copy of the cell's config with its node's address
    (each core rank binds a gradient inbox there); one shared copy would be rewritten by the tasks
    of the cell's other nodes at the same moment."""
    shared = tmp_path / "cellrunner.json"
    shared.write_text(json.dumps({"host": slurm_launch.AUTO_HOST, "cell": 1}))
    monkeypatch.setattr(slurm_launch, "resolve_host", lambda host: "10.0.0.1" if host == slurm_launch.AUTO_HOST else host)
    first = slurm_launch.bind_config_to_node(str(shared), "n3,n4", 0)
    monkeypatch.setattr(slurm_launch, "resolve_host", lambda host: "10.0.0.2" if host == slurm_launch.AUTO_HOST else host)
    second = slurm_launch.bind_config_to_node(str(shared), "n3,n4", 1)
    assert first != second
    assert json.loads(Path(first).read_text()) == {"host": "10.0.0.1", "cell": 1}
    assert json.loads(Path(second).read_text()) == {"host": "10.0.0.2", "cell": 1}
    shared.write_text(json.dumps({"host": "127.0.0.1"}))  # a fixed address: the shared file as it is
    assert slurm_launch.bind_config_to_node(str(shared), "n3,n4", 1) == str(shared)
