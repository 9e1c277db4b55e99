"""bench.elastic and bench.simulate in their quick modes: they run, and print one JSON object last
with the keys their docstrings promise. Values are not judged (timings never are), only present
and well-formed; bench.elastic runs the real embedded system three times (a couple of minutes)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import elastic, simulate


def last_json(capsys: pytest.CaptureFixture[str], main: Callable[[list[str]], object], argv: list[str]) -> dict:
    main(argv)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert isinstance(out, dict)
    return out


def finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_simulate_quick_without_a_measurement(capsys: pytest.CaptureFixture[str]):
    out = last_json(capsys, simulate.main, ["--quick"])
    assert {"p2_4t_vs_async", "p2_4t_vs_colocate", "calibration_error", "table", "host", "versions"} <= set(out)
    assert finite(out["p2_4t_vs_async"]) and finite(out["p2_4t_vs_colocate"])
    # Never invented: no result file, no calibration error, and the reason says so.
    assert out["calibration_error"] is None and "no bench.elastic result file" in out["calibration"]["reason"]
    assert {r["trace"] for r in out["table"]} == {"p2_4t", "nl2repo_122b", "deepswe_122b", "terminalbench_122b"}
    for row in out["table"]:
        assert set(row["hours"]) == {"elastic", "async", "colocate"} and all(finite(h) for h in row["hours"].values())
        assert all(v <= 1 for v in row["max_staleness"].values())  # every trace has staleness 1
        # every fixed split was run, the trace's own among them, and the best one is reported
        assert set(row["vs_async_splits"]) == {str(k) for k in range(1, row["cells"])}
        assert row["vs_async_splits"][str(row["async_train_cells"])] == row["vs_async"]
        assert row["vs_best_async"] == min(row["vs_async_splits"].values())


def test_simulate_refuses_a_file_that_is_not_a_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    bad = tmp_path / "result.json"
    bad.write_text(json.dumps({"elastic_vs_async": 1.2}))
    out = last_json(capsys, simulate.main, ["--quick", "--calibrate", str(bad)])
    assert out["calibration_error"] is None and "not a bench.elastic result file" in out["calibration"]["reason"]


def test_elastic_quick_then_calibrate(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    result = tmp_path / "result.json"
    out = last_json(capsys, elastic.main, ["--quick", "--runs-dir", str(tmp_path / "runs"), "--out", str(result)])
    assert {"elastic_vs_async", "elastic_vs_colocate", "elastic_s", "async_s", "colocate_s", "staleness_ok",
            "calibration", "config", "host"} <= set(out)
    assert finite(out["elastic_vs_async"]) and finite(out["elastic_vs_colocate"])
    # --quick runs no extra async splits: the best one is the only one
    assert out["best_async"] == "async" and out["elastic_vs_best_async"] == out["elastic_vs_async"]
    assert finite(out["calibration"]["first_call_s_median"])
    assert out["staleness_ok"] is True  # checked on every real CallRecord of the three runs
    for policy in ("elastic", "async", "colocate"):
        assert out["policies"][policy]["num_calls"] > 0
    cal = last_json(capsys, simulate.main, ["--quick", "--calibrate", str(result)])["calibration"]
    if cal["error"] is None:  # the controller does not log microstep times yet: said, not invented
        assert "not measured" in cal["reason"]
    else:
        assert finite(cal["error"]) and set(cal["predicted"]) == {"elastic_vs_async", "elastic_vs_colocate"}
