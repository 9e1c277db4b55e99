"""``python -m bench.proxy --quick`` runs the real processes (instant engine, proxy, and LiteLLM when
its venv exists) and prints one JSON object last, with sane values. No timing goal is asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from bench.proxy import LITELLM_VENV, SIZES

ROOT = Path(__file__).resolve().parents[2]


def finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_bench_proxy_quick() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.proxy", "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    litellm = (LITELLM_VENV / "bin" / "litellm").exists()
    assert out["config"]["litellm"] is litellm
    for size, tokens in SIZES.items():
        assert finite(out[f"p50_ms_{size}"]) and finite(out[f"p99_ms_{size}"])
        assert out[f"p50_ms_{size}"] <= out[f"p99_ms_{size}"]
        assert out[f"direct_call_p50_ms_{size}"] > 0 and out[f"proxy_call_p50_ms_{size}"] > 0
        assert 0.8 * tokens <= out[f"context_tokens_{size}"] <= 1.5 * tokens
        ratio = out[f"litellm_ratio_{size}"]
        assert (finite(ratio) and ratio > 0) if litellm else ratio is None
    # Exactness, not speed: every measured call spliced the engine's own ids, every record is exact.
    assert out["measured_calls"] == out["spliced_calls"] == len(SIZES) * 2
    assert out["records"]["received"] > 0 and out["records"]["exact"] == out["records"]["received"]
    assert out["sessions_held_100k"] == out["config"]["hold_sessions"] == 2
    assert out["held_calls_spliced"] == out["held_calls_checked"] == 4
    assert finite(out["rss_mb_per_session_100k"])
    stages = out["stage_ms_100k"]
    assert {"parse_request", "build_prompt", "encode_engine_request", "encode_call_record", "remember"} <= set(stages)
    assert all(finite(v) and v >= 0 for v in stages.values())
    assert {"python", "aiohttp", "tiktoken"} <= set(out["versions"])
