"""Training health: warnings an RL engineer wants before a run quietly stops learning.

``observe(cfg, state, step_event) -> (state, warnings)`` is pure: it reads one ``step`` event of
metrics.jsonl (the fields ``controller.step_stats`` and the controller put there) and the
history it carries in ``HealthState``, and says what looks wrong. The controller writes each
warning to the log and as a ``health`` event to metrics.jsonl (so every logger shows it), and
adds the running zero-advantage streak to the step event. Signals:

- ``zero_advantage_streak``: N steps in a row where every trained execution had advantage 0
  (each group's runs alike): nothing is learned, and a policy that stops varying rarely recovers.
- ``kl_spike``: the step's KL to the behaviour policy far above its recent median: the trainer
  and the engines disagree about the policy (a large update, a wrong weight load).
- ``reward_collapse``: the rolling mean reward fell well below its best and stayed there.
- ``grad_norm_outlier``: a gradient norm far above its recent median, or not finite (the
  embedded trainer skips such a step).

Re-reading a finished run's metrics.jsonl through ``observe`` gives the same warnings
(``python -m controller.health runs/<id>/metrics.jsonl``).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Signal = Literal["zero_advantage_streak", "kl_spike", "reward_collapse", "grad_norm_outlier"]


@dataclass(frozen=True, kw_only=True)
class HealthConfig:
    """conf/config.yaml ``health:``; every threshold is checked per applied step."""

    enabled: bool
    zero_advantage_steps: int
    """Warn when this many steps in a row had every advantage 0 (and again at 2x, 4x, ... that:
    a run frozen for an hour says so a handful of times, not every N steps)."""
    window: int
    """Steps of history the KL and grad-norm medians are taken over."""
    min_history: int
    """No KL or grad-norm verdict before this many steps of history."""
    kl_spike_factor: float
    """A KL above this times its rolling median is a spike ..."""
    kl_spike_min: float
    """... and above this floor (nats per policy token): a tiny KL tripling is noise."""
    grad_norm_factor: float
    """A gradient norm above this times its rolling median is an outlier."""
    reward_window: int
    """Steps the rolling mean reward is taken over."""
    reward_drop: float
    """How far (in reward units) the rolling mean must sit below its best to count as fallen ..."""
    reward_drop_steps: int
    """... for this many steps in a row before the warning (once, until it recovers)."""

    def check(self) -> None:
        if min(self.zero_advantage_steps, self.window, self.min_history, self.reward_window,
               self.reward_drop_steps) < 1:
            raise ValueError("zero_advantage_steps, window, min_history, reward_window, reward_drop_steps: want >= 1")
        if self.min_history > self.window:
            raise ValueError("min_history: want <= window")
        if self.kl_spike_factor <= 1 or self.grad_norm_factor <= 1:
            raise ValueError("kl_spike_factor and grad_norm_factor: want > 1")
        if self.kl_spike_min < 0 or self.reward_drop <= 0:
            raise ValueError("kl_spike_min: want >= 0; reward_drop: want > 0")


@dataclass(frozen=True, slots=True)
class HealthWarning:
    signal: Signal
    step: int
    value: float
    threshold: float
    message: str

    def fields(self) -> dict[str, Any]:
        return {"signal": self.signal, "step": self.step, "value": self.value, "threshold": self.threshold,
                "message": self.message}


@dataclass(frozen=True, slots=True)
class HealthState:
    zero_streak: int = 0
    kl: tuple[float, ...] = ()
    grad_norms: tuple[float, ...] = ()
    rewards: tuple[float, ...] = ()
    best_reward_mean: float | None = None
    fallen_steps: int = 0
    """Steps in a row the rolling mean has sat ``reward_drop`` below its best."""


def observe(cfg: HealthConfig, state: HealthState, ev: dict[str, Any]) -> tuple[HealthState, list[HealthWarning]]:
    """One ``step`` event in; the new state and this step's warnings out."""
    if not cfg.enabled:
        return state, []
    step = int(ev.get("step") or 0)
    out: list[HealthWarning] = []

    zero = ev.get("adv_zero_fraction")
    streak = state.zero_streak + 1 if _num(zero) and zero >= 1.0 else 0
    n = streak // cfg.zero_advantage_steps
    if streak and streak % cfg.zero_advantage_steps == 0 and n & (n - 1) == 0:  # at N, 2N, 4N, ...
        out.append(HealthWarning("zero_advantage_streak", step, float(streak), float(cfg.zero_advantage_steps),
                                 f"step {step}: {streak} steps in a row with every advantage 0 (each group's runs "
                                 "alike): nothing is being learned"))

    kl_hist, kl = state.kl, ev.get("kl")
    if _num(kl):
        if len(kl_hist) >= cfg.min_history:
            limit = max(cfg.kl_spike_min, cfg.kl_spike_factor * statistics.median(kl_hist))
            if kl > limit:
                out.append(HealthWarning("kl_spike", step, float(kl), limit,
                                         f"step {step}: KL to the behaviour policy {kl:.4g}, over {limit:.4g} "
                                         f"({cfg.kl_spike_factor:g} x the median of the last {len(kl_hist)} steps)"))
        kl_hist = (kl_hist + (float(kl),))[-cfg.window:]

    norms, norm = state.grad_norms, ev.get("grad_norm")
    if isinstance(norm, (int, float)) and not isinstance(norm, bool):
        if not math.isfinite(norm):
            out.append(HealthWarning("grad_norm_outlier", step, float(norm), math.inf,
                                     f"step {step}: gradient norm {norm}: the update was skipped"))
        elif norm > 0:  # 0: a step without data, no update
            if len(norms) >= cfg.min_history:
                limit = cfg.grad_norm_factor * statistics.median(norms)
                if norm > limit:
                    out.append(HealthWarning("grad_norm_outlier", step, float(norm), limit,
                                             f"step {step}: gradient norm {norm:.4g}, over {limit:.4g} "
                                             f"({cfg.grad_norm_factor:g} x the median of the last {len(norms)} steps)"))
            norms = (norms + (float(norm),))[-cfg.window:]

    rewards, best, fallen = state.rewards, state.best_reward_mean, state.fallen_steps
    reward = ev.get("reward_mean")
    if _num(reward):
        rewards = (rewards + (float(reward),))[-cfg.reward_window:]
        if len(rewards) == cfg.reward_window:
            mean = sum(rewards) / len(rewards)
            best = mean if best is None else max(best, mean)
            fallen = fallen + 1 if best - mean >= cfg.reward_drop else 0
            if fallen == cfg.reward_drop_steps:
                out.append(HealthWarning("reward_collapse", step, mean, best - cfg.reward_drop,
                                         f"step {step}: mean reward of the last {cfg.reward_window} steps {mean:.3f}, "
                                         f"down from its best {best:.3f}, and {fallen} steps without recovering"))
    return HealthState(zero_streak=streak, kl=kl_hist, grad_norms=norms, rewards=rewards, best_reward_mean=best,
                       fallen_steps=fallen), out


class HealthMonitor:
    """The controller's holder of the state: ``observe(step_event)`` gives the fields to add to
    the step event and the warnings to report."""

    def __init__(self, cfg: HealthConfig, metrics_path: Path | None = None):
        self.cfg = cfg
        self.state = HealthState()
        if metrics_path is not None and metrics_path.is_file():
            self.state = resume_state(cfg, metrics_path)

    def observe(self, ev: dict[str, Any]) -> tuple[dict[str, Any], list[HealthWarning]]:
        self.state, warnings = observe(self.cfg, self.state, ev)
        return {"zero_adv_streak": self.state.zero_streak} if self.cfg.enabled else {}, warnings


def resume_state(cfg: HealthConfig, metrics_path: Path, max_bytes: int = 64 << 20) -> HealthState:
    """The state earlier attempts of the run left (a streak or a fall that spans a resume is
    still seen), from the step events in the last ``max_bytes`` of its metrics.jsonl."""
    with open(metrics_path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(size - max_bytes, 0))
        tail = f.read().decode(errors="replace").splitlines()
    state = HealthState()
    for line in tail[1:] if size > max_bytes else tail:  # the first line of a cut tail is partial
        ev = _event(line)
        if ev is not None and ev.get("kind") == "step":
            state, _ = observe(cfg, state, ev)
    return state


def _event(line: str) -> dict[str, Any] | None:
    try:
        ev = json.loads(line)
    except ValueError:
        return None  # a line torn by a kill
    return ev if isinstance(ev, dict) else None


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def replay(cfg: HealthConfig, events: list[dict[str, Any]]) -> list[HealthWarning]:
    """Every warning a run's step events give, in order (a resumed controller carries the state
    on from metrics.jsonl, ``resume_state``, so resumes do not reset it here either)."""
    state, out = HealthState(), []
    for ev in events:
        if ev.get("kind") == "step":
            state, warnings = observe(cfg, state, ev)
            out += warnings
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m controller.health METRICS_JSONL [key=value ...]``: a finished run's warnings,
    with conf/config.yaml's thresholds (overridden by ``key=value``)."""
    import yaml

    from base.typed_config import build

    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit("usage: python -m controller.health runs/<id>/metrics.jsonl [window=50 ...]")
    data = yaml.safe_load((Path(__file__).resolve().parents[1] / "conf" / "config.yaml").read_text())["health"]
    for kv in args[1:]:
        key, _, value = kv.partition("=")
        data[key] = yaml.safe_load(value)
    cfg = build(HealthConfig, data, "health")
    events = [ev for line in Path(args[0]).read_text().splitlines() if (ev := _event(line)) is not None]
    for w in replay(cfg, events):
        print(json.dumps(w.fields()))


if __name__ == "__main__":
    main()
