"""``bench.transfer`` and ``bench.switch`` run with ``--quick`` and print one JSON object last, with
the keys their docstrings promise. Timings are never judged, only present and well-formed; what
is judged is what must hold at any speed: the bytes pulled are the published ones (the bench
exits otherwise), and every switch asked for was made, with each transfer, by real cellrunners."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from bench import switch, transfer
from tests.bench import last_json as bench_json


def last_json(capsys: pytest.CaptureFixture[str], main: Callable[[list[str]], object], argv: list[str]) -> dict:
    out = bench_json(capsys, main, argv)
    assert {"config", "host", "versions"} <= set(out)
    return out


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_transfer_quick(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_LOG_LEVEL", "WARNING")  # the bench would set it for good otherwise
    out = last_json(capsys, transfer.main, ["--quick", "--chunk-mib", "1"])
    assert {"gb_per_s", "fraction_of_zmq", "zmq_gb_per_s", "bytes", "fraction_of_pull_weights", "zmq_method"} <= set(out)
    assert all(positive(out[k]) for k in ("gb_per_s", "fraction_of_zmq", "zmq_gb_per_s", "fraction_of_pull_weights"))
    assert out["bytes"] == 4 * out["config"]["num_params"] > 0
    methods = set(out["median_s"])
    assert {"zmq", "zmq_nocopy", "mooncake@1MiB", "mooncake@16MiB", "mooncake_sync@16MiB"} <= methods
    assert out["zmq_method"].startswith("zmq") and out["zmq_method"] in methods
    assert all(len(t) == out["config"]["repeats"] == 2 for t in out["times_s"].values())
    assert out["versions"]["mooncake-transfer-engine"].startswith("mooncake-transfer-engine")


def test_switch_quick_with_both_transfers(capsys: pytest.CaptureFixture[str]) -> None:
    out = last_json(capsys, switch.main, ["--quick", "--transfer", "both"])
    assert {"to_train_s", "to_serve_s", "n_switches", "by_transfer"} <= set(out)
    assert set(out["by_transfer"]) == {"zmq", "mooncake"}
    for result in out["by_transfer"].values():
        assert result["n_switches"] == 2 * 2 * 2  # cells x cycles x (to train, to serve)
        assert math.isfinite(result["to_train_s"]) and math.isfinite(result["to_serve_s"])
        # satellites pulled weights on every switch; the core never does
        assert result["to_train_s_satellites_phases"]["pull"] > 0
        assert {"drain", "release", "pull", "start_trainer"} <= set(result["to_train_s_core_phases"])
    assert out["to_train_s"] == out["by_transfer"][out["config"]["transfer"]]["to_train_s"]
