"""Each benchmark runs with ``--small`` and prints one JSON object as its last line, with the keys
its docstring promises. Values are not judged (timings never are), only present and well-formed."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from bench import processor, trajectory_cap, tree_packing
from tests.bench import last_json as bench_json

COMMON = {"config", "host", "versions"}


def last_json(capsys: pytest.CaptureFixture[str], main: Callable[[list[str]], object], argv: list[str]) -> dict:
    out = bench_json(capsys, main, argv)
    assert {"python", "torch", "transformers"} <= set(out["versions"])
    return out


def finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_trajectory_cap(capsys: pytest.CaptureFixture[str]) -> None:
    out = last_json(capsys, trajectory_cap.main, ["--small"])
    assert COMMON | {"fb_time_reduction", "grad_cosine", "tokens_k5", "tokens_nocap", "flops_reduction"} <= set(out)
    assert finite(out["fb_time_reduction"]) and -1.0001 <= out["grad_cosine"] <= 1.0001
    assert out["tokens_k5"] <= out["tokens_nocap"]


def test_tree_packing(capsys: pytest.CaptureFixture[str]) -> None:
    out = last_json(capsys, tree_packing.main, ["--small"])
    assert COMMON | {"speedup", "flops_ratio", "tokens_unrolled", "tokens_packed", "grad_check"} <= set(out)
    assert finite(out["speedup"]) and finite(out["flops_ratio"])
    assert out["tokens_packed"] < out["tokens_unrolled"]
    for check in out["grad_check"].values():  # the packed gradients are the unrolled ones
        assert check["cosine"] > 0.9999


def test_processor(capsys: pytest.CaptureFixture[str]) -> None:
    out = last_json(capsys, processor.main, ["--small"])
    assert COMMON | {"tokens_per_s", "bytes_per_unique_token", "stage_tokens_per_s"} <= set(out)
    assert {"decode", "insert", "ingest", "service"} <= set(out["stage_tokens_per_s"])
    assert finite(out["tokens_per_s"]) and out["bytes_per_unique_token"] > 0
