"""The launch path at the 2.4T recipe's scale, on a local Slurm of 192 virtual nodes with names of
22 characters (gyre-compute-node-0001..0192; conftest.long_slurm_env).

1. The recipe's launch shape: a 192-node job, 4 cells of 48 nodes, each cell one srun step made by
   ``SlurmCells.launch`` (controller/slurm_launch.py), every task a rank (multi-rank, as with the
   recipe's Megatron stack). Every one of the 192 ranks must start on its own node with its rank
   variables and its own config copy. The embedded stack (393 MB a rank for its imports alone) cannot run 192
   times in 24 GiB, so the process each rank execs is a light stand-in (tests/slurm/rank_standin.py);
   srun, the step end and the per-rank config copies are real. Before the copies were named by a
   hash, 48 joined names (~1100 bytes) made each rank's file name too long and every step failed.
2. The embedded stack with the same long names at a smaller count: 2 cells of 2 nodes reach
   "cells up" and train 2 steps (test_sbatch_run.py runs it at length on n1..n8).
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controller.slurm_launch import cell_nodes_tag
from tests.slurm.conftest import LONG_NODES, LONG_PREFIX, long_node
from tests.slurm.test_sbatch_run import SHORT_RUN, run_dir_of

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "slurm" / "gyre_2p4t.sbatch"
# Header flags this cluster cannot take: it has no GPUs (no gres), one partition, and the test
# sets its own output file and no time limit.
NOT_HERE = ("--gpus-per-node", "--partition", "--time", "--output")


def recipe_shape() -> tuple[list[str], int]:
    """The recipe's own #SBATCH flags (minus NOT_HERE) and its cluster.num_cells."""
    text = RECIPE.read_text()
    flags = [line.split()[1] for line in text.splitlines() if line.startswith("#SBATCH ")]
    cells = re.findall(r"cluster\.num_cells=(\d+)", text)
    assert len(cells) == 1, cells
    return [f for f in flags if not f.startswith(NOT_HERE)], int(cells[0])


def sbatch_wait(env: dict, *argv: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run(["sbatch", "--wait", "--parsable", f"--chdir={ROOT}", *argv], env=env, capture_output=True,
                         text=True, timeout=timeout)
    return out, time.monotonic() - t0


@pytest.mark.e2e
def test_the_2p4t_launch_shape_starts_every_rank_on_192_nodes(long_slurm_env, tmp_path):
    flags, num_cells = recipe_shape()
    assert f"--nodes={LONG_NODES}" in flags and num_cells == 4, (flags, num_cells)
    per_cell = LONG_NODES // num_cells
    out_dir = tmp_path / "launch"
    env = {**long_slurm_env, "GYRE_REAL_PYTHON": sys.executable}
    done, seconds = sbatch_wait(env, *flags, f"--output={tmp_path}/slurm-%j.out", "--wrap",
                                f"exec tests/slurm/rank_python -m tests.slurm.launch_shape {out_dir} "
                                f"--num-cells {num_cells} --ranks-per-node 1", timeout=400)
    job = done.stdout.strip().split(";")[0]
    job_log = next(tmp_path.glob("slurm-*.out")).read_text() if list(tmp_path.glob("slurm-*.out")) else ""
    cell_logs = {c: (out_dir / f"logs/cell{c}.log") for c in range(num_cells)}
    tails = "\n".join(p.read_text()[-1500:] for p in cell_logs.values() if p.exists())
    assert done.returncode == 0, f"{done.stderr}\n{job_log}\n{tails}"
    launch = json.loads((out_dir / "launch.json").read_text())
    expected = [[long_node(c * per_cell + i + 1) for i in range(per_cell)] for c in range(num_cells)]
    assert launch["cells"] == expected and launch["exit_codes"] == [0] * num_cells
    assert all(len(n) >= 20 for n in sum(expected, []))

    steps = set()
    for c, nodes in enumerate(expected):
        log = cell_logs[c].read_text()
        tag = cell_nodes_tag(",".join(nodes))
        step_nodelist = f"{LONG_PREFIX}[{c * per_cell + 1:04d}-{(c + 1) * per_cell:04d}]"
        for rank, node in enumerate(nodes):
            report = json.loads((out_dir / "ranks" / f"cell{c}.r{rank}.json").read_text())
            assert (report["node"], report["rank"], report["world_size"], report["node_rank"], report["nnodes"],
                    report["local_rank"]) == (node, rank, per_cell, rank, per_cell, 0), report
            assert (report["master_addr"], report["master_port"]) == ("127.0.0.1", str(29500 + c)), report
            assert report["step_nodelist"] == step_nodelist and report["step"].startswith(f"{job}."), report
            # Each rank read its own copy, named by the hash of the cell's nodes, with its node's address.
            copy = Path(report["config"])
            assert copy.name == f"cellrunner.{tag}.r{rank}.json" and copy.is_file(), report
            assert report["host"] == json.loads(copy.read_text())["host"] == "127.0.0.1"
            assert f"task {rank} on {node} of step {report['step']} (nodes {step_nodelist}) runs rank {rank} of " \
                   f"{per_cell} of the cell" in log
            steps.add((c, report["step"]))
    # One srun step per cell: every rank of a cell in the same step, 4 steps in all.
    assert len(steps) == num_cells and len({s for _, s in steps}) == num_cells, steps
    assert len(list((out_dir / "ranks").glob("*.json"))) == LONG_NODES
    print(f"\nlaunch shape: {LONG_NODES} nodes, {num_cells} srun steps, {LONG_NODES} ranks started; "
          f"sbatch --wait {seconds:.1f} s, steps {launch['seconds']} s")


@pytest.mark.e2e
def test_long_node_names_embedded_cells_train_two_steps(long_slurm_env, tmp_path):
    runs = tmp_path / "runs"
    done, seconds = sbatch_wait(
        long_slurm_env, "--nodes=4", f"--output={tmp_path}/slurm-%j.out", str(ROOT / "slurm/gyre_local.sbatch"),
        f"run.runs_dir={runs}", "run.steps=2", "cluster.num_cells=2", "cluster.host=auto", "run.eval_at_start=false",
        "run.eval_at_end=false", *SHORT_RUN, timeout=400)
    job = done.stdout.strip().split(";")[0]
    job_log = (tmp_path / f"slurm-{job}.out").read_text() if job else ""
    assert done.returncode == 0, f"{done.stderr}\n{job_log[-3000:]}"
    run_dir = run_dir_of(runs)
    assert "gyre: 2 cells up" in (run_dir / "controller.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["cells"]) == 2
    for c, nodes in enumerate(([long_node(1), long_node(2)], [long_node(3), long_node(4)])):
        cell_log = (run_dir / f"logs/cell{c}.log").read_text()
        step_nodelist = f"{LONG_PREFIX}[{2 * c + 1:04d}-{2 * c + 2:04d}]"
        assert f"task 0 on {nodes[0]} of step {job}." in cell_log and f"(nodes {step_nodelist})" in cell_log
        assert f"task 1 on {nodes[1]}" in cell_log
        copy = run_dir / f"cellrunner.{cell_nodes_tag(','.join(nodes))}.r0.json"
        assert json.loads(copy.read_text())["host"] == "127.0.0.1"
    print(f"\nlong names, embedded: 2 cells x 2 nodes, 2 steps; sbatch --wait {seconds:.1f} s")


def test_a_bad_cluster_knob_is_refused_in_one_line():
    for knob, value in (("SLURM_LOCAL_NODES", "0"), ("SLURM_LOCAL_NODE_PREFIX", "gyre node"),
                        ("SLURM_LOCAL_PORT_OFFSET", "-5"), ("SLURM_LOCAL_MSG_TIMEOUT", "0")):
        out = subprocess.run(["bash", str(ROOT / "slurm/local-cluster.sh"), "status"], capture_output=True, text=True,
                             timeout=30, env={"PATH": "/usr/bin:/bin", knob: value})
        assert out.returncode == 2 and out.stderr.startswith(f"local-cluster: {knob}={value}: want "), out.stderr
