"""cellrunner.backends: what a cell's ranks are allowed to be, and which one runs which part of
a multi-node SGLang server (nothing is started here; the launch command is checked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cellrunner.backends import CellRunnerConfig, check_ranks, make_engine, make_node_engine
from cellrunner.engine import EmbeddedEngine
from cellrunner.engine_sglang import SGLangEngine, launch_command
from cellrunner.ranks import rank_env, ranks_from_env
from controller.controller import cellrunner_config
from controller.typed_config import build
from tests.controller.test_config import load


def cell_cfg(tmp_path: Path, *overrides: str) -> CellRunnerConfig:
    return build(CellRunnerConfig, cellrunner_config(load(*overrides), checkpoint_dir=tmp_path, log_dir=tmp_path))


def ranks(rank: int, world: int = 8, per_node: int = 4):
    return ranks_from_env(rank_env(rank=rank, world_size=world, ranks_per_node=per_node, master_addr="10.0.0.1",
                                   master_port=29500))


def test_a_multi_rank_cell_needs_megatron_and_a_server_spanning_its_nodes(tmp_path):
    with pytest.raises(ValueError, match="trainer=embedded runs one process per cell"):
        check_ranks(cell_cfg(tmp_path), ranks(0))
    with pytest.raises(ValueError, match="engine.nnodes=1, but the cell has 2 node"):
        check_ranks(cell_cfg(tmp_path, "trainer=megatron", "engine=sglang"), ranks(0))
    check_ranks(cell_cfg(tmp_path, "trainer=megatron", "engine=sglang", "engine.nnodes=2", "engine.weight_dir=/shared/w"), ranks(5))
    check_ranks(cell_cfg(tmp_path), ranks_from_env({}))  # the embedded default: one process


def test_each_node_runs_its_part_of_the_cells_sglang_server(tmp_path):
    cfg = cell_cfg(tmp_path, "trainer=megatron", "engine=sglang", "engine.nnodes=2", "engine.weight_dir=/shared/w")
    leader = make_engine(cfg, 300, 1, ranks(0))
    assert isinstance(leader, SGLangEngine) and leader.serves_http
    assert make_node_engine(cfg, 300, 1, ranks(1)) is None  # node 0's other ranks: rank 0 runs it
    assert make_node_engine(cfg, 300, 1, ranks(5)) is None  # node 1, local rank 1
    other = make_node_engine(cfg, 300, 1, ranks(4))  # node 1, local rank 0
    assert isinstance(other, SGLangEngine) and not other.serves_http
    cmd = launch_command(cfg.engine, model_path="/m", host="10.0.0.2", port=30000, max_running=8, seed=0,
                         dummy_weights=True, node_rank=other._node_rank, dist_init_addr=other._dist_init_addr)
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--node-rank") + 1] == "1"
    assert cmd[cmd.index("--dist-init-addr") + 1] == f"10.0.0.1:{cfg.engine.dist_init_port}"
    # one node per cell: no node engines, and the embedded engine is the leader's alone
    assert make_node_engine(cell_cfg(tmp_path, "trainer=megatron"), 300, 1, ranks(4)) is None
    assert isinstance(make_engine(cell_cfg(tmp_path), 300, 1), EmbeddedEngine)
