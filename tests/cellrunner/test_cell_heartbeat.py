"""A cell whose work blocks keeps its heartbeats: a real CellRunner (embedded engine and trainer)
against a ROUTER standing in for the controller, with a switch whose drain blocks far longer
than a heartbeat timeout, as an offload, a full gather or SGLang's load do on a GPU."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import zmq

from bench.switch import load_config
from cellrunner.backends import CellRunnerConfig
from cellrunner.main import CellRunner
from base.ranks import CellRanks
from base import curve, wire
from controller.controller import cellrunner_config
from base.typed_config import build

INTERVAL_S = 0.1
TIMEOUT_S = 1.0  # the controller drops a cell silent this long (cluster.heartbeat_timeout_s)
BLOCK_S = 3.0


def test_a_cell_blocked_in_its_work_keeps_beating(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(curve, "_keys", None)  # plain sockets: no run keys in this process
    cfg = load_config([f"cluster.heartbeat_interval_s={INTERVAL_S}"])
    cell_cfg = build(CellRunnerConfig, cellrunner_config(cfg, checkpoint_dir=tmp_path / "ck", log_dir=tmp_path))
    cell_id = 1 if cfg.cluster.core_cell != 1 else 0  # a satellite: nothing to train or publish
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    runner = CellRunner(cell_cfg, cell_id, f"tcp://127.0.0.1:{port}",
                        CellRanks(rank=0, world_size=1, local_rank=0, node_rank=0, nnodes=1, master_addr="127.0.0.1"))
    blocked = threading.Event()

    def slow_drain(timeout_s: float) -> int:  # the cell's one thread, busy for BLOCK_S
        blocked.set()
        time.sleep(BLOCK_S)
        return 0

    runner.engine.drain = slow_drain
    runner.engine.release = lambda: None
    runner.start_satellite = lambda version: 0.0
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    got: list[tuple[float, wire.Message]] = []

    def receive_until(pred, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if router.poll(100):
                ident, frame = router.recv_multipart()
                msg = wire.decode(frame)
                got.append((time.monotonic(), msg))
                if pred(msg):
                    return ident
        raise AssertionError(f"timed out; got {[type(m).__name__ for _, m in got]}")

    try:
        ident = receive_until(lambda m: isinstance(m, wire.CellReady), 120)
        assert got[-1][1].engine_urls == [runner.engine.url]  # every server it serves through: its one
        receive_until(lambda m: isinstance(m, wire.Heartbeat), 5)
        assert ident == f"cell-{cell_id}".encode()  # one connection, the identity its Hello named
        sent = time.monotonic()
        router.send_multipart([ident, wire.encode(wire.SwitchRole(
            cell_id=cell_id, role="train", weight_version=0, core_weights_addr="", core_grads_addrs=[]))])
        receive_until(lambda m: isinstance(m, wire.RoleSwitched), BLOCK_S + 30)
        switched = got[-1][0]
        assert blocked.is_set() and switched - sent >= BLOCK_S
        beats = [t for t, m in got if isinstance(m, wire.Heartbeat) and sent <= t <= switched]
        during = [m for t, m in got if isinstance(m, wire.Heartbeat) and sent < t < sent + BLOCK_S]
        gaps = [round(b - a, 3) for a, b in zip([sent, *beats], [*beats, switched])]
        assert max(gaps) < TIMEOUT_S, gaps  # the controller never saw it silent for a timeout
        assert len(during) >= BLOCK_S / INTERVAL_S / 2 and {m.phase for m in during} == {"draining"}
        assert all(m.cell_id == cell_id for m in during)
        router.send_multipart([ident, wire.encode(wire.Shutdown(reason="test over"))])
        thread.join(30)
        assert not thread.is_alive()
    finally:
        runner.running = False
        thread.join(10)
        router.close()
