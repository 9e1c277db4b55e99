"""Prometheus /metrics from the controller: the run's scalars as gauges, executions as counters,
and each cell's phase, weight version and whether it is the core.

Its own registry (not the process-global one), so two runs in one process, as in tests, do not
collide; the server binds where config says, loopback by default."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from controller.loggers.config import PrometheusConfig
from controller.loggers.scalars import ScalarView

log = logging.getLogger(__name__)

PHASES = ("starting", "serving", "draining", "to_train", "training", "to_serve", "dead")


def metric_name(tag: str) -> str:
    return "gyre_" + re.sub(r"[^a-zA-Z0-9_]", "_", tag)


class PrometheusLogger:
    name = "prometheus"

    def __init__(self, cfg: PrometheusConfig, run_dir: Path) -> None:
        self.registry = CollectorRegistry()
        self.view = ScalarView()
        self.gauges: dict[str, Gauge] = {}
        self.executions = Counter("gyre_executions", "Executions ended, by outcome (grader_failures: graded None, "
                                  "excluded from training)", ["outcome"], registry=self.registry)
        self.cell_phase = Gauge("gyre_cell_phase", "1 for the cell's current phase", ["cell", "phase"],
                                registry=self.registry)
        self.cell_version = Gauge("gyre_cell_weight_version", "Weight version the cell holds", ["cell"],
                                  registry=self.registry)
        self.health = Counter("gyre_health_warnings", "controller.health's warnings, by signal", ["signal"],
                              registry=self.registry)
        self.step = Gauge("gyre_step", "GSPO steps applied (the core's weight version)", registry=self.registry)
        self.server, self.thread = start_http_server(cfg.port, addr=cfg.host, registry=self.registry)
        host = cfg.host if ":" not in cfg.host else f"[{cfg.host}]"
        self.url = f"http://{host}:{self.server.server_port}/metrics"
        (run_dir / "prometheus.url").write_text(self.url + "\n")
        log.info("prometheus: metrics at %s", self.url)

    def event(self, kind: str, ev: dict[str, Any]) -> None:
        if kind == "execution":
            outcome = ev.get("outcome")
            if outcome:
                self.executions.labels(outcome=str(outcome)).inc()
            if ev.get("state") == "grade_failed":
                self.executions.labels(outcome="grader_failures").inc()
        elif kind == "health" and ev.get("signal"):
            self.health.labels(signal=str(ev["signal"])).inc()
        elif kind == "progress":
            versions = ev.get("versions") or {}
            for cell, phase in (ev.get("phases") or {}).items():
                for p in PHASES:
                    self.cell_phase.labels(cell=str(cell), phase=p).set(1.0 if p == phase else 0.0)
                if cell in versions:
                    self.cell_version.labels(cell=str(cell)).set(versions[cell])
            if isinstance(ev.get("version"), int):
                self.step.set(ev["version"])
        for s in self.view.scalars(kind, ev):
            if s.tag.startswith("executions/"):
                continue  # the counter above
            name = metric_name(s.tag)
            gauge = self.gauges.get(name)
            if gauge is None:
                gauge = self.gauges[name] = Gauge(name, f"{s.tag} (latest; x-axis: {s.axis})", registry=self.registry)
            gauge.set(s.value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
