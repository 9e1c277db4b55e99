"""base.ranks: the launcher's variables in, a checked CellRanks out."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from base.ranks import CellRanks, rank_env, ranks_from_env


def test_no_variables_is_a_one_process_cell():
    r = ranks_from_env({})
    assert r == CellRanks(rank=0, world_size=1, local_rank=0, node_rank=0, nnodes=1, master_addr="127.0.0.1")
    assert r.is_leader and not r.is_multi_rank


@given(nnodes=st.integers(1, 6), per_node=st.integers(1, 8), data=st.data())
def test_launcher_variables_round_trip(nnodes, per_node, data):
    world = nnodes * per_node
    rank = data.draw(st.integers(0, world - 1))
    r = ranks_from_env(rank_env(rank=rank, world_size=world, ranks_per_node=per_node, master_addr="10.0.0.1",
                                master_port=29501))
    assert (r.rank, r.world_size, r.nnodes) == (rank, world, nnodes)
    assert r.node_rank * per_node + r.local_rank == rank
    assert r.master_addr == "10.0.0.1" and r.is_leader == (rank == 0)


GOOD = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "GYRE_NODE_RANK": "1", "GYRE_NNODES": "2",
        "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("over, match", [
    ({"RANK": "x"}, "RANK='x': want an integer"),
    ({"RANK": "4"}, "RANK=4: want 0..3"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0"),
    ({"GYRE_NNODES": "3"}, "not a multiple"),
    ({"GYRE_NODE_RANK": "2"}, "GYRE_NODE_RANK=2"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2"),
    ({"LOCAL_RANK": "0"}, "node by node"),  # rank 3 on node 1 must be local rank 1
    ({"MASTER_PORT": ""}, "MASTER_ADDR and MASTER_PORT"),
])
def test_bad_variables_are_refused_with_the_reason(over, match):
    assert ranks_from_env(GOOD).rank == 3
    with pytest.raises(ValueError, match=match):
        ranks_from_env({**GOOD, **over})
