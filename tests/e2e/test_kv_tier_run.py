"""A whole embedded run with the shared KV tier on: the controller starts a Mooncake Store with the
attempt, every cell connects, draining cells write their cached KV there, and the run ends cleanly
(the store and its clients shut down inside the controller's grace)."""

from __future__ import annotations

import pytest

from tests.e2e import run_gyre_with


def _nothing(_run_dir, done, _report) -> None:
    done.wait()


@pytest.mark.e2e
def test_a_run_on_the_shared_kv_tier_writes_pages_as_cells_drain(tmp_path):
    # 16-id pages: the bundled harness's prompts are a few hundred ids
    run_dir, _ = run_gyre_with(tmp_path / "runs", _nothing, "run.steps=3", "engine.kv_tier.enabled=true",
                               "engine.kv_tier.page_tokens=16")
    assert "kv tier: Mooncake Store at" in (run_dir / "controller.log").read_text()
    cells = [(run_dir / "logs" / f"cell{i}.log").read_text() for i in range(4)]
    assert sum("KV pages to the shared tier" in log for log in cells) >= 1
    assert all("Successfully created client" in log for log in cells)  # every cell on the store
