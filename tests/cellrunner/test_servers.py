"""cellrunner.servers: how a cell's GPUs split into SGLang servers, and which rank starts each part."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cellrunner.servers import ServerPart, num_servers, part_of_rank, placement_problem


def test_the_recipes_cells():
    # 48 nodes of 8 GPUs at TP 8: SGLang refuses DP across nodes, so 48 servers, one a node
    assert num_servers(cell_nodes=48, gpus_per_node=8, server_nodes=1, gpus_per_server=8) == 48
    assert num_servers(cell_nodes=48, gpus_per_node=8, server_nodes=2, gpus_per_server=16) == 24
    assert num_servers(cell_nodes=6, gpus_per_node=8, server_nodes=1, gpus_per_server=2) == 24
    with pytest.raises(ValueError, match="7 nodes do not split into servers of 2 nodes"):
        num_servers(cell_nodes=7, gpus_per_node=8, server_nodes=2, gpus_per_server=16)
    assert "not the 16 those nodes have" in placement_problem(cell_nodes=4, gpus_per_node=8, server_nodes=2,
                                                             gpus_per_server=8)
    assert "does not divide a node's 8" in placement_problem(cell_nodes=1, gpus_per_node=8, server_nodes=1,
                                                            gpus_per_server=3)


def test_a_rank_outside_the_cell_is_refused():
    with pytest.raises(ValueError, match="rank 8: want 0..7"):
        part_of_rank(8, cell_nodes=1, gpus_per_node=8, server_nodes=1, gpus_per_server=8)


@st.composite
def layouts(draw):
    gpus_per_node = draw(st.sampled_from([1, 2, 4, 8]))
    if draw(st.booleans()):
        server_nodes = draw(st.sampled_from([2, 3, 4]))
        return draw(st.integers(1, 4)) * server_nodes, gpus_per_node, server_nodes, server_nodes * gpus_per_node
    per_server = draw(st.sampled_from([d for d in (1, 2, 4, 8) if gpus_per_node % d == 0]))
    return draw(st.integers(1, 6)), gpus_per_node, 1, per_server


@given(layouts())
def test_every_server_is_started_once_on_every_node_it_spans(layout):
    cell_nodes, gpus_per_node, server_nodes, gpus_per_server = layout
    kw = dict(cell_nodes=cell_nodes, gpus_per_node=gpus_per_node, server_nodes=server_nodes,
              gpus_per_server=gpus_per_server)
    n = num_servers(**kw)
    assert n * gpus_per_server == cell_nodes * gpus_per_node  # every GPU serves, none twice
    got = [(r, part_of_rank(r, **kw)) for r in range(cell_nodes * gpus_per_node)]
    started = [(r, p) for r, p in got if p is not None]
    assert sorted((p.server, p.node_rank) for _, p in started) == [(s, k) for s in range(n) for k in range(server_nodes)]
    http = [p.server for _, p in started if p.serves_http]
    assert http == list(range(n))  # in rank order, as the leader lists the URLs
    assert got[0][1] == ServerPart(server=0, node_rank=0, base_gpu_id=0, first_node=0)  # the leader starts server 0
    for r, p in started:
        node, local = divmod(r, gpus_per_node)
        assert p.base_gpu_id == local and node == p.first_node + p.node_rank
        assert p.base_gpu_id + min(gpus_per_server, gpus_per_node) <= gpus_per_node
