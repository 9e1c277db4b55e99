"""bench.kv_reuse at small sizes: the real Claude Code started as gyre starts it, at host paths and
at fixed paths; the group's prefill on engines before and after; a redirect with and without the
shared tier. Token counts are exact, so they are judged; times are not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

from base.tokenizer import get_tokenizer
from bench import kv_redirect, kv_reuse
from cellrunner.config import ModelConfig
from cellrunner.model import build_model, flatten_params
from tests.cellrunner.test_kv_tier import _require_store

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny() -> tuple[ModelConfig, object, object]:
    model_cfg = ModelConfig(**yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text()))
    tok = get_tokenizer(model_cfg.tokenizer, model_cfg.compact_ranks)
    return model_cfg, tok, flatten_params(build_model(model_cfg, tok.vocab_size), 0)


def test_a_group_at_fixed_paths_shares_its_whole_first_prompt_and_computes_it_once(tmp_path, tiny):
    if not os.access(kv_reuse.CLAUDE_BIN, os.X_OK) and os.environ.get("CI") != "true":
        pytest.skip("make claude-code installs the binary this runs")
    model_cfg, tok, weights = tiny
    before = [kv_reuse.render(r, tok, billing_line=True)
              for r in kv_reuse.first_calls(2, fixed_paths=False, work=tmp_path / "before")]
    after = [kv_reuse.render(r, tok, billing_line=False)
             for r in kv_reuse.first_calls(2, fixed_paths=True, work=tmp_path / "after")]
    assert after[0] == after[1] and len(after[0]) > 10_000  # one prompt: nothing of the execution in it
    assert kv_reuse.shared_by_all(before) < 3_000  # they parted where each named its own paths
    torch.set_num_threads(1)
    out = kv_reuse.group_prefill(before, after, 2, model_cfg, tok.vocab_size, weights)
    # computed once; the other call, on the same engine, runs only its last token for its logits
    assert out["group_prefill_tokens_after"] == len(after[0]) + 1
    assert out["group_prefill_tokens_before"] >= 2 * len(before[0]) - 3_000
    assert out["outputs_checked"] == 1


def test_a_redirected_session_recomputes_only_its_last_page_and_new_turn(tiny, monkeypatch):
    _require_store()
    model_cfg, tok, weights = tiny
    monkeypatch.setattr(kv_redirect, "SIZES", {"3k": 3_000})
    first = [(7 * i) % 1000 for i in range(2_000)]
    out = kv_redirect.redirect_figures(model_cfg, tok, weights, first=first)
    run = out["redirect_3k"]
    assert run["without_tier"]["prefilled_ids"] == run["without_tier"]["prompt_ids"]
    assert run["with_tier"]["tier_ids"] == 3_000 // 256 * 256  # the whole pages A ran
    assert run["with_tier"]["prefilled_ids"] == run["with_tier"]["prompt_ids"] - run["with_tier"]["tier_ids"]
    assert out["redirect_recomputed_fraction_3k"] < 0.5 and out["redirect_recomputed_fraction_3k_without_tier"] == 1.0
