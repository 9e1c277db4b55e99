"""metrics.jsonl events -> named scalars, the one mapping every logger shares.

Two x-axes, as an RL engineer reads them: per-step figures (``train/``, ``eval/``, ``tokens/``,
``staleness/``, ``proxy/``, and ``health/``: controller.health's streak and warnings) are indexed
by the GSPO step; live figures (``water/``, ``cells/``, ``switch/``, ``microstep/``,
``executions/``, ``shard/``, ``weights/``) by whole seconds since the run started, since they
change between steps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

Axis = Literal["step", "seconds"]

# step event field -> tag (None values are skipped: a step with no microstep has no clip fraction)
_STEP_FIELDS = {
    "reward_mean": "train/reward_mean", "loss": "train/gspo_loss", "grad_norm": "train/grad_norm",
    "clip_fraction": "train/clip_fraction", "mean_ratio": "train/mean_ratio", "kl": "train/kl_to_behaviour",
    "adv_mean": "train/advantage_mean", "adv_std": "train/advantage_std", "adv_min": "train/advantage_min",
    "adv_max": "train/advantage_max", "adv_zero_fraction": "train/advantage_zero_fraction",
    "num_executions": "train/executions", "groups_dropped": "train/groups_dropped", "apply_s": "train/apply_s",
    "num_tokens": "tokens/trained", "prompt_tokens": "tokens/prompt", "output_tokens": "tokens/output",
    "dedup_saved_tokens": "tokens/deduplicated_away",
    "staleness_mean": "staleness/per_call_mean", "staleness_max": "staleness/per_call_max",
    "call_s_mean": "proxy/call_latency_s_mean", "call_s_max": "proxy/call_latency_s_max",
    "zero_adv_streak": "health/zero_advantage_streak",
}
_OUTCOMES = ("finished", "timed_out", "crashed")
_SWITCHING = ("draining", "to_train", "to_serve", "starting")


@dataclass(frozen=True, slots=True)
class Scalar:
    tag: str
    value: float
    axis: Axis
    x: int


class ScalarView:
    """Turns events into scalars; keeps only the running execution counts (cumulative counters)."""

    def __init__(self) -> None:
        self.executions: Counter[str] = Counter()

    def scalars(self, kind: str, ev: dict[str, Any]) -> list[Scalar]:
        sec = int(ev.get("t") or 0)
        if kind == "step":
            return [Scalar(tag, float(ev[f]), "step", int(ev["step"]))
                    for f, tag in _STEP_FIELDS.items() if _number(ev.get(f))]
        if kind == "eval" and _number(ev.get("reward")):
            return [Scalar(f"eval/reward_{ev.get('label', 'eval')}", float(ev["reward"]), "step", int(ev["step"])),
                    Scalar("eval/reward", float(ev["reward"]), "step", int(ev["step"]))]
        if kind == "health" and _number(ev.get("value")) and isinstance(ev.get("step"), int):
            # controller.health's warning: its measured value at its step (a NaN norm is not plotted)
            return [Scalar(f"health/{ev['signal']}", float(ev["value"]), "step", int(ev["step"]))]
        if kind == "progress":
            phases = list((ev.get("phases") or {}).values())
            return [
                Scalar("water/queued", float(ev.get("queued", 0)), "seconds", sec),
                Scalar("water/running", float(ev.get("running", 0)), "seconds", sec),
                Scalar("cells/serving", float(phases.count("serving")), "seconds", sec),
                Scalar("cells/training", float(phases.count("training")), "seconds", sec),
                Scalar("cells/switching", float(sum(phases.count(p) for p in _SWITCHING)), "seconds", sec),
                Scalar("cells/dead", float(phases.count("dead")), "seconds", sec),
            ]
        if kind == "switch" and _number(ev.get("total_s")):
            return [Scalar(f"switch/to_{ev['role']}_s", float(ev["total_s"]), "seconds", sec)]
        if kind == "microstep" and _number(ev.get("fb_s")):
            return [Scalar("microstep/latency_s", float(ev["fb_s"]), "seconds", sec)]
        if kind == "weights_loaded" and _number(ev.get("load_s")):
            return [Scalar("weights/load_s", float(ev["load_s"]), "seconds", sec)]
        if kind == "group" and _number(ev.get("shard_latency_s")):
            return [Scalar("shard/latency_s", float(ev["shard_latency_s"]), "seconds", sec)]
        if kind == "execution":
            self._count(ev)
            return [Scalar(f"executions/{name}", float(n), "seconds", sec)
                    for name, n in sorted(self.executions.items())]
        return []

    def _count(self, ev: dict[str, Any]) -> None:
        outcome = ev.get("outcome")
        if outcome in _OUTCOMES:
            self.executions[str(outcome)] += 1
        if ev.get("state") == "grade_failed":
            self.executions["grader_failures"] += 1
        for name in (*_OUTCOMES, "grader_failures"):
            self.executions.setdefault(name, 0)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
