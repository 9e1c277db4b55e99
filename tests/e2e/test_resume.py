"""A run stopped after its checkpoint and started again with the same run id resumes there.

This is what a requeued Slurm job does (the sbatch scripts pass the job id as ``run.run_id``):
the first attempt trains 3 steps with a checkpoint after each; the second asks for 5 in the same
folder, so the core loads version 3 (weights and AdamW state), the satellites pull it, and only
steps 3 and 4 are trained — from fresh rollouts, with a fresh processor log.
"""

from pathlib import Path

import pytest

from tests.e2e import metrics, start_gyre


def gyre(runs: Path, steps: int) -> tuple[int, str]:
    proc = start_gyre(runs, f"run.steps={steps}", "run.run_id=job-42", "run.checkpoint_every=1",
                      "run.eval_at_end=false")
    out, _ = proc.communicate(timeout=400)
    return proc.returncode, out


@pytest.mark.e2e
def test_second_attempt_resumes_from_the_checkpoint(tmp_path):
    runs = tmp_path / "runs"
    rc, out = gyre(runs, 3)
    assert rc == 0, out[-3000:]
    run_dir = runs / "job-42"
    assert [e["weight_version"] for e in metrics(run_dir, "step")] == [1, 2, 3]
    for v in (1, 2, 3):
        assert (run_dir / f"checkpoints/v{v}/optimizer.safetensors").is_file()
    evals_before = len(metrics(run_dir, "eval"))

    rc, out = gyre(runs, 5)
    assert rc == 0, out[-3000:]
    assert [e["weight_version"] for e in metrics(run_dir, "resumed")] == [3]
    assert [e["weight_version"] for e in metrics(run_dir, "step")] == [1, 2, 3, 4, 5]  # 4 and 5 are new
    assert len(metrics(run_dir, "eval")) == evals_before  # no second start eval
    assert (run_dir / "checkpoints/v5/model.safetensors").is_file()
    assert (run_dir / "processor").is_dir() and (run_dir / "processor.1").is_dir()
    assert "resuming at step 3" in (run_dir / "controller.log").read_text()
