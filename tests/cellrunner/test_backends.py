"""cellrunner.backends: what a cell's ranks are allowed to be, and which one starts which part of
which of the cell's SGLang servers (nothing is started here; the launch command is checked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cellrunner.backends import CellRunnerConfig, check_ranks, make_engine, make_node_engine, serving_part
from cellrunner.engine import EmbeddedEngine
from cellrunner.engine_sglang import SGLangEngine, launch_command
from base.ranks import rank_env, ranks_from_env
from cellrunner.servers import ServerPart
from controller.controller import cellrunner_config
from base.typed_config import build
from tests.controller.test_config import load


def cell_cfg(tmp_path: Path, *overrides: str) -> CellRunnerConfig:
    return build(CellRunnerConfig, cellrunner_config(load(*overrides), checkpoint_dir=tmp_path, log_dir=tmp_path))


def ranks(rank: int, world: int = 8, per_node: int = 4):
    return ranks_from_env(rank_env(rank=rank, world_size=world, ranks_per_node=per_node, master_addr="10.0.0.1",
                                   master_port=29500))


SHARED = "engine.weight_dir=/shared/w"


def test_a_multi_rank_cell_needs_megatron_and_servers_that_tile_it(tmp_path):
    with pytest.raises(ValueError, match="trainer=embedded runs one process per cell"):
        check_ranks(cell_cfg(tmp_path), ranks(0))
    # 2 nodes x 4 ranks, TP1 servers: eight servers, but those on node 1 cannot read node 0's /dev/shm
    with pytest.raises(ValueError, match="weight_dir=/dev/shm/gyre is node-local.*other 1 node"):
        check_ranks(cell_cfg(tmp_path, "trainer=megatron", "engine=sglang"), ranks(0))
    check_ranks(cell_cfg(tmp_path, "trainer=megatron", "engine=sglang", SHARED), ranks(0))
    with pytest.raises(ValueError, match="a one-node server of 3 GPUs .* does not divide a node's 4"):
        check_ranks(cell_cfg(tmp_path, "trainer=megatron", "engine=sglang", "engine.tp_size=3", SHARED), ranks(0))
    with pytest.raises(ValueError, match="a server over 2 nodes uses 4 GPUs .*, not the 8"):
        check_ranks(cell_cfg(tmp_path, "trainer=megatron", "engine=sglang", "engine.nnodes=2", "engine.tp_size=4",
                             SHARED), ranks(0))
    check_ranks(cell_cfg(tmp_path, "trainer=megatron", "engine=sglang", "engine.nnodes=2", "engine.tp_size=8", SHARED),
                ranks(5))
    # one node, one process: one server, on that node
    with pytest.raises(ValueError, match="engine.nnodes=2, but this cell is one process on one node"):
        check_ranks(cell_cfg(tmp_path, "engine=sglang", "engine.nnodes=2", SHARED), ranks_from_env({}))
    check_ranks(cell_cfg(tmp_path, "engine=sglang"), ranks_from_env({}))
    check_ranks(cell_cfg(tmp_path), ranks_from_env({}))  # the embedded default: one process


def parts(cfg: CellRunnerConfig, world: int, per_node: int) -> list:
    return [serving_part(cfg, ranks(r, world, per_node)) for r in range(world)]


def test_which_rank_starts_which_server(tmp_path):
    # 2 nodes x 4 ranks, servers of 2 GPUs: four, two a node, from local ranks 0 and 2
    cfg = cell_cfg(tmp_path, "trainer=megatron", "engine=sglang", "engine.tp_size=2", SHARED)
    assert [p and (p.server, p.node_rank, p.base_gpu_id) for p in parts(cfg, 8, 4)] == [
        (0, 0, 0), None, (1, 0, 2), None, (2, 0, 0), None, (3, 0, 2), None]
    # 4 nodes x 2 ranks, servers over 2 nodes: two, each joined by its second node's local rank 0
    cfg = cell_cfg(tmp_path, "trainer=megatron", "engine=sglang", "engine.nnodes=2", "engine.tp_size=4", SHARED)
    assert parts(cfg, 8, 2) == [ServerPart(0, 0, 0, 0), None, ServerPart(0, 1, 0, 0), None,
                                ServerPart(1, 0, 0, 2), None, ServerPart(1, 1, 0, 2), None]
    assert serving_part(cell_cfg(tmp_path, "trainer=megatron"), ranks(4)) is None  # the embedded engine
    assert serving_part(cell_cfg(tmp_path, "engine=sglang"), ranks_from_env({})) == ServerPart(0, 0, 0, 0)
    # a part's command: its GPUs, and SGLang's own multi-node join
    cmd = launch_command(cfg.engine, model_path="/m", host="10.0.0.3", port=30000, max_running=8, seed=0,
                         dummy_weights=True, node_rank=1, dist_init_addr="10.0.0.3:29701", base_gpu_id=4)
    flags = dict(zip(cmd[3:], cmd[4:]))
    assert (flags["--nnodes"], flags["--node-rank"], flags["--dist-init-addr"]) == ("2", "1", "10.0.0.3:29701")
    assert flags["--base-gpu-id"] == "4"
    assert "--base-gpu-id" not in launch_command(cfg.engine, model_path="/m", host="h", port=1, max_running=1,
                                                 seed=0, dummy_weights=True, node_rank=0, dist_init_addr="a:1")


def test_the_embedded_engine_is_the_leaders_alone(tmp_path):
    assert make_node_engine(cell_cfg(tmp_path, "trainer=megatron"), 300, 1, ranks(4)) is None
    assert isinstance(make_engine(cell_cfg(tmp_path), 300, 1), EmbeddedEngine)
    engine = make_engine(cell_cfg(tmp_path, "engine=sglang"), 300, 1)  # one process: its one server
    assert isinstance(engine, SGLangEngine) and engine.urls == [engine.url] and engine.url.startswith("http://")


def test_each_part_meets_at_its_servers_first_node(tmp_path):
    """The rendezvous of server k is its first node's address, on a port of its own."""
    from cellrunner.backends import _part_process

    cfg = cell_cfg(tmp_path, "trainer=megatron", "engine=sglang", "engine.nnodes=2", "engine.tp_size=4", SHARED,
                   "cluster.host=127.0.0.1")
    hosts = [f"10.0.0.{1 + r // 2}" for r in range(8)]  # 4 nodes x 2 ranks, one address a node
    got = []
    for r in (2, 6):  # node 1 joins server 0, node 3 joins server 1
        part = serving_part(cfg, ranks(r, 8, 2))
        proc = _part_process(cfg, 300, 1, ranks(r, 8, 2), part, hosts, "")
        got.append((proc.server, proc.node_rank, proc.dist_init_addr))
    port = cfg.engine.dist_init_port
    assert got == [(0, 1, f"10.0.0.1:{port}"), (1, 1, f"10.0.0.3:{port + 1}")]
