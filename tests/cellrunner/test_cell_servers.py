"""A cell of three SGLang servers, end to end on CPU: three ranks of one cell (real processes, the
real command channel over gloo, the real ``make_engine``/``make_node_engine``) start one server
each (the SGLang stand-in, ``tests/support/sglang_standin``, real HTTP); the leader learns all
three URLs and sends every switch to all of them; the URLs travel in a real ``CellReady`` frame
to the controller's cell registry, whose routes go in a ``RoutingTable`` to the real proxy; the
proxy keeps a session on one server, spreads new sessions, and routes around a server that is
killed, while the cell's load poll names the dead server for the controller's routes and the
leader's next switch names it and still reaches the others.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import zmq

from base.ranks import rank_env
from base import wire
from controller.cells import CellRegistry
from controller.controller import cellrunner_config
from base.execution_token import mint_token
from harness_proxy.record_sink import ZmqRecordSink
from harness_proxy.server import ProxyServer
from tests.cellrunner.rank_workers import free_port
from tests.cellrunner.test_engine_sglang import STANDIN
from tests.controller.test_config import load
from tests.harness_proxy import ROLLOUT, SECRET, TOK, AckingInbox, LoopThread, proxy_config
from base.algo_config import RolloutSampling
from base.typed_config import build

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "cellrunner" / "cell_server_ranks.py"
KEY = "cd" * 32  # the worker's engine key
NUM_RANKS = 3  # one node of three one-GPU ranks: three TP1 servers (cellrunner.servers)


def start_ranks(tmp_path: Path, *overrides: str, world: int = NUM_RANKS, per_node: int = NUM_RANKS,
                weight_dir: Path | None = None) -> list[subprocess.Popen]:
    cfg = cellrunner_config(load(
        "trainer=megatron", "engine=sglang", f"cluster.ranks_per_node={per_node}", "cluster.host=127.0.0.1",
        f"engine.weight_dir={weight_dir or tmp_path / 'weights'}", "engine.startup_timeout_s=60",
        "engine.poll_interval_s=0.02", "engine.request_timeout_s=30", "engine.flush_cache_timeout_s=30", *overrides,
    ), checkpoint_dir=tmp_path / "ck", log_dir=tmp_path / "logs")
    cfg_path = tmp_path / "cell.json"
    cfg_path.write_text(json.dumps(cfg))
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, **rank_env(rank=rank, world_size=world, ranks_per_node=per_node,
                                        master_addr="127.0.0.1", master_port=port),
               "PYTHONPATH": os.pathsep.join([str(STANDIN), str(ROOT)]), "OMP_NUM_THREADS": "1",
               "FAKE_SGLANG_RECORD": str(tmp_path / "record-{port}.json")}
        with open(tmp_path / f"rank{rank}.log", "wb") as out:
            procs.append(subprocess.Popen([sys.executable, str(WORKER), str(cfg_path), str(tmp_path)], cwd=ROOT,
                                          env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


def rank_log(procs: list[subprocess.Popen], rank: int) -> str:
    return Path(procs[rank].args[-1], f"rank{rank}.log").read_text(errors="replace")[-3000:]


def wait_for(path: Path, procs: list[subprocess.Popen], timeout_s: float = 600) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        for rank, p in enumerate(procs):
            assert p.poll() is None, f"rank {rank} exited {p.returncode}:\n{rank_log(procs, rank)}"
        assert time.monotonic() < deadline, f"no {path.name} in {timeout_s}s; the leader's log:\n{rank_log(procs, 0)}"
        time.sleep(0.1)
    return json.loads(path.read_text())


def record(tmp_path: Path, url: str) -> dict:
    return json.loads((tmp_path / f"record-{url.rsplit(':', 1)[1]}.json").read_text())


class Proxy:
    """The real ProxyServer on a loop thread, its records taken by the processor's real inbox."""

    def __init__(self) -> None:
        self.lt = LoopThread()
        self.ctx = zmq.Context()
        self.inbox = AckingInbox(self.ctx)
        self.server: ProxyServer = self.lt.run(self._start())

    async def _start(self) -> ProxyServer:
        self.azctx = zmq.asyncio.Context()
        self.sink = ZmqRecordSink(self.azctx, self.inbox.addr, resend_s=0.5)
        self.sink.start()
        server = ProxyServer(proxy_config(), tokenizer=TOK, rollout=build(RolloutSampling, ROLLOUT), secret=SECRET,
                             sink=self.sink, engine_api_key=KEY)
        await server.start()
        return server

    def call(self, execution_id: str) -> None:
        client = openai.OpenAI(base_url=f"{self.server.url}/v1", api_key=mint_token(SECRET, execution_id),
                               max_retries=0, timeout=30)
        client.chat.completions.create(model="gyre-policy", messages=[{"role": "user", "content": "hi"}], max_tokens=3)

    def close(self) -> None:
        async def stop() -> None:
            await self.server.stop()
            await self.sink.close(timeout_s=1)
            self.azctx.term()

        self.lt.run(stop())
        self.lt.close()
        self.inbox.close()
        self.ctx.term()


def test_a_cell_serves_through_all_its_servers_and_the_proxy_routes_among_them(tmp_path):
    procs = start_ranks(tmp_path)
    proxy = None
    try:
        leader = wait_for(tmp_path / "leader.json", procs)
        urls = leader["urls"]
        assert len(urls) == NUM_RANKS == len(set(urls))
        recs = [record(tmp_path, u) for u in urls]
        # Each rank started its own server: its GPUs (--base-gpu-id) and its own seed.
        assert [r["argv"][r["argv"].index("--base-gpu-id") + 1] if "--base-gpu-id" in r["argv"] else "0"
                for r in recs] == ["0", "1", "2"]
        assert len({r["argv"][r["argv"].index("--random-seed") + 1] for r in recs}) == NUM_RANKS
        # Every switch reached every server: first load, update, release, resume with version 2.
        for r in recs:
            assert [x["version"] for x in r["loaded"]] == ["0", "1", "2"], r["loaded"]
            assert [c[0] for c in r["calls"] if c[0] != "flush_cache"] == [
                "update_weights_from_disk", "update_weights_from_disk", "pause_generation",
                "release_memory_occupation", "resume_memory_occupation", "update_weights_from_disk",
                "resume_memory_occupation", "continue_generation"]
            assert r["released"] == [] and r["version"] == "2"
        assert leader["released"] == [True] * NUM_RANKS and leader["version"] == 2
        assert len({x["path"] for r in recs for x in r["loaded"] if x["version"] == "2"}) == 1  # written once

        # The cell reports all URLs (engine_url first) on the wire; the controller routes them all.
        ready = wire.decode(wire.encode(wire.CellReady(
            cell_id=1, engine_url=urls[0], engine_urls=urls, weights_addr="", grads_addrs=[], is_core=False,
            weight_version=2)))
        cells = CellRegistry(2, core_cell=0)
        cells.cells[1].engine_urls = ready.serving_urls()
        cells.cells[1].weight_version = 2
        cells.cells[1].set_phase("serving", time.monotonic())
        table = wire.RoutingTable(version=1, engines=[wire.EngineRoute(cell_id=i, url=u, weight_version=v)
                                                      for i, u, v in cells.routes()])
        assert [e.url for e in table.engines] == urls and {e.cell_id for e in table.engines} == {1}

        proxy = Proxy()
        assert proxy.lt.call(proxy.server.apply_routing_table, table)

        def served() -> list[int]:
            return [len(record(tmp_path, u)["generated"]) for u in urls]

        def landed(execution_id: str) -> int:
            before = served()
            proxy.call(execution_id)
            diff = [a - b for a, b in zip(served(), before)]
            assert sorted(diff) == [0] * (NUM_RANKS - 1) + [1], diff
            return diff.index(1)

        # Sessions spread over the servers; each one stays on its own.
        a, b, c = landed("ex-a"), landed("ex-b"), landed("ex-c")
        assert sorted([a, b, c]) == [0, 1, 2]
        assert [landed("ex-a"), landed("ex-b"), landed("ex-a"), landed("ex-c")] == [a, b, a, c]

        # Server b dies: its session moves to a live server and stays there; a new one avoids it.
        os.killpg(recs[b]["pid"], signal.SIGKILL)
        moved = landed("ex-b")
        assert moved != b and landed("ex-b") == moved
        assert proxy.lt.call(proxy.server.router.sticky_url, "ex-b", "") == urls[moved]
        assert landed("ex-d") != b

        # The leader's next switch names the dead server and still updates the others.
        (tmp_path / "stop").touch()
        final = wait_for(tmp_path / "final.json", procs)
        assert f"update_weights: 1 of {NUM_RANKS} server(s) failed: server {b} ({urls[b]})" in final["after_kill"]
        assert final["versions_after_kill"] == [2 if i == b else 3 for i in range(NUM_RANKS)]
        # The cell's heartbeat names the dead server; the controller's routes leave it out.
        beat = wire.decode(wire.encode(wire.Heartbeat(cell_id=1, phase="serving", num_running=0, weight_version=3,
                                                      down_urls=final["down_urls"])))
        assert beat.down_urls == [urls[b]]
        assert cells.cells[1].set_down(beat.down_urls) == ([urls[b]], [])
        assert [u for _, u, _ in cells.routes()] == [u for i, u in enumerate(urls) if i != b]
        for rank, p in enumerate(procs):
            assert p.wait(timeout=60) == 0, f"rank {rank}: {rank_log(procs, rank)}"
    finally:
        if proxy is not None:
            proxy.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_a_server_over_two_nodes_is_joined_by_its_second_nodes_rank(tmp_path):
    """Two one-rank nodes, a server over both: rank 1 starts the second node's part, which joins
    the first with SGLang's own multi-node flags; the leader drives the one HTTP front."""
    # The config refuses /tmp for servers over nodes (node-local on a cluster); these "nodes" are
    # one machine, so any other folder is shared.
    weights = Path(tempfile.mkdtemp(prefix="gyre-test-weights-", dir="/var/tmp"))
    procs = start_ranks(tmp_path, "engine.nnodes=2", "engine.tp_size=2", world=2, per_node=1, weight_dir=weights)
    try:
        leader = wait_for(tmp_path / "leader.json", procs)
        assert len(leader["urls"]) == 1 and leader["version"] == 2
        front = record(tmp_path, leader["urls"][0])
        (joiner,) = [json.loads(p.read_text()) for p in tmp_path.glob("record-*.json")
                     if json.loads(p.read_text())["argv"] != front["argv"]]
        flags = [dict(zip(r["argv"], r["argv"][1:])) for r in (front, joiner)]
        assert [(f["--nnodes"], f["--node-rank"]) for f in flags] == [("2", "0"), ("2", "1")]
        assert flags[0]["--dist-init-addr"] == flags[1]["--dist-init-addr"] == "127.0.0.1:29700"  # the first node's
        assert [x["version"] for x in front["loaded"]] == ["0", "1", "2"] and front["released"] == []
        assert joiner["calls"] == []  # SGLang drives a server's other nodes itself
        (tmp_path / "stop").touch()
        final = wait_for(tmp_path / "final.json", procs)
        assert final["after_kill"] == "ok" and final["versions_after_kill"] == [3]
        for rank, p in enumerate(procs):
            assert p.wait(timeout=60) == 0, f"rank {rank}: {rank_log(procs, rank)}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        shutil.rmtree(weights, ignore_errors=True)
