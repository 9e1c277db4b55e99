"""Cells as Slurm job steps: the node list -> cells split, and both ends of one cell's `srun` step.

Controller end (inside an allocation: `sbatch slurm/gyre_*.sbatch`, or `launcher=submitit`):
``SlurmCells.from_env`` reads the job's node list, splits it into ``num_cells`` equal groups, and
``launch`` starts one ``srun`` step per cell on that cell's nodes, ``cluster.ranks_per_node`` tasks
per node (one per GPU for a Megatron cell, else one). The returned
object is a ``subprocess.Popen`` of the ``srun`` client, so the controller supervises it like a
local cellrunner: a step that dies (``scancel`` of the step, a node set DOWN) ends ``srun`` with a
non-zero code and the controller drops the cell.

Step end (``python -m controller.slurm_launch --cell-nodes n3,n4 --ranks R -- <cellrunner args>``):
every task checks that ``SLURM_STEP_NODELIST`` is the cell's node set. Tasks ``0..R-1`` become the
cell's ranks: the cellrunner with the torchrun variables of ``base.ranks`` (rank 0 leads,
the others follow; the process group meets at node 1's ``dist_port + cell_id``). An embedded cell
has R = 1, so the other tasks end at once and the step just holds their nodes.

Ports: every Gyre process binds port 0 and reports the port it got, so cells on virtual nodes
that share one host never collide. ``cluster.host: auto`` makes each process bind to its own
node's address (a hostname lookup); ``127.0.0.1`` is for virtual nodes on one machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from base.ranks import NNODES_ENV, NODE_RANK_ENV
from base.lifecycle import PARENT_PID_ENV
from controller.processes import StartError, python_path

log = logging.getLogger(__name__)

AUTO_HOST = "auto"
STEP_NAME_PREFIX = "gyre-cell"
POLITE_EXIT_S = 2.0
"""How long a step may take to end by itself before SIGTERM is sent to its tasks."""


# ==================================================================== pure: node list -> cells

def split_cells(nodes: list[str], num_cells: int) -> list[list[str]]:
    """Equal groups of consecutive nodes, in the order Slurm lists them. Cell 0 holds the first
    node, where the controller, proxy and processor run. Nodes beyond ``num_cells * (len // num_cells)``
    are left idle (an allocation of 30 nodes for 4 cells gives 4 x 7, two spare)."""
    if num_cells < 1:
        raise ValueError("num_cells: want >= 1")
    per_cell = len(nodes) // num_cells
    if per_cell < 1:
        raise ValueError(f"{len(nodes)} node(s) cannot hold {num_cells} cells: want >= 1 node per cell")
    return [nodes[i * per_cell:(i + 1) * per_cell] for i in range(num_cells)]


def srun_argv(*, job_id: str, cell_id: int, nodes: list[str], python: str, cell_args: list[str],
              extra_args: list[str], ranks_per_node: int = 1, cell_ranks: int = 1, dist_port: int = 0) -> list[str]:
    """The ``srun`` command of one cell's step (Slurm 22.05 flags, see shared/notes/slurm-local.md).

    - ``--nodes/--ntasks/--ntasks-per-node``: ``ranks_per_node`` tasks on every node of the cell
      (srun refuses fewer tasks than nodes, so the cell's nodes are held by tasks, not just
      named); ``--distribution=block`` numbers them node by node, as ``base.ranks`` checks.
    - ``--ranks``/``--dist-port`` to the step end: how many tasks are the cell's ranks, and where
      their process group meets.
    - ``--nodelist``: exactly this cell's nodes; never ``--exact``, so a step gets every CPU (and,
      on clusters, every GPU the job asked for per node) of its nodes.
    - ``--overlap``: the step may share node 1 with the step that runs the controller when the
      controller itself runs in a step (``srun gyre ...`` or submitit with srun); otherwise cell 0
      would wait forever for "busy" nodes.
    - ``--kill-on-bad-exit=1``: one task failing ends the whole step, so the cell dies as a unit.
    - ``--job-name``: the step's name, so ``stop`` can find its step id for a graceful signal.
    - ``extra_args`` (``GYRE_SRUN_ARGS``) last, so a site can add or override flags (containers).
    """
    return [
        "srun", f"--jobid={job_id}", f"--job-name={STEP_NAME_PREFIX}{cell_id}",
        f"--nodes={len(nodes)}", f"--ntasks={len(nodes) * ranks_per_node}", f"--ntasks-per-node={ranks_per_node}",
        "--distribution=block", f"--nodelist={','.join(nodes)}", "--overlap", "--kill-on-bad-exit=1", "--unbuffered",
        *extra_args, python, "-m", "controller.slurm_launch", "--cell-nodes", ",".join(nodes),
        "--ranks", str(cell_ranks), "--dist-port", str(dist_port), "--", *cell_args,
    ]


def resolve_host(host: str) -> str:
    """The address this process binds to: ``cluster.host`` itself, or for ``auto`` this node's."""
    if host != AUTO_HOST:
        return host
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError as exc:
        raise StartError(f"cluster.host=auto: cannot resolve this node's name {name!r} ({exc}); "
                         "set cluster.host to an address every node can reach") from None


# ==================================================================== controller end

def expand_nodelist(nodelist: str) -> list[str]:
    """``n[1-3],m5`` -> ``['n1', 'n2', 'n3', 'm5']``, by asking Slurm (its hostlist syntax has
    more forms than are worth re-implementing)."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True,
                             text=True, timeout=30)
    except FileNotFoundError:
        raise StartError("cluster=slurm: `scontrol` is not on PATH (is this a Slurm node?)") from None
    except subprocess.CalledProcessError as exc:
        raise StartError(f"scontrol show hostnames {nodelist!r} failed: {exc.stderr.strip()}") from None
    except subprocess.TimeoutExpired:  # an overloaded node: say so, not a traceback from every rank
        raise StartError(f"scontrol show hostnames {nodelist!r} did not answer within 30 s") from None
    nodes = out.stdout.split()
    if not nodes:
        raise StartError(f"scontrol show hostnames {nodelist!r} printed no node")
    return nodes


class SrunStep(subprocess.Popen):
    """The ``srun`` client of one cell's step, supervised like a local process.

    ``srun`` answers SIGTERM by cancelling its step at once (tasks are SIGKILLed), which would cost
    the core its final checkpoint. So a polite signal goes to the step's tasks through
    ``scancel --signal`` instead, and only ``kill`` cancels the step.
    """

    def __init__(self, argv: list[str], *, job_id: str, step_name: str, **kwargs):
        self.job_id = job_id
        self.step_name = step_name
        super().__init__(argv, **kwargs)

    def step_id(self) -> str | None:
        """``<job>.<step>`` of this cell's step, or None if Slurm does not list it (yet, or any more)."""
        try:
            out = subprocess.run(["squeue", "--steps", "--noheader", f"--jobs={self.job_id}", "--format=%i %j"],
                                 capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            return None
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == self.step_name:
                return parts[0]
        return None

    def send_signal(self, sig: int) -> None:
        if sig == signal.SIGTERM:
            # The controller sends Shutdown over the wire just before stopping; a cell that ends on
            # its own is COMPLETED in sacct, one signalled through scancel is CANCELLED.
            try:
                self.wait(timeout=POLITE_EXIT_S)
            except subprocess.TimeoutExpired:
                pass
        if self.poll() is not None:
            return
        step = self.step_id() if sig != signal.SIGKILL else None
        if step is None:
            super().send_signal(signal.SIGTERM)  # srun: cancel the step now
            return
        # Tasks that already ended make scancel complain; the live ones still get the signal.
        try:
            subprocess.run(["scancel", f"--signal={signal.Signals(sig).name.removeprefix('SIG')}", step],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=15, check=False)
        except (OSError, subprocess.TimeoutExpired):
            super().send_signal(signal.SIGTERM)  # Slurm does not answer: cancel the step through srun

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.poll() is None:
            super().send_signal(signal.SIGTERM)  # srun cancels the step; a SIGKILLed srun would orphan it


@dataclass(frozen=True)
class SlurmCells:
    """Launches each cell as an ``srun`` step of the current job on the cell's own nodes."""

    job_id: str
    nodes: tuple[str, ...]
    cells: tuple[tuple[str, ...], ...]
    srun_extra_args: tuple[str, ...]
    """From ``GYRE_SRUN_ARGS`` (shell words), set by the sbatch script: site flags every cell's step
    needs, such as ``--container-image=...`` (pyxis) that Slurm takes only on srun's command line."""
    ranks_per_node: int = 1
    multi_rank: bool = False
    """Every task is a rank of the cell (``trainer=megatron``); else task 0 alone runs it."""
    dist_port: int = 29500

    def cell_ranks(self, cell_id: int) -> int:
        return len(self.cells[cell_id]) * self.ranks_per_node if self.multi_rank else 1

    @classmethod
    def from_env(cls, num_cells: int, env: Mapping[str, str] | None = None, *, ranks_per_node: int = 1,
                 multi_rank: bool = False, dist_port: int = 29500) -> SlurmCells:
        env = os.environ if env is None else env
        job_id, nodelist = env.get("SLURM_JOB_ID"), env.get("SLURM_JOB_NODELIST")
        if not job_id or not nodelist:
            raise StartError("cluster=slurm runs inside a Slurm allocation (sbatch slurm/gyre_local.sbatch, "
                             "or launcher=submitit): SLURM_JOB_ID / SLURM_JOB_NODELIST are not set")
        nodes = expand_nodelist(nodelist)
        try:
            groups = split_cells(nodes, num_cells)
        except ValueError as exc:
            raise StartError(f"cluster=slurm: {exc} (SLURM_JOB_NODELIST={nodelist})") from None
        spare = nodes[len(groups) * len(groups[0]):]
        if spare:
            log.warning("slurm: %d node(s) left idle (%s): %d nodes do not split evenly into %d cells",
                        len(spare), ",".join(spare), len(nodes), num_cells)
        try:
            extra = shlex.split(env.get("GYRE_SRUN_ARGS", ""))
        except ValueError as exc:
            raise StartError(f"GYRE_SRUN_ARGS: {exc}") from None
        return cls(job_id=job_id, nodes=tuple(nodes), cells=tuple(tuple(g) for g in groups),
                   srun_extra_args=tuple(extra), ranks_per_node=ranks_per_node, multi_rank=multi_rank,
                   dist_port=dist_port)

    def launch(self, cell_id: int, cell_args: list[str], log_dir: Path) -> subprocess.Popen:
        nodes = list(self.cells[cell_id])
        argv = srun_argv(job_id=self.job_id, cell_id=cell_id, nodes=nodes, python=sys.executable, cell_args=cell_args,
                         extra_args=list(self.srun_extra_args), ranks_per_node=self.ranks_per_node,
                         cell_ranks=self.cell_ranks(cell_id), dist_port=self.dist_port + cell_id)
        log_dir.mkdir(parents=True, exist_ok=True)
        log.info("cell %d: srun step on %s", cell_id, ",".join(nodes))
        # A cell under srun is slurmstepd's child, not ours: it must not be told our pid.
        env = {k: v for k, v in os.environ.items() if k != PARENT_PID_ENV}
        env |= {"PYTHONPATH": python_path(), "PYTHONUNBUFFERED": "1"}
        with open(log_dir / f"cell{cell_id}.log", "wb") as out:
            return SrunStep(argv, job_id=self.job_id, step_name=f"{STEP_NAME_PREFIX}{cell_id}", stdout=out,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)


# ==================================================================== step end

def cell_nodes_tag(cell_nodes: str) -> str:
    """``n`` and 12 hex digits of the sha256 of a cell's comma-separated node list: a bounded,
    stable name for per-rank files (the same nodes give the same tag in every task)."""
    return "n" + hashlib.sha256(cell_nodes.encode()).hexdigest()[:12]


def bind_config_to_node(config_path: str, cell_nodes: str, rank: int = 0) -> str:
    """With ``host: auto`` the shared cellrunner config names no address: write this task's copy
    with the address of the node it runs on (every rank binds there: the leader its engine and
    sockets, each core rank its gradient inbox), and return its path. One file per rank: tasks on
    other nodes of the cell write theirs at the same moment, on a shared filesystem.

    The copy is named by a short hash of the cell's node list, not the list itself: a file name
    holds at most 255 bytes, and 48 joined node names are far more (cells hold disjoint nodes, so
    the hash and the rank keep every copy apart)."""
    cfg = json.loads(Path(config_path).read_text())
    if cfg.get("host") != AUTO_HOST:
        return config_path
    cfg["host"] = resolve_host(AUTO_HOST)
    path = Path(config_path).with_name(f"{Path(config_path).stem}.{cell_nodes_tag(cell_nodes)}.r{rank}.json")
    path.write_text(json.dumps(cfg, indent=1))
    return str(path)


def rank_env_of_task(env: Mapping[str, str], *, nodes: list[str], cell_ranks: int, master_addr: str,
                     dist_port: int) -> dict[str, str]:
    """The ``base.ranks`` variables of this srun task. Node and local rank come from Slurm
    (the node's place in the cell, ``SLURM_LOCALID``), so a task layout that is not node by node
    is caught by ``ranks_from_env``'s check rather than silently misnumbered."""
    node = env.get("SLURMD_NODENAME", "")
    if node not in nodes:
        raise ValueError(f"SLURMD_NODENAME={node!r} is not one of the cell's nodes {nodes}")
    return {
        "RANK": env.get("SLURM_PROCID", "0"), "WORLD_SIZE": str(cell_ranks),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"), NODE_RANK_ENV: str(nodes.index(node)),
        NNODES_ENV: str(len(nodes)), "MASTER_ADDR": master_addr, "MASTER_PORT": str(dist_port),
    }


def step_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one task of a cell's srun step")
    parser.add_argument("--cell-nodes", required=True, help="comma-separated nodes this cell was given")
    parser.add_argument("--ranks", type=int, default=1, help="tasks 0..ranks-1 are the cell's ranks")
    parser.add_argument("--dist-port", type=int, default=0, help="the cell's process-group port on its first node")
    parser.add_argument("cell_args", nargs=argparse.REMAINDER, help="-- then the cellrunner's arguments")
    args = parser.parse_args(argv)
    cell_args = args.cell_args[1:] if args.cell_args[:1] == ["--"] else args.cell_args
    expected = args.cell_nodes.split(",")
    step_nodelist = os.environ.get("SLURM_STEP_NODELIST")
    if not step_nodelist:
        sys.exit("slurm_launch: SLURM_STEP_NODELIST is not set: run this module only through srun")
    got = expand_nodelist(step_nodelist)
    if got != expected:
        sys.exit(f"slurm_launch: this step runs on {got}, the cell was given {expected}")
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    node = os.environ.get("SLURMD_NODENAME", "?")
    if rank >= args.ranks:
        print(f"slurm_launch: task {rank} on {node}: nothing to run here for a {args.ranks}-rank cell", flush=True)
        return
    host = AUTO_HOST
    if "--config-json" in cell_args:
        i = cell_args.index("--config-json") + 1
        host = json.loads(Path(cell_args[i]).read_text()).get("host", AUTO_HOST)
        cell_args[i] = bind_config_to_node(cell_args[i], args.cell_nodes, rank)
    if args.ranks > 1:
        try:
            master = host if host != AUTO_HOST else socket.gethostbyname(expected[0])
            os.environ.update(rank_env_of_task(os.environ, nodes=expected, cell_ranks=args.ranks, master_addr=master,
                                               dist_port=args.dist_port))
        except (OSError, ValueError) as exc:  # the cell's first node does not resolve, or a bad layout
            sys.exit(f"slurm_launch: cannot place rank {rank} of the cell: {exc}")
    print(f"slurm_launch: task {rank} on {node} of step {os.environ.get('SLURM_JOB_ID')}.{os.environ.get('SLURM_STEP_ID')} "
          f"(nodes {step_nodelist}) runs rank {rank} of {args.ranks} of the cell", flush=True)
    # exec, so signals from scancel/srun reach the cellrunner itself
    os.execv(sys.executable, [sys.executable, "-m", "cellrunner.main", *cell_args])


if __name__ == "__main__":
    step_main()
