"""The viewer's reading of a run folder: what trained is the processor's verdict, the cap is the
processor's, and missing, half-written, torn or corrupt files give notes, never exceptions, and
are left as they were."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from base import wire
from tests.trajectory import ASSISTANT, END, SYS, TOOL, USER, grade
from tests.trajectory import Run as Calls
from tests.viewer import snapshot, write_run
from trajectory.log import AppendLog
from viewer import calltree
from viewer.pages import _verdict, execution_page, run_page
from viewer.runfolder import RunFolderError, RunReader


def calls(eid: str, *, sub_agents: int = 0) -> Calls:
    """Two main calls of a tool loop (6 policy tokens), then ``sub_agents`` sub-agents of one call (3 each)."""
    c = Calls(eid)
    p = c.call([SYS, 101, USER, 201, ASSISTANT], [301, 302, END])
    c.call(p + [TOOL, 401, ASSISTANT], [303, 304, END])
    for k in range(sub_agents):
        c.call([SYS, 110 + k, USER, 210 + k, ASSISTANT], [310 + k, 320 + k, END], lineage="sub-agent", agent_id=f"a{k}")
    return c


def verdict(run_dir: Path, eid: str) -> str:
    run = RunReader(run_dir).read()
    return _verdict(run, calltree.build(run, eid))


def test_what_trained_is_what_the_processor_sent(tmp_path: Path) -> None:
    e = {k: calls(f"e{k}") for k in range(5)}
    msgs = [*e[0].records, e[0].sealed(),
            *e[1].records[:1], wire.ExecutionSealed(execution_id="e1", num_calls=2),  # a record lost: cut
            *e[2].records, e[2].sealed(), *e[3].records, e[3].sealed(), *e[4].records]  # e4 never sealed
    sent = write_run(tmp_path, msgs, [
        grade("e0", "g1", 1.0, group_size=3), grade("e1", "g1", 0.0, group_size=3),
        grade("e2", "g1", None, group_size=3, outcome="crashed"),
        grade("e3", "eval", 0.5, group_size=1, train=False), grade("e4", "g2", 0.5, group_size=1)])
    assert set(sent) == {"e0"}
    run = RunReader(tmp_path).read()
    t = calltree.build(run, "e0")
    assert t.sent_targets == sent["e0"] == t.num_targets == sum(t.targets.values()) == 6
    assert verdict(tmp_path, "e0").startswith("trained: the processor sent 6 policy tokens")
    assert verdict(tmp_path, "e1") == "not trained: cut: sealed with calls missing or refused"
    assert verdict(tmp_path, "e2") == "not trained: outcome crashed"
    assert verdict(tmp_path, "e3") == "not trained: an eval run: scored, never trained"
    assert verdict(tmp_path, "e4") == "not trained: not sealed yet"
    html = execution_page(run, "e0")
    assert html.count("class='trained'") == 6 and "class='untrained'" not in html
    assert execution_page(run, "e1").count("class='untrained'") == 3  # shown, not trained


def test_a_dropped_group_trains_nothing(tmp_path: Path) -> None:
    e0, e1 = calls("e0"), calls("e1")
    sent = write_run(tmp_path, [*e0.records, e0.sealed(), *e1.records, e1.sealed()],
                     [grade("e0", "g", 1.0, group_size=2), grade("e1", "g", None, group_size=2, outcome="crashed")],
                     min_usable=2)
    assert not sent
    assert verdict(tmp_path, "e0") == "not trained: its group was dropped (too_few_usable)"


def test_the_cap_and_a_resent_record_are_the_processors(tmp_path: Path) -> None:
    c = calls("e0", sub_agents=4)
    sent = write_run(tmp_path, [*c.records, c.records[1], c.sealed()], [grade("e0", "g", 1.0, group_size=1)],
                     max_trajectories=2)
    run = RunReader(tmp_path).read()
    t = calltree.build(run, "e0")
    assert len(t.records) == 6  # the resent record counted once, as the processor counts it
    assert [tr.kind for tr in t.kept or []] == ["main", "sub-agent"]
    assert t.sent_targets == sent["e0"] == t.num_targets == 6 + 3
    html = execution_page(run, "e0")
    assert re.findall(r"kept #\d|over the cap", html) == ["kept #1", "kept #2", "over the cap", "over the cap", "over the cap"]
    assert html.count("class='trained'") == 9 and html.count("class='untrained'") == 9


def test_a_torn_log_is_shown_up_to_the_tear_left_as_it_is_and_read_on_once_whole(tmp_path: Path) -> None:
    a, b = calls("e0"), calls("e1")
    write_run(tmp_path, [*a.records, a.sealed()], [grade("e0", "g", 1.0, group_size=1)])
    log = tmp_path / "processor" / "processor.log"
    scratch = AppendLog(tmp_path / "entry.log", fsync=False)
    scratch.append(wire.encode(b.records[0]))
    scratch.close()
    entry = (tmp_path / "entry.log").read_bytes()
    (tmp_path / "entry.log").unlink()
    with open(log, "ab") as f:
        f.write(entry[:20])  # a processor killed (or still writing) mid-entry
    before = snapshot(tmp_path)
    reader = RunReader(tmp_path)
    run = reader.read()
    assert any("log ends in a torn entry after 5 entries (20 bytes" in n for n in run.notes)
    assert "e1" not in run.executions and calltree.build(run, "e0").sent_targets == 6
    execution_page(run, "e0"), run_page(run, {})
    assert snapshot(tmp_path) == before  # nothing written, the torn tail left for the processor
    with open(log, "ab") as f:
        f.write(entry[20:])  # the entry completes: the same reader reads on from where it stopped
    run = reader.read()
    assert not any("torn" in n for n in run.notes)
    assert run.logs[0].num_entries == 6 and [r.call_id for r in run.records("e1")] == ["e1/c0"]


def test_a_corrupt_entry_ends_the_log_where_the_processors_replay_ends_it(tmp_path: Path) -> None:
    c = calls("e0", sub_agents=2)
    write_run(tmp_path, [*c.records, c.sealed()], [grade("e0", "g", 1.0, group_size=1)])
    log = tmp_path / "processor" / "processor.log"
    data = bytearray(log.read_bytes())
    data[len(data) // 2] ^= 0xFF
    log.write_bytes(bytes(data))
    run = RunReader(tmp_path).read()
    copy = tmp_path / "copy.log"
    shutil.copy(log, copy)
    replayed = AppendLog(copy, fsync=False)
    assert run.logs[0].num_entries == len(list(replayed.replay())) < 7
    assert any(f"log ends in a torn entry after {run.logs[0].num_entries} entries" in n for n in run.notes)
    assert log.read_bytes() == bytes(data)


def test_missing_and_half_written_run_folders(tmp_path: Path) -> None:
    with pytest.raises(RunFolderError, match="no run folder"):
        RunReader(tmp_path / "nothing").read()
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(RunFolderError, match="not a Gyre run folder"):
        RunReader(tmp_path).read()
    (tmp_path / "processor").mkdir()  # a run that has only just started
    run = RunReader(tmp_path).read()
    assert not run.executions and run.config is None and run.tokenizer is None
    assert {n.split(":")[0] for n in run.notes} == {"processor.json", "proxy.json", "metrics.jsonl",
                                                    "processor/processor.log"}
    (tmp_path / "processor" / "processor.log").write_bytes(b"")
    (tmp_path / "metrics.jsonl").write_text('{"kind": "step", "step": 0}\n{"kind": "execution", "id": "e0", "outc')
    (tmp_path / "summary.json").write_text("")
    (tmp_path / "processor.json").write_text("{}")
    run = RunReader(tmp_path).read()
    assert run.logs[0].num_entries == 0 and len(run.steps) == 1 and not run.executions
    assert any("metrics.jsonl: 1 line(s) not JSON" in n for n in run.notes)
    assert any(n.startswith("summary.json: unreadable") for n in run.notes)
    assert any(n.startswith("processor.json: ProcessorConfig: missing key(s)") for n in run.notes)
    assert "Steps" in run_page(run, {})


def test_a_config_written_after_the_first_look_is_used(tmp_path: Path) -> None:
    c = calls("e0")
    write_run(tmp_path, [*c.records, c.sealed()], [grade("e0", "g", 1.0, group_size=1)])
    config = (tmp_path / "processor.json").read_text()
    (tmp_path / "processor.json").unlink()
    reader = RunReader(tmp_path)
    assert calltree.build(reader.read(), "e0").sent_targets is None
    (tmp_path / "processor.json").write_text(config)
    assert calltree.build(reader.read(), "e0").sent_targets == 6
    assert json.loads(config)["algo"]["max_trajectories_per_execution"] == 5


def test_a_resumed_run_shows_the_attempt_that_counted(tmp_path: Path) -> None:
    """Attempt 0 died mid-execution; attempt 10 ran the step again under the same id (and
    ``processor.10`` must sort after ``processor.2`` as a number, not as text)."""
    first, again = calls("e0"), calls("e0", sub_agents=1)
    write_run(tmp_path, first.records[:1], [])
    for k in range(1, 11):
        write_run(tmp_path, [*again.records, again.sealed()] if k == 10 else [],
                  [grade("e0", "g", 1.0, group_size=1)] if k == 10 else [], attempt=k)
    run = RunReader(tmp_path).read()
    assert [s.attempt for s in run.logs] == list(range(11))
    assert [s.attempt for s in run.scans_of("e0")] == [0, 10]
    t = calltree.build(run, "e0")
    assert len(t.records) == 3 and t.sent_targets == 9
    html = execution_page(run, "e0")
    assert "recorded by 2 attempts of the run (processor, processor.10); shown: the last, processor.10" in html
    assert "the harness&#x27;s own words for e0 in attempt 10" in html
