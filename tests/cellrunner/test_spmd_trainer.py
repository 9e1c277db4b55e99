"""A multi-rank Megatron cell: the leader's calls reach its follower, and gradients cross cells
rank to rank (two real processes, TP=2 or DP=2, gloo on CPU, real ZeroMQ between ranks).

In one process group, four trainers in turn, each driven by a ``LeaderTrainer`` on rank 0 while
rank 1 runs ``follow``; each rank has a core inbox (``cellrunner.grads``) whose addresses the
ranks gather first, as a core cell's ranks do:

1. a satellite starts from weights the leader broadcasts, takes shard A, and each rank sends its
   gradient to its peer rank's inbox;
2. a core takes shard B; a step whose gradient reached rank 1 but not rank 0 is refused on both
   (and the cell stays usable); then it applies the satellite's, and checkpoints;
3. a core that takes A and B itself: its step must equal 2's to float rounding (Adam's first
   step moves each weight by about 3 x lr, so a misrouted rank or a bad weight broadcast would be
   off by ~1e-2; rounding of near-zero gradients gives ~1e-6);
4. a core restored from 2's checkpoint holds 2's weights.

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

pytest.importorskip("megatron.core", reason="megatron-core is in the [test] extra")  # noqa: E402

from tests.cellrunner.rank_workers import run_ranks  # noqa: E402


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_a_two_rank_cell_steps_like_one_replica(tp, tmp_path):
    lead, follower = run_ranks(__file__, ["--worker", str(tp), str(tmp_path)], timeout=300)
    assert follower["followed"] == 4
    for r in (lead, follower):
        assert len(set(r["inboxes"])) == 2 and all(a.startswith("tcp://127.0.0.1:") for a in r["inboxes"])
    assert follower["kept_on_rank_1"] == 1  # the refused step's gradient waits there, not lost
    assert lead["refused"] and "refused on ranks [0]" in lead["refused"]
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
    from cellrunner.model import build_model, flatten_params
    from cellrunner.spmd import CommandChannel
    from cellrunner.spmd_trainer import LeaderTrainer, follow
    from controller.checkpoints import Checkpoint
    from tests.cellrunner.test_megatron_trainer import VOCAB, algo_cfg, make_shard, megatron_cfg, model_cfg

    torch.set_num_threads(1)
    cfg, algo = model_cfg(), algo_cfg(lr=3e-3)
    a, b = make_shard(21, num_seqs=6), make_shard(22, num_seqs=6)
    n = a.num_executions + b.num_executions
    rank = int(os.environ["RANK"])
    leader = rank == 0
    ctx = zmq.Context.instance()
    core_side = GradExchange(ctx, "127.0.0.1", rank, is_core=True)
    sat_side = GradExchange(ctx, "127.0.0.1", rank, is_core=False)
    out: dict = {}

    def cell(is_core: bool):
        trainer = MegatronTrainer(model_cfg=cfg, algo=algo, vocab_size=VOCAB, is_core=is_core, megatron=megatron_cfg(tp))
        channel = CommandChannel()
        if not out:
            out["inboxes"] = channel.gather_strings(core_side.addr)
        if leader:
            return LeaderTrainer(trainer, channel)
        follow(trainer, channel, core_side if is_core else sat_side)
        return None

    if not leader:
        for is_core in (False, True, True, True):
            cell(is_core)
        out["followed"] = 4
        out["kept_on_rank_1"] = core_side.inbox.count(9)
        print(json.dumps(out), flush=True)
        return

    sat = cell(False)
    addrs = out["inboxes"]
    sat.start(flatten_params(build_model(cfg, VOCAB), 0))  # version 0, broadcast to rank 1
    sat.microstep(a)
    sat.send_grads(sat_side, addrs, cell_id=1, step=0)
    sat.stop()
    sat.close()

    core = cell(True)
    core.start(None)
    before = core.weights()
    core.microstep(b)
    # Step 9's gradient reaches rank 1 only: rank 0 times out, so neither rank applies.
    send_to_peer(ctx, addrs[1], cell_id=1, step=9, rank=1, grads=np.zeros(core.grad_numel(), dtype=np.float32))
    try:
        core.apply_grads(core_side, step=9, num_satellites=1, num_executions=n, timeout_s=1.0)
    except ValueError as exc:
        out["refused"] = str(exc)
    w1, out["norm"] = core.apply_grads(core_side, step=0, num_satellites=1, num_executions=n, timeout_s=60.0)
    path = core.save_checkpoint(ckpt_dir)
    core.close()

    ref = cell(True)
    ref.start(None)
    ref.microstep(a)
    ref.microstep(b)
    w_ref, out["norm_ref"] = ref.apply_grads(core_side, step=0, num_satellites=0, num_executions=n, timeout_s=1.0)
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
