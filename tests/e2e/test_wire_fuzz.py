"""Random and mutated frames at every socket and engine route of a live embedded run, sent as a
member of the run would send them (``bench.wire_fuzz``, few cases here, 10,000 in ``make bench``):
each is refused with a clear error and counted, nothing of it reaches the processor's log or the
steps, and the run trains on."""

from __future__ import annotations

import re

import pytest

from bench.wire_fuzz import fuzz_live_run
from tests.e2e import call_records, metrics

CASES = 40


@pytest.mark.e2e
def test_fuzzed_sockets_refuse_count_and_the_run_goes_on(tmp_path):
    result, run_dir = fuzz_live_run(tmp_path / "runs", CASES, seed_value=0)
    sent, answered, skipped = result["sent"], result["answered"], result["skipped_valid"]
    for target in ("controller", "records", "records_foreign", "grads", "weights", "engine"):
        assert sent.get(target, 0) >= CASES // 2, (target, result)
    # A clear error for each: the controller answers every frame but a (logged) ErrorReply, the
    # weight server every one; every refusal is one line in its receiver's log.
    assert answered["controller"] == sent["controller"] - skipped.get("controller_error_replies", 0)
    assert answered["weights"] == sent["weights"]
    logged = result["refusals_logged"]
    assert logged["controller"] == answered["controller"], result
    for target in ("records", "records_foreign", "grads"):
        assert logged[target] == sent[target], (target, result)
    assert not any(s.startswith("5") and s != "503" for s in result["engine_status"]), result
    # No state change: the run trained on, each version once, all alive; no fuzzed record was logged.
    assert result["gyre_alive"] and result["versions_in_order_once"], result
    # (execution ids are the controller's: s<step>-<group>-e<i>, or eval-<round>-<i>-e<i>)
    ids = {r.execution_id for r in call_records(run_dir)}
    assert ids and all(re.fullmatch(r"(s\d+-[gr]\d+|eval-\w+-\d+)-e\d+", i) for i in ids), ids
    assert len(metrics(run_dir, "step")) >= result["steps_before"] + result["steps_during_fuzz"] + 2
