"""bench.elastic in its quick mode runs the real embedded system three times (elastic, async,
colocate; a couple of minutes), each losing satellite 3 once the first update is applied, then
bench.simulate calibrates against the result, replaying the loss: the keys its docstring
promises are present and well-formed (timings are never judged)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import elastic, simulate
from tests.bench.test_bench_elastic_simulate import finite, last_json


@pytest.mark.e2e
def test_elastic_quick_then_calibrate(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    result = tmp_path / "result.json"
    # run release, so every policy's real run takes executions' data as they are graded
    out = last_json(capsys, elastic.main, ["--quick", "--release", "run", "--runs-dir", str(tmp_path / "runs"),
                                           "--out", str(result), "--lose-cell", "3@1"])
    assert "algo.release=run" in out["config"]["overrides"]
    assert out["config"]["lose_cell"] == {"cell": 3, "at_version": 1}
    for policy, r in out["policies"].items():  # every run lost cell 3 and finished on the other three
        assert [c["cell"] for c in r["cells_lost"]] == [3] and r["cells_lost"][0]["at_version"] >= 1, policy
    assert {"elastic_vs_async", "elastic_vs_colocate", "elastic_s", "async_s", "colocate_s", "staleness_ok",
            "calibration", "config", "host"} <= set(out)
    assert finite(out["elastic_vs_async"]) and finite(out["elastic_vs_colocate"])
    # --quick runs no extra async splits nor the synchronous colocate: the best ones are the only ones
    assert out["best_async"] == "async" and out["elastic_vs_best_async"] == out["elastic_vs_async"]
    assert out["best_colocate"] == "colocate" and out["elastic_vs_colocate"] == out["elastic_vs_colocate_staleness_1"]
    assert out["calibration_error"] is None and "--fit" in out["prediction"]["reason"]
    assert finite(out["calibration"]["first_call_s_median"])
    assert finite(out["calibration"]["grade_s"])  # measured from the 'group' events, not assumed
    # checked on every real CallRecord of the three runs
    assert out["staleness_ok"] is True, {p: (r["max_staleness_seen"], r["engine_calls"], r["executions_timed_out"],
                                             r["stale_examples"]) for p, r in out["policies"].items()}
    for policy in ("elastic", "async", "colocate"):
        assert out["policies"][policy]["num_calls"] > 0
    cal = last_json(capsys, simulate.main, ["--quick", "--calibrate", str(result)])["calibration"]
    assert finite(cal["error"]) and set(cal["predicted"]) == {"elastic_vs_best_async", "elastic_vs_colocate"}
    assert cal["in_sample"] is True and cal["bound_s"] <= min(cal["predicted_s"].values())
    assert all(cal["ceiling"][k] >= cal["predicted"][k] - 1e-9 for k in cal["predicted"])
    assert cal["release"] == "run"  # simulated as it ran
    assert set(cal["own_microstep_s"]) == {"elastic", "async", "colocate"} and finite(cal["error_own"])
