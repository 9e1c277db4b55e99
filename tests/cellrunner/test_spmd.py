"""cellrunner.spmd: the leader's commands are checked like any frame, and the ranks of a cell
share strings and their yes/no exactly (three real processes over gloo)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgpack
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # when run as a worker script
    sys.path.insert(0, str(ROOT))

from cellrunner.spmd import COMMANDS, CommandError, decode_command, encode_command  # noqa: E402
from tests.cellrunner.rank_workers import leave, run_ranks  # noqa: E402

APPLY = {"step": 3, "satellites": [1, 2], "num_executions": 8, "timeout_s": 5.0}


def test_every_command_round_trips():
    samples = {int: 7, str: "/ckpt", bytes: b"\x00frame", float: 2.5, list[str]: ["tcp://10.0.0.1:5000"],
               list[int]: [1, 3]}
    for op, args in COMMANDS.items():
        values = {name: samples[kind] for name, kind in args.items()}
        cmd = decode_command(encode_command(op, **values))
        assert (cmd.op, cmd.args) == (op, values)
    assert decode_command(encode_command("apply", **(APPLY | {"timeout_s": 5}))).args["timeout_s"] == 5.0


@pytest.mark.parametrize("data, match", [
    (b"\xc1", "not MessagePack"),
    (msgpack.packb({"op": "stop"}), r"want \[op, \{args\}\]"),
    (msgpack.packb(["launch_missiles", {}]), "unknown op"),
    (msgpack.packb(["apply", {"satellites": [1]}]), "want arguments"),
    (msgpack.packb(["apply", APPLY | {"num_executions": "8"}]), "num_executions: want int"),
    (msgpack.packb(["apply", APPLY | {"step": True}]), "step: want int"),
    (msgpack.packb(["apply", APPLY | {"satellites": [1, True]}]), "satellites: want a list of int"),
    (msgpack.packb(["apply", APPLY | {"satellites": 1}]), "satellites: want a list of int"),
    (msgpack.packb(["microstep", {"shard": "not bytes"}]), "shard: want bytes"),
    (msgpack.packb(["send_grads", {"step": 1, "cell_id": 2, "addrs": "tcp://a:1"}]), "addrs: want a list of str"),
    (msgpack.packb(["send_grads", {"step": 1, "cell_id": 2, "addrs": ["tcp://a:1", 2]}]), "addrs: want a list of str"),
])
def test_bad_commands_are_refused(data, match):
    with pytest.raises(CommandError, match=match):
        decode_command(data)
    with pytest.raises(CommandError):
        encode_command("stop", extra=1)


def test_commands_weights_strings_and_agreement_cross_a_three_rank_cell():
    results = run_ranks(__file__, ["--worker"], world=3, timeout=120)
    for r in results[1:]:
        assert r["commands"] == [["start", {}], ["apply", APPLY], ["exit", {}]]
    for r in results:
        assert r["strings"] == ["tcp://rank0:1", "", "tcp://rank2:12345"]  # an empty one too
        assert r["all_ok"] == [] and r["one_failed"] == [1]


def worker() -> None:
    import torch.distributed as dist

    from cellrunner.spmd import CommandChannel

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    channel = CommandChannel()
    out: dict = {}
    if rank == 0:
        channel.send("start")
        channel.send("apply", **APPLY)
        channel.send("exit")
    else:
        out["commands"] = []
        while True:
            cmd = channel.recv()
            out["commands"].append([cmd.op, cmd.args])
            if cmd.op == "exit":
                break
    out["strings"] = channel.gather_strings({0: "tcp://rank0:1", 1: "", 2: "tcp://rank2:12345"}[rank])
    out["all_ok"] = channel.all_ok(True)
    out["one_failed"] = channel.all_ok(rank != 1)
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    worker()
    leave()
