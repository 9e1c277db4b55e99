"""Test support: one rank of a multi-rank SGLang cell's serving, as ``cellrunner.main`` (leader)
and ``cellrunner.follower`` start it: the real command channel over gloo, the real
``make_engine`` / ``make_node_engine`` collectives, the real SGLang processes (the stand-in on
PYTHONPATH). No trainer: the serving start is what is under test.

    python cell_server_ranks.py CONFIG_JSON OUT_DIR   (torchrun's variables + GYRE_NODE_RANK/GYRE_NNODES)

The leader starts every server, then walks a cell's switches on all of them (first load,
update, drain, release, resume), writes ``OUT_DIR/leader.json`` (the URLs it would report and
what each step did) and serves until ``OUT_DIR/stop`` appears; every rank then stops its part.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist

from cellrunner.backends import CellRunnerConfig, check_ranks, make_engine, make_node_engine
from cellrunner.model import FlatWeights, build_model, flatten_params, vocab_rows
from base.ranks import ranks_from_env
from cellrunner.spmd import CommandChannel
from base.typed_config import build

KEY = "cd" * 32
WAIT_S = 600.0  # generous: on a loaded machine the ranks alone take minutes to import torch


def weights(cfg: CellRunnerConfig, version: int) -> FlatWeights:
    w = flatten_params(build_model(cfg.model, vocab_rows(cfg.model)), 0)
    return FlatWeights(version, w.specs, w.data + np.float32(version))


def lead(cfg: CellRunnerConfig, ranks, channel: CommandChannel, out: Path) -> None:
    engine = make_engine(cfg, vocab_rows(cfg.model), 1, ranks, KEY, channel)
    report: dict = {"urls": engine.urls}
    try:
        engine.start()
        engine.resume(weights(cfg, 0))
        engine.update_weights(weights(cfg, 1))
        report["drained"] = engine.drain(0.05)
        engine.release()
        report["released"] = [s.released for s in engine.servers]
        engine.resume(weights(cfg, 2))
        report["version"] = engine.weight_version
        (out / "leader.json.tmp").write_text(json.dumps(report))
        os.replace(out / "leader.json.tmp", out / "leader.json")
        deadline = time.monotonic() + WAIT_S
        while not (out / "stop").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        # A server the test killed: the load poll behind each heartbeat names it (the controller
        # then stops routing to it); the next switch says which one, and still reaches the others.
        engine.num_running()
        report["down_urls"] = list(engine.down_urls)
        try:
            engine.update_weights(weights(cfg, 3))
            report["after_kill"] = "ok"
        except Exception as exc:  # the test checks the words
            report["after_kill"] = f"{type(exc).__name__}: {exc}"
        report["versions_after_kill"] = [s.version for s in engine.servers]
        (out / "final.json").write_text(json.dumps(report))
    finally:
        engine.stop()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = build(CellRunnerConfig, json.loads(Path(sys.argv[1]).read_text()))
    out = Path(sys.argv[2])
    ranks = ranks_from_env(os.environ)
    check_ranks(cfg, ranks)
    dist.init_process_group("gloo", init_method="env://")
    channel = CommandChannel(timeout_s=WAIT_S + 60)
    if ranks.is_leader:
        lead(cfg, ranks, channel, out)
        channel.gather_ints(0)  # the followers stop their parts after the leader is done
    else:
        part = make_node_engine(cfg, vocab_rows(cfg.model), 1, ranks, KEY, channel)
        channel.gather_ints(0)
        if part is not None:
            part.stop()
    print(json.dumps({"rank": ranks.rank}), flush=True)
    # As cellrunner.main ends a multi-rank cell: leave at once. The interpreter's teardown of a
    # gloo process group whose peer may have left first can abort ("terminate called without an
    # active exception", exit -6), which is not what is under test.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
