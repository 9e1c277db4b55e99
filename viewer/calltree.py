"""One execution's call tree as the processor built it, and what of it trained.

The tree, the cap and the targets come from the processor's own pure functions
(``TokenTree.insert`` in log order, ``sampling.select``, ``samples.build_sequences``); whether the
execution trained at all comes from the processor's state machine run over the log (``LogScan``):
a cut, eval, crashed or dropped execution sends nothing, whatever its tree holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from base import wire
from trajectory.samples import build_sequences
from trajectory.sampling import select
from trajectory.tree import Edge, TokenTree, Trajectory
from viewer.runfolder import Run


@dataclass
class CallTree:
    records: list[wire.CallRecord]
    tree: TokenTree
    trajectories: list[Trajectory]
    kept: list[Trajectory] | None
    """In rank order; None when the run's cap is not known (no processor.json)."""
    targets: dict[int, int]
    """id(kept trajectory) -> policy tokens it trains (each trained by the first kept chain holding it)."""
    num_targets: int
    """Targets of ``build_sequences`` over the kept trajectories: what the tree trains when it trains."""
    sent_targets: int | None
    """Targets the processor sent to train for this execution; None when not known."""
    refused: list[str]
    grade: wire.Grade | None
    sealed: wire.ExecutionSealed | None

    @property
    def trained_edges(self) -> set[Edge]:
        if not self.sent_targets or not self.kept:
            return set()
        return {e for t in self.kept for e in t.edges}


def build(run: Run, execution_id: str) -> CallTree:
    records = run.records(execution_id)
    tree = TokenTree(execution_id)
    refused = []
    for r in records:
        try:
            tree.insert(r)
        except ValueError as exc:
            refused.append(f"{r.call_id}: {exc}")
    trajectories = tree.trajectories()
    kept = select(trajectories, max_trajectories=run.config.algo.max_trajectories_per_execution) if run.config else None
    targets: dict[int, int] = {}
    claimed: set[Edge] = set()
    for t in kept or []:  # the dedup rule of samples.build_sequences, per trajectory, for the table
        targets[id(t)] = sum(e.num_policy for e in t.edges if e not in claimed)
        claimed.update(t.edges)
    num_targets = sum(sum(s.target_mask) for s in build_sequences(execution_id, kept or [], advantage=0.0))
    scan = run.scan_of(execution_id)
    sent = scan.targets.get(execution_id, 0) if scan is not None and scan.processor is not None else None
    return CallTree(records=records, tree=tree, trajectories=trajectories, kept=kept, targets=targets,
                    num_targets=num_targets, sent_targets=sent, refused=refused,
                    grade=scan.grades.get(execution_id) if scan else None,
                    sealed=scan.sealed.get(execution_id) if scan else None)


def edge_lineages(tree: TokenTree, edge: Edge) -> list[str]:
    """The lineages of the calls that generated or end on this edge."""
    calls = {int(c) for c in edge.calls if c >= 0} | set(edge.end_calls)
    return sorted({tree.calls[c].lineage for c in calls})


def edge_agents(tree: TokenTree, edge: Edge) -> list[str]:
    return sorted({tree.calls[int(c)].agent_id for c in edge.calls if c >= 0} - {""})
