"""``python -m bench.proxy_load`` at a small size: real proxy, engine double and client processes;
every call answered, every record exact and spliced, every seal counted, RSS measured. No timing
goal is asserted (the 512-session figures are ``make bench``'s)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_proxy_load_small() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.proxy_load", "--sessions", "16", "--clients", "2", "--duration-s", "8",
         "--max-tokens-per-session", "30000", "--growth-tokens", "4000"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["calls"] > 16 and out["errors"] == 0, out
    assert out["records_received"] == out["calls"]
    assert out["records_lost"] == out["records_inexact"] == out["records_duplicate"] == 0
    assert out["records_out_of_order"] == out["records_unanswered"] == 0
    assert out["records_spliced"] == out["records_splice_checked"] > 0
    assert out["seals"] == out["seals_exact"] == out["executions"] > 16
    assert out["context_tokens"]["sessions_reached_max"] > 0  # sessions ended at their cap and began anew
    rss = out["proxy_rss_mb"]
    assert 0 < rss["baseline"] <= rss["peak"] and math.isfinite(rss["per_session"])
    assert out["added_latency_ms"]["p50"] <= out["added_latency_ms"]["p99"]
