"""Which ranks of a cell run which SGLang servers: the pure placement, shared by the cellrunner
(who starts what) and ``controller.layout`` (how many servers a cell runs).

SGLang refuses ``dp_size > 1`` across nodes, so a cell larger than one server runs several
independent servers, and the proxy routes among them. A server either spans ``server_nodes``
whole nodes (its ``tp*pp*dp`` GPUs fill them; SGLang's own ``--nnodes/--node-rank/--dist-init-addr``
join the nodes), or sits on one node, where ``gpus_per_node / gpus_per_server`` of them share it,
each from its own ``--base-gpu-id``. Servers are numbered node by node, as the cell's ranks are
(``base.ranks``: one rank per GPU), and each part of a server is started by the rank of its
first GPU on that node. The part on a server's first node serves HTTP; rank 0, the cell's
leader, always starts server 0's.
"""

from __future__ import annotations

from dataclasses import dataclass

NODE_LOCAL_DIRS = ("/dev/shm", "/tmp", "/run")
"""Folders each node has its own of (cellrunner.config.SGLangConfig refuses them for multi-node servers)."""


def engine_pp_of(extra_args: tuple[str, ...] | list[str]) -> int:
    """SGLang's pipeline stages: Gyre's config has no field for them, so ``--pp-size`` travels in
    ``engine.extra_args``."""
    args = list(extra_args)
    for i, a in enumerate(args):
        for flag in ("--pp-size", "--pipeline-parallel-size"):
            if a == flag and i + 1 < len(args):
                return int(args[i + 1])
            if a.startswith(flag + "="):
                return int(a.split("=", 1)[1])
    return 1


@dataclass(frozen=True, slots=True)
class ServerPart:
    """One rank's share of serving: one node's part of one server."""

    server: int
    """The server's index in the cell (its URL's place in the cell's list)."""
    node_rank: int
    """SGLang's ``--node-rank`` inside the server (0 serves HTTP)."""
    base_gpu_id: int
    """SGLang's ``--base-gpu-id``: the server's first GPU on this node."""
    first_node: int
    """The cell's node that serves the server's HTTP and hosts its ``--dist-init-addr``."""

    @property
    def serves_http(self) -> bool:
        return self.node_rank == 0


def placement_problem(*, cell_nodes: int, gpus_per_node: int, server_nodes: int, gpus_per_server: int) -> str:
    """Why servers of ``gpus_per_server`` GPUs over ``server_nodes`` nodes do not tile a cell of
    ``cell_nodes`` nodes x ``gpus_per_node`` GPUs ("" when they do)."""
    if min(cell_nodes, gpus_per_node, server_nodes, gpus_per_server) < 1:
        return "every count must be >= 1"
    if cell_nodes % server_nodes:
        return f"a cell's {cell_nodes} nodes do not split into servers of {server_nodes} nodes"
    if server_nodes > 1 and gpus_per_server != server_nodes * gpus_per_node:
        return (f"a server over {server_nodes} nodes uses {gpus_per_server} GPUs (tp*pp*dp), not the "
                f"{server_nodes * gpus_per_node} those nodes have")
    if server_nodes == 1 and gpus_per_node % gpus_per_server:
        return f"a one-node server of {gpus_per_server} GPUs (tp*pp*dp) does not divide a node's {gpus_per_node}"
    return ""


def num_servers(*, cell_nodes: int, gpus_per_node: int, server_nodes: int, gpus_per_server: int) -> int:
    """How many servers the cell runs; ValueError naming the rule when they do not tile it."""
    problem = placement_problem(cell_nodes=cell_nodes, gpus_per_node=gpus_per_node, server_nodes=server_nodes,
                                gpus_per_server=gpus_per_server)
    if problem:
        raise ValueError(problem)
    if server_nodes > 1:
        return cell_nodes // server_nodes
    return cell_nodes * (gpus_per_node // gpus_per_server)


def part_of_rank(rank: int, *, cell_nodes: int, gpus_per_node: int, server_nodes: int,
                 gpus_per_server: int) -> ServerPart | None:
    """The part of a server ``rank`` starts, or None (one rank per GPU, numbered node by node)."""
    num_servers(cell_nodes=cell_nodes, gpus_per_node=gpus_per_node, server_nodes=server_nodes,
                gpus_per_server=gpus_per_server)
    if not 0 <= rank < cell_nodes * gpus_per_node:
        raise ValueError(f"rank {rank}: want 0..{cell_nodes * gpus_per_node - 1}")
    node, local = divmod(rank, gpus_per_node)
    if server_nodes > 1:
        if local:
            return None
        server, node_rank = divmod(node, server_nodes)
        return ServerPart(server=server, node_rank=node_rank, base_gpu_id=0, first_node=server * server_nodes)
    if local % gpus_per_server:
        return None
    per_node = gpus_per_node // gpus_per_server
    return ServerPart(server=node * per_node + local // gpus_per_server, node_rank=0, base_gpu_id=local,
                      first_node=node)
