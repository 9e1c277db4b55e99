"""A real run on a local Hugging Face checkpoint: ``gyre model=qwen3_hf model.path=<folder>``.

The folder is a 2-layer Qwen3-MoE with the full 151,936-row vocabulary and Qwen3's tokenizer.json
(``cellrunner.make_checkpoint``). Two cells, one step, rollouts at temperature 0.7. Checked from the
run's own records: every cell started version 0 from the same weights and those are the
checkpoint's (the digests in metrics.jsonl); the engines' behaviour log-probs of version-0 calls
equal ``transformers``' forward of the checkpoint at that temperature; the calls were sampled at
the run's temperature; the step trained.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from cellrunner.make_checkpoint import write_checkpoint
from cellrunner.model import flatten_params, weights_digest
from tests.e2e import call_records, metrics, run_gyre_with

TEMPERATURE = 0.7


@pytest.mark.e2e
def test_a_run_starts_every_cell_from_the_checkpoint(tmp_path):
    folder = write_checkpoint(tmp_path / "qwen3-moe-tiny", moe=True)
    run_dir, _ = run_gyre_with(
        tmp_path / "runs", lambda *_: None, "model=qwen3_hf", f"model.path={folder}", "cluster.num_cells=2",
        "run.steps=1", "run.eval_at_start=false", "run.eval_at_end=false",
        f"algo.rollout.temperature={TEMPERATURE}", timeout_s=420,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1

    reference = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    want_digest = weights_digest(flatten_params(reference, 0))
    ready = metrics(run_dir, "cell_ready")
    assert sorted(e["cell"] for e in ready) == [0, 1]
    assert {e["weights_digest"] for e in ready if e["weight_version"] == 0} == {want_digest}

    records = [r for r in call_records(run_dir) if r.weight_version == 0 and r.output_ids]
    assert records and {r.cell_id for r in records} <= {0, 1}
    assert all(r.temperature == TEMPERATURE for r in records)
    for r in records[:6]:
        with torch.inference_mode():
            logits = reference(input_ids=torch.tensor([r.prompt_ids + r.output_ids])).logits[0].float()
        logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
        n = len(r.prompt_ids)
        want = logp[n - 1 : n - 1 + len(r.output_ids)].gather(1, torch.tensor(r.output_ids)[:, None])[:, 0]
        np.testing.assert_allclose(r.output_logprobs, want.numpy(), atol=1e-4, rtol=0)
    (step,) = metrics(run_dir, "step")
    assert step["weight_version"] == 1 and step["num_tokens"] > 0 and step["grad_norm"] > 0
