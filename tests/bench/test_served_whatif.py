"""bench.served_whatif: with the serving left out it lands on the makespan bound (the model's
check); keeping runs served can only cost time; the CLI prints its JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench import served_whatif
from controller.bounds import makespan_bound
from controller.simulator import pool_source
from controller.traces import load_trace

TRACES = Path(__file__).resolve().parents[2] / "bench" / "traces"


@pytest.mark.parametrize("name", ["p2_4t_moving", "nl2repo_122b", "deepswe_122b"])
def test_without_serving_it_is_the_bound_and_serving_costs_time(name: str):
    trace = load_trace(TRACES / f"{name}.json")
    trace = dataclasses.replace(trace, workload=dataclasses.replace(trace.workload, steps=8))
    bound = makespan_bound(trace, pool_source(trace, 0))
    unserved = served_whatif.served_whatif_s(trace, served=False)
    served = served_whatif.served_whatif_s(trace)
    # within 1%: ticks of 10 s, and microsteps shared out tick by tick rather than one by one
    assert unserved == pytest.approx(bound, rel=0.01)
    assert served >= unserved


def test_the_cli_prints_each_staleness(capsys: pytest.CaptureFixture[str]):
    served_whatif.main([str(TRACES / "terminalbench_122b.json"), "--staleness", "1", "2"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["by_staleness"]) == {"1", "2"}
    for row in out["by_staleness"].values():
        assert row["served_whatif_h"] >= row["unserved_h"] > 0 and row["bound_h"] > 0
