"""One short live soak of the real embedded default (bench.soak) with kills every few seconds:
the invariants it checks must hold."""

from __future__ import annotations

import pytest

from bench import soak


@pytest.mark.e2e
def test_a_short_soak_holds_its_invariants(tmp_path):
    out = soak.main(["--minutes", "1.0", "--kill-every", "6,10", "--seed", "3", "--runs-dir", str(tmp_path)])
    assert out["kills"] >= 4, out
    assert out["last_attempt_rc"] == 0 and out["final_version"] >= 2, out
    assert out["versions_applied_once"] is True, out
    assert out["records_lost"] == 0 and out["answered_calls"] > 0, out
    assert out["shards_trained_twice"] == 0, out
    assert isinstance(out["eval_reward_end"], float), out
    assert out["recovery_s"] and all(0 < r["median"] <= r["max"] for r in out["recovery_s"].values()), out
    assert out["train_reward_by_5min"] and out["core_kills_resumed"]["not_resumed"] == 0, out
    assert soak.report(tmp_path)["final_version"] == out["final_version"]  # the same figures from the kept folder
