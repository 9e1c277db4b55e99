"""A run stopped after its checkpoint and started again with the same run id resumes there.

This is what a requeued Slurm job does (the sbatch scripts pass the job id as ``run.run_id``):
the first attempt trains 3 steps with a checkpoint after each; the second asks for 5 in the same
folder, so the core loads version 3 (weights and AdamW state), the satellites pull it, and only
steps 3 and 4 are trained — from fresh rollouts, with a fresh processor log.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def gyre(runs: Path, steps: int) -> subprocess.CompletedProcess:
    argv = [
        sys.executable, "-m", "controller.main", f"run.steps={steps}", f"run.runs_dir={runs}", "run.run_id=job-42",
        "run.checkpoint_every=1", "workload.groups_per_step=2", "workload.group_size=4",
        "workload.min_usable_per_group=2", "workload.num_eval_tasks=4", "run.eval_at_end=false",
        "run.progress_every_s=5",
    ]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


@pytest.mark.e2e
def test_second_attempt_resumes_from_the_checkpoint(tmp_path):
    runs = tmp_path / "runs"
    first = gyre(runs, 3)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = runs / "job-42"
    assert [e["weight_version"] for e in events(run_dir, "step")] == [1, 2, 3]
    for v in (1, 2, 3):
        assert (run_dir / f"checkpoints/v{v}/optimizer.safetensors").is_file()
    evals_before = len(events(run_dir, "eval"))

    second = gyre(runs, 5)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert [e["weight_version"] for e in events(run_dir, "resumed")] == [3]
    assert [e["weight_version"] for e in events(run_dir, "step")] == [1, 2, 3, 4, 5]  # 4 and 5 are new
    assert len(events(run_dir, "eval")) == evals_before  # no second start eval
    assert (run_dir / "checkpoints/v5/model.safetensors").is_file()
    assert (run_dir / "processor").is_dir() and (run_dir / "processor.1").is_dir()
    assert "resuming at step 3" in (run_dir / "controller.log").read_text()
