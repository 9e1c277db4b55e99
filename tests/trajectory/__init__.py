"""Tests of the `trajectory` package, plus the few helpers its test files share.

Token ids are small and semantic so a failing sequence reads like a conversation: role markers
below 10, then one hundred per kind of text (1xx system, 2xx user, 3xx policy output, 4xx tool
results, 5xx compaction instruction, 6xx side calls, 7xx thinking).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from base.typed_config import build
from base.wire import CallRecord, ExecutionSealed, Grade, Lineage, Outcome
from base.algo_config import AlgoConfig
from trajectory.tree import TokenTree

REPO = Path(__file__).resolve().parents[2]
SYS, USER, ASSISTANT, TOOL, END = 1, 2, 3, 4, 5


def algo(*, max_tokens_per_microstep: int = 4096) -> AlgoConfig:
    """conf/algo/gspo.yaml as a typed config, with the microstep size a test wants."""
    data = yaml.safe_load((REPO / "conf" / "algo" / "gspo.yaml").read_text())
    data["max_tokens_per_microstep"] = max_tokens_per_microstep
    return build(AlgoConfig, data)


def record(
    execution_id: str,
    call_id: str,
    call_index: int,
    prompt: list[int],
    output: list[int],
    *,
    lineage: Lineage = "main",
    agent_id: str = "",
    logprob: float | list[float] = -0.5,
    weight_version: int = 0,
) -> CallRecord:
    lps = logprob if isinstance(logprob, list) else [logprob] * len(output)
    return CallRecord(
        execution_id=execution_id, call_id=call_id, call_index=call_index,
        prompt_ids=list(prompt), output_ids=list(output), output_logprobs=lps,
        weight_version=weight_version, cell_id=0,
        finish_reason="stop", lineage=lineage, agent_id=agent_id,
        started_at=0.0, finished_at=1.0,
    )


def grade(
    execution_id: str,
    group_id: str,
    reward: float | None,
    *,
    group_size: int,
    step: int = 0,
    outcome: Outcome = "finished",
    train: bool = True,
) -> Grade:
    return Grade(
        execution_id=execution_id, group_id=group_id, step=step, group_size=group_size,
        outcome=outcome, reward=reward, train=train,
    )


def sealed(execution_id: str, num_calls: int) -> ExecutionSealed:
    return ExecutionSealed(execution_id=execution_id, num_calls=num_calls)


class Run:
    """Builds one execution's CallRecords the way a harness makes calls: each ``call`` returns
    prompt + output, so the next prompt can extend it."""

    def __init__(self, execution_id: str) -> None:
        self.execution_id = execution_id
        self.records: list[CallRecord] = []

    def call(
        self,
        prompt: list[int],
        output: list[int],
        *,
        lineage: Lineage = "main",
        agent_id: str = "",
        logprob: float | list[float] = -0.5,
    ) -> list[int]:
        index = len(self.records)
        self.records.append(record(
            self.execution_id, f"{self.execution_id}/c{index}", index, prompt, output,
            lineage=lineage, agent_id=agent_id, logprob=logprob,
        ))
        return list(prompt) + list(output)

    def sealed(self) -> ExecutionSealed:
        return sealed(self.execution_id, len(self.records))


def tree_of(run: Run) -> TokenTree:
    """The execution's trajectory tree, built from its records in arrival order."""
    tree = TokenTree(run.execution_id)
    for r in run.records:
        tree.insert(r)
    return tree
