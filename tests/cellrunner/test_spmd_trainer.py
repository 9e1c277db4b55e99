"""A multi-rank Megatron cell: the leader's calls reach its follower, and weights and gradients
cross cells rank to rank (two real processes, TP=2 or DP=2, gloo on CPU, real ZeroMQ between ranks).

In one process group, six trainers in turn, each driven by a ``LeaderTrainer`` on rank 0 while
rank 1 runs ``follow``. Each rank has a core side (gradient inbox, own-shard publisher) and a
satellite side (own-shard puller), whose addresses the ranks gather first, as cells do:

1. a core starts (version 0) and each rank publishes its own shard;
2. a satellite starts from its peers' shards, takes shard A, and each rank sends its gradient
   to its peer rank's inbox;
3. a core takes shard B; a step whose gradient reached rank 1 but not rank 0 is refused on both
   (and the cell stays usable); then it applies the satellite's, publishes version 1 and
   checkpoints;
4. a satellite asking for a version nobody has is refused on every rank and drops its replica;
   then it starts from version 1's shards and holds exactly the core's weights;
5. a core that takes A and B itself: its step must equal 3's to float rounding (Adam's first
   step moves each weight by about 3 x lr, so a misrouted rank would be off by ~1e-2; rounding
   of near-zero gradients gives ~1e-6);
6. a core restored from 3's checkpoint holds 3's weights.

megatron-core needs the CPU shims of ``megatron_cpu_shims`` (test support, never production).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # when run as a worker script
    sys.path.insert(0, str(ROOT))

import megatron.core  # noqa: E402,F401  (the [test] extra: missing is a failure, never a skip)

from tests.cellrunner.rank_workers import leave, run_ranks


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_a_two_rank_cell_steps_like_one_replica(tp, tmp_path):
    lead, follower = run_ranks(__file__, ["--worker", str(tp), str(tmp_path)], timeout=300)
    assert follower["followed"] == 6
    for r in (lead, follower):
        assert len(set(r["inboxes"])) == 2 and all(a.startswith("tcp://127.0.0.1:") for a in r["inboxes"])
        assert len(set(r["shards"])) == 2 and all(a.startswith("tcp://127.0.0.1:") for a in r["shards"])
    assert follower["kept_on_rank_1"] == 1  # the refused step's gradient waits there, not lost
    assert lead["refused"] and "refused on ranks [0]" in lead["refused"]
    assert lead["satellite_versions"] == [0, 1]
    assert "could not load weights" in lead["too_new"] and lead["dropped_after_refusal"]
    assert lead["satellite_holds_core_weights"]
    assert lead["versions"] == [1, 1, 1]
    assert lead["norm"] == pytest.approx(lead["norm_ref"], rel=1e-6) and lead["norm"] > 0
    assert lead["step_equals_one_replica"], lead["max_diff"]
    assert lead["moved"]  # the step changed the weights
    assert lead["restored_equal"]
    files = sorted(os.listdir(tmp_path / "v1"))
    shards = ["tp00_pp00_ep00.safetensors", "tp01_pp00_ep00.safetensors"][:tp]
    assert files == sorted(["checkpoint.json", "gyre_megatron.json", *shards])


def worker(tp: int, ckpt_dir: str) -> None:
    import numpy as np
    import torch
    import zmq

    from tests.cellrunner import megatron_cpu_shims

    megatron_cpu_shims.install()
    from cellrunner.grads import GradExchange, send_to_peer
    from cellrunner.megatron_trainer import MegatronTrainer
    from cellrunner.rank_weights import RankWeights
    from cellrunner.spmd import CommandChannel
    from cellrunner.spmd_trainer import LeaderTrainer, RankLinks, follow
    from cellrunner.transfer import WeightServer, ZmqWeightPuller
    from base.checkpoints import Checkpoint
    from tests.cellrunner.test_megatron_trainer import VOCAB, algo_cfg, make_shard, megatron_cfg, model_cfg

    torch.set_num_threads(1)
    cfg, algo = model_cfg(), algo_cfg(lr=3e-3)
    a, b = make_shard(21, num_seqs=6), make_shard(22, num_seqs=6)
    n = a.num_executions + b.num_executions
    rank = int(os.environ["RANK"])
    leader = rank == 0
    ctx = zmq.Context.instance()
    core_links = RankLinks(GradExchange(ctx, "127.0.0.1", rank, is_core=True),
                           RankWeights(rank=rank, publisher=WeightServer(ctx, "tcp://127.0.0.1:0")))
    sat_links = RankLinks(GradExchange(ctx, "127.0.0.1", rank, is_core=False),
                          RankWeights(rank=rank, puller=ZmqWeightPuller(ctx)))
    out: dict = {}

    def cell(is_core: bool):
        trainer = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=is_core, megatron=megatron_cfg(tp))
        channel = CommandChannel()
        if not out:  # as a core cell's ranks do at start-up
            out["inboxes"] = channel.gather_strings(core_links.grads.addr)
            out["shards"] = channel.gather_strings(core_links.weights.addr)
        links = core_links if is_core else sat_links
        if leader:
            return LeaderTrainer(trainer, channel, links)
        follow(trainer, channel, links)
        return None

    cells = (True, False, True, False, True, True)
    if not leader:
        for is_core in cells:
            cell(is_core)
        out["followed"] = len(cells)
        out["kept_on_rank_1"] = core_links.grads.inbox.count(9)
        print(json.dumps(out), flush=True)
        return

    first = cell(True)
    first.start(None)  # version 0: every rank publishes its own shard
    first.close()
    inboxes, shards = out["inboxes"], out["shards"]

    sat = cell(False)
    versions = [sat.start_from_peers(shards, min_version=0, timeout_s=30.0)]
    sat.microstep(a)
    sat.send_grads(inboxes, cell_id=1, step=0)
    sat.stop()
    sat.close()

    core = cell(True)
    core.start(None)
    before = core.weights()
    core.microstep(b)
    # Step 9's gradient reaches rank 1 only: rank 0 times out, so neither rank applies.
    send_to_peer(ctx, inboxes[1], cell_id=1, step=9, rank=1, grads=np.zeros(core.trainer.grad_numel(), dtype=np.float32))
    try:
        core.apply_grads(step=9, satellites=[1], num_executions=n, timeout_s=1.0)
    except ValueError as exc:
        out["refused"] = str(exc)
    w1, out["norm"] = core.apply_grads(step=0, satellites=[1], num_executions=n, timeout_s=60.0)
    path = core.save_checkpoint(ckpt_dir)
    core.close()

    sat = cell(False)
    try:
        sat.start_from_peers(shards, min_version=5, timeout_s=1.0)
    except RuntimeError as exc:
        out["too_new"] = str(exc)
        out["dropped_after_refusal"] = sat.model is None
    versions.append(sat.start_from_peers(shards, min_version=1, timeout_s=30.0))
    out["satellite_holds_core_weights"] = bool(np.array_equal(sat.weights().data, w1.data))
    out["satellite_versions"] = versions
    sat.stop()
    sat.close()

    ref = cell(True)
    ref.start(None)
    ref.microstep(a)
    ref.microstep(b)
    w_ref, out["norm_ref"] = ref.apply_grads(step=0, satellites=[], num_executions=n, timeout_s=1.0)
    ref.close()

    restored = cell(True)
    restored.restore(Checkpoint(1, Path(path)))
    w_back = restored.weights()
    restored.close()

    out["versions"] = [w1.version, w_ref.version, w_back.version]
    out["max_diff"] = float(np.abs(w1.data - w_ref.data).max())
    out["step_equals_one_replica"] = bool(np.allclose(w1.data, w_ref.data, rtol=0, atol=1e-5))
    out["moved"] = not np.array_equal(w1.data, before.data)
    out["restored_equal"] = bool(np.array_equal(w_back.data, w1.data))
    print(json.dumps(out), flush=True)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    worker(int(sys.argv[2]), sys.argv[3])
    leave()
