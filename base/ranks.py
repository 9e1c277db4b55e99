"""Where this process sits in its cell: rank, world size, node.

A cell is one process per node by default (the embedded trainer and engine). A Megatron cell is
one process per GPU: ``cluster.ranks_per_node`` processes on each of the cell's nodes, started
by the cell's launcher (``controller.slurm_launch`` under srun, ``cellrunner.local_ranks`` here)
with the variables torchrun uses (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) plus ``GYRE_NODE_RANK`` / ``GYRE_NNODES``. Rank 0 is the cell's *leader*: it alone
talks to the controller; ranks 1..n-1 are *followers* that mirror its trainer calls
(``cellrunner.spmd_trainer``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

NODE_RANK_ENV = "GYRE_NODE_RANK"
NNODES_ENV = "GYRE_NNODES"


@dataclass(frozen=True, slots=True)
class CellRanks:
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    nnodes: int
    master_addr: str
    """The leader's host: the process-group rendezvous and SGLang's ``--dist-init-addr`` host."""

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def is_multi_rank(self) -> bool:
        return self.world_size > 1


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: want an integer") from None


def ranks_from_env(env: Mapping[str, str]) -> CellRanks:
    """Read and check the launcher's variables; none set means a one-process cell."""
    world = _int(env, "WORLD_SIZE", 1)
    rank = _int(env, "RANK", 0)
    local = _int(env, "LOCAL_RANK", rank)
    nnodes = _int(env, NNODES_ENV, 1)
    node = _int(env, NODE_RANK_ENV, 0)
    if world < 1:
        raise ValueError(f"WORLD_SIZE={world}: want >= 1")
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank}: want 0..{world - 1} (WORLD_SIZE={world})")
    if not 1 <= nnodes <= world:
        raise ValueError(f"{NNODES_ENV}={nnodes}: want 1..WORLD_SIZE ({world})")
    if world % nnodes:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of {NNODES_ENV}={nnodes}: "
                         "every node of a cell runs the same number of ranks")
    if not 0 <= node < nnodes:
        raise ValueError(f"{NODE_RANK_ENV}={node}: want 0..{nnodes - 1}")
    if not 0 <= local < world // nnodes:
        raise ValueError(f"LOCAL_RANK={local}: want 0..{world // nnodes - 1}")
    if node * (world // nnodes) + local != rank:
        raise ValueError(f"RANK={rank} is not node {node} x {world // nnodes} ranks + LOCAL_RANK {local}: "
                         "ranks must be numbered node by node")
    addr = env.get("MASTER_ADDR", "")
    if world > 1 and (not addr or not env.get("MASTER_PORT")):
        raise ValueError("a multi-rank cell needs MASTER_ADDR and MASTER_PORT (the leader's rendezvous)")
    return CellRanks(rank=rank, world_size=world, local_rank=local, node_rank=node, nnodes=nnodes,
                     master_addr=addr or "127.0.0.1")


def rank_env(*, rank: int, world_size: int, ranks_per_node: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The variables a launcher sets for ``rank`` of a cell (the inverse of ``ranks_from_env``)."""
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % ranks_per_node),
        NODE_RANK_ENV: str(rank // ranks_per_node), NNODES_ENV: str(world_size // ranks_per_node),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
    }
