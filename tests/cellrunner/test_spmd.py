"""cellrunner.spmd: the leader's commands are checked like any frame, and the cell's tensors move
exactly (two real processes over gloo)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # when run as a worker script
    sys.path.insert(0, str(ROOT))

from cellrunner.spmd import COMMANDS, CommandError, decode_command, encode_command, owner_slices  # noqa: E402
from tests.cellrunner.rank_workers import run_ranks  # noqa: E402


def test_every_command_round_trips():
    samples = {int: 7, str: "/ckpt", bytes: b"\x00frame"}
    for op, args in COMMANDS.items():
        values = {name: samples[kind] for name, kind in args.items()}
        cmd = decode_command(encode_command(op, **values))
        assert (cmd.op, cmd.args) == (op, values)


@pytest.mark.parametrize("data, match", [
    (b"\xc1", "not MessagePack"),
    (msgpack.packb({"op": "stop"}), r"want \[op, \{args\}\]"),
    (msgpack.packb(["launch_missiles", {}]), "unknown op"),
    (msgpack.packb(["apply", {"num_satellites": 1}]), "want arguments"),
    (msgpack.packb(["apply", {"num_satellites": 1, "num_executions": "8"}]), "num_executions: want int"),
    (msgpack.packb(["apply", {"num_satellites": True, "num_executions": 8}]), "num_satellites: want int"),
    (msgpack.packb(["microstep", {"shard": "not bytes"}]), "shard: want bytes"),
])
def test_bad_commands_are_refused(data, match):
    with pytest.raises(CommandError, match=match):
        decode_command(data)
    with pytest.raises(CommandError):
        encode_command("stop", extra=1)


def test_dp_replicas_send_their_gradient_once():
    # ranks 0-3: TP 0/1 of DP replica 0, then TP 0/1 of replica 1 (keys = model-parallel rank)
    sent, where = owner_slices([0, 1, 0, 1], [5, 3, 5, 3])
    assert sent == [5, 3, 0, 0]
    assert where == [(0, 5), (5, 3), (0, 5), (5, 3)]  # a replica takes its original's slice
    sent, where = owner_slices([-1, -2], [4, 6])  # expert parallel: every buffer is its own
    assert sent == [4, 6] and where == [(0, 4), (4, 6)]
    with pytest.raises(ValueError, match="share a gradient key but not a size"):
        owner_slices([0, 0], [4, 5])


def test_commands_and_tensors_cross_a_three_rank_cell():
    results = run_ranks(__file__, ["--worker"], world=3, timeout=120)
    for r in results[1:]:
        assert r["commands"] == [["start", {"weights_version": 4}], ["apply", {"num_satellites": 2, "num_executions": 8}],
                                 ["exit", {}]]
        assert r["weights_ok"] and r["flag"] is False
    sizes = results[0]["sizes"]
    assert sizes == [5, 3, 5]  # unequal per-rank buffers (pipeline stages differ)
    assert results[0]["gathered"] == [float(v) for r in range(3) for v in range(100 * r, 100 * r + sizes[r])]
    for rank, r in enumerate(results):
        assert r["scattered"] == [float(-v) for v in range(100 * rank, 100 * rank + sizes[rank])]


def worker() -> None:
    import torch
    import torch.distributed as dist

    from cellrunner.spmd import CommandChannel, broadcast_flat, gather_flat, scatter_chunks

    dist.init_process_group("gloo", init_method="env://")
    rank, cpu = dist.get_rank(), torch.device("cpu")
    channel = CommandChannel()
    out: dict = {}
    weights = np.arange(10, dtype=np.float32) * 0.5
    if rank == 0:
        channel.send("start", weights_version=4)
        got = broadcast_flat(torch.from_numpy(weights), 10, cpu)
        channel.send("apply", num_satellites=2, num_executions=8)
        channel.flag(False)
        channel.send("exit")
    else:
        out["commands"] = []
        while True:
            cmd = channel.recv()
            out["commands"].append([cmd.op, cmd.args])
            if cmd.op == "start":
                got = broadcast_flat(None, 10, cpu)
            elif cmd.op == "apply":
                out["flag"] = channel.flag()
            elif cmd.op == "exit":
                break
    out["weights_ok"] = bool(np.array_equal(got.numpy(), weights))
    local_size = 3 if rank == 1 else 5
    local = np.arange(100 * rank, 100 * rank + local_size, dtype=np.float32)
    sizes = channel.gather_ints(local_size)
    full = gather_flat(local, sizes, cpu)
    if rank == 0:
        out["sizes"], out["gathered"] = sizes, full.tolist()
    chunks = None
    if rank == 0:
        offsets = np.cumsum([0, *sizes])
        chunks = [-full[offsets[r]:offsets[r + 1]] for r in range(3)]
    mine = scatter_chunks(chunks, sizes, cpu)
    out["scattered"] = mine.tolist()
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    worker()
