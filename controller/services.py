"""The run's child services, the trajectory processor and the harness proxy: started, watched,
restarted in place and stopped, and what the run's children are started with (the CURVE keys,
the engine key, the token secret's file, the proxy's Unix socket, the cellrunners' config, the
JSON config files), in the run folder (``make_run_dir``) and each attempt's folders there.

The controller (``controller.controller.Controller``) owns one ``RunServices`` per attempt and
tells it when a service was heard from; everything else about the services lives here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from base import curve, engine_key
from base.checkpoints import Checkpoint
from base.execution_token import write_secret
from base.typed_config import to_dict
from controller.config import ClusterConfig, GyreConfig
from controller.executions import ProxyEndpoint
from controller.processes import log_tail, spawn, stop, wait_ready

if TYPE_CHECKING:
    from controller.cells import CellRegistry
    from controller.report import MetricsSink

log = logging.getLogger(__name__)

UNIX_PATH_MAX = 100
"""Bytes of a Unix socket path we use at most (Linux's sun_path holds 108 with its NUL)."""
SERVICES = ("processor", "proxy")


class RunFailed(RuntimeError):
    """The run cannot go on. ``resumable``: a new attempt from the newest checkpoint can (a dead
    core, a service past its restarts), so ``gyre`` starts one itself (``run.auto_resume``)."""

    def __init__(self, message: str, *, resumable: bool = False):
        super().__init__(message)
        self.resumable = resumable


def make_keys(cluster: ClusterConfig, run_dir: Path) -> Path | None:
    """The run's CURVE keys: a site folder, or fresh ones for this attempt in the run folder
    (an earlier attempt's processes must not get in). None with ``cluster.curve`` off."""
    if not cluster.curve:
        log.warning("cluster.curve=false: the run's ZeroMQ sockets admit anyone who can reach them")
        return None
    if cluster.curve_keys:
        return Path(cluster.curve_keys)
    folder = run_dir / "keys"
    curve.create_keys(folder, curve.member_names(cluster.num_cells))
    return folder


def cellrunner_config(
    c: GyreConfig, *, checkpoint_dir: Path, log_dir: Path, resume_from: Checkpoint | None = None,
    kv_tier_address: str = "",
) -> dict:
    """The cellrunner's config (cellrunner.backends.CellRunnerConfig) as the JSON every cell is given."""
    return {
        "model": to_dict(c.model), "algo": to_dict(c.algo), "host": c.cluster.host,
        "core_cell": c.cluster.core_cell, "torch_threads": c.cluster.torch_threads,
        "heartbeat_interval_s": c.cluster.heartbeat_interval_s, "drain_timeout_s": c.cluster.drain_timeout_s,
        "capacity_per_cell": c.scheduler.capacity_per_cell, "transfer_timeout_s": c.cluster.transfer_timeout_s,
        "transfer": c.cluster.transfer, "mooncake": to_dict(c.cluster.mooncake), "seed": c.run.seed, "checkpoint_dir": str(checkpoint_dir),
        "resume_from": str(resume_from.path) if resume_from else "",
        "resume_version": resume_from.version if resume_from else 0,
        "trainer": to_dict(c.trainer), "engine": to_dict(c.engine), "log_dir": str(log_dir),
        "kv_tier_address": kv_tier_address,
    }


def make_run_dir(runs_dir: str, name: str, run_id: str = "") -> Path:
    """``runs_dir/<run_id>`` (a fresh timestamped id when empty). A given id may exist already: a
    requeued Slurm job passes its job id, finds its first attempt's folder and resumes there."""
    root = Path(runs_dir)
    run_id = run_id or time.strftime("%Y%m%d-%H%M%S") + f"-{name}-{os.getpid()}"
    run_dir = root / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir.chmod(0o700)  # the run user's alone, also when an earlier attempt made it under another umask
    latest = root / "latest"
    if latest.is_symlink() or latest.exists():
        latest.unlink()
    latest.symlink_to(run_id)
    return run_dir


class RunServices:
    """The processor and the proxy of one attempt, and the files and arguments the run's children
    are started with.

    A part the controller owns (composition, not a mixin): what it needs from the run is small and
    fixed at the start (the config, the run folder, the controller's address, the CURVE keys, the
    token secret, the metrics sink and the run's start time); what it learns from the control
    socket comes in through ``heard_from``. It never sends on the control socket: a restarted
    service says Hello, and the controller gives it what it had (grades, routes, seals)."""

    def __init__(self, cfg: GyreConfig, run_dir: Path, log_dir: Path, *, controller_addr: str,
                 keys_dir: Path | None, secret: bytes, metrics: MetricsSink, t0: float):
        self.cfg = cfg
        self.run_dir = run_dir
        self.log_dir = log_dir
        self.controller_addr = controller_addr
        self.keys_dir = keys_dir
        self.secret = secret
        self.metrics = metrics
        self.t0 = t0
        # Attempts of one run folder (a requeued job): 0, then one more per earlier processor log.
        self.attempt = sum(1 for p in run_dir.glob("processor*") if p.is_dir())
        self.engine_key_file: Path | None = None
        self.children: dict[str, subprocess.Popen] = {}
        self.records_addr = ""
        self.proxy_url = ""
        self.proxy_socket: Path | None = None
        self.socket_dir: Path | None = None
        self.restarts: Counter[str] = Counter()  # processor / proxy -> restarts in place so far
        self.seen: dict[str, float] = {}  # processor / proxy -> when last heard (Hello, heartbeat)
        self.silenced: dict[str, str] = {}  # a service killed for its silence -> why, for the message
        self.kv_master: Any = None  # the run's shared KV tier (cellrunner.mooncake_store.MooncakeMaster), if asked for

    # ================================================================ start and stop

    def start(self, records_addr: str, proxy_port: int, *, host: str = "127.0.0.1") -> ProxyEndpoint:
        """The shared KV tier if the engine config asks for one, the processor (its records socket
        on ``records_addr``), then the proxy on ``proxy_port`` (0: any), which sends there; return
        where harnesses reach the proxy. ``host``: the controller's address, where the store listens."""
        self.start_kv_tier(host)
        self.records_addr = self.start_processor(records_addr)
        proxy_ready = self.start_proxy(proxy_port)
        self.proxy_url = proxy_ready["url"]
        unix_socket = proxy_ready.get("unix_socket")
        return ProxyEndpoint(url=self.proxy_url, unix_socket=Path(unix_socket) if unix_socket else None)

    def start_processor(self, records_addr: str) -> str:
        """Start the trajectory processor with its records socket on ``records_addr``; return the
        address it bound (the port resolved), where the proxy sends."""
        c = self.cfg
        ready = self._start_child(
            "processor", "trajectory.main",
            {"algo": to_dict(c.algo), "workload": {"min_usable_per_group": c.workload.min_usable_per_group}},
            ["--bind-records", records_addr, "--log-dir", str(self.attempt_dir("processor")), *self.curve_args(),
             "--heartbeat-s", str(c.cluster.heartbeat_interval_s)],
        )
        return ready["records_addr"]

    def start_proxy(self, port: int) -> dict:
        """Start the harness proxy on ``port`` (0: any); return its ready file (its URL)."""
        c = self.cfg
        if self.proxy_socket is None:
            self.proxy_socket = self.proxy_socket_path()
        return self._start_child(
            "proxy", "harness_proxy.main",
            {"proxy": {**to_dict(c.proxy), "port": port},
             "model": {"tokenizer": c.model.tokenizer, "compact_ranks": c.model.compact_ranks, "path": c.model.path},
             "rollout": to_dict(c.algo.rollout)},
            ["--processor", self.records_addr, "--secret-file", str(self.secret_file()),
             "--unix-socket", str(self.proxy_socket), *self.curve_args(), *self.engine_key_args(),
             "--heartbeat-s", str(c.cluster.heartbeat_interval_s)],
        )

    def start_kv_tier(self, host: str) -> None:
        """``engine.kv_tier.enabled``: a Mooncake Store for this attempt's engines on the controller's
        host (its KV is of this attempt's weights; a new attempt starts an empty one)."""
        tier = getattr(self.cfg.engine, "kv_tier", None)
        if tier is None or not tier.enabled or self.kv_master is not None:
            return
        from cellrunner.mooncake_store import MooncakeMaster  # the wheel's binaries, only when asked for

        self.kv_master = MooncakeMaster(segment_bytes=tier.segment_bytes, host=host)
        log.info("kv tier: Mooncake Store at %s, %d MiB", self.kv_master.master_address, tier.segment_bytes >> 20)

    @property
    def kv_tier_address(self) -> str:
        return self.kv_master.master_address if self.kv_master is not None else ""

    def restart_proxy(self) -> None:
        """The proxy again on its port and Unix socket, so harnesses (which retry) and sandbox
        relays reach it where they did. It knows no session: a harness's next call is rendered
        from its messages (a new branch of the execution's tree where the ids differ)."""
        port = int(self.proxy_url.rsplit(":", 1)[1])
        url = self.start_proxy(port)["url"]
        if url != self.proxy_url:
            raise RunFailed(f"the proxy came back at {url}, not {self.proxy_url}, where the harnesses call")

    def _start_child(self, name: str, module: str, config: dict, extra: list[str]) -> dict:
        cfg_path = self.write_json(f"{name}.json", config)
        ready = self.run_dir / f"{name}.ready"
        ready.unlink(missing_ok=True)  # an earlier attempt's file would announce a process long gone
        proc = spawn(name, module, ["--config-json", str(cfg_path), "--controller", self.controller_addr,
                                    "--ready-file", str(ready), *extra], self.log_dir)
        self.children[name] = proc
        return wait_ready(name, proc, ready, self.log_dir, self.cfg.cluster.start_timeout_s)

    def shutdown(self, cell_procs: list[subprocess.Popen]) -> None:
        """Stop the cells' processes and the services together (one grace for all), and remove a
        temporary socket folder."""
        stop(cell_procs + list(self.children.values()), grace_s=8.0)
        if self.kv_master is not None:  # after the cells, whose drains may still be writing to it
            self.kv_master.close()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    # ================================================================ what children are started with

    def curve_args(self) -> list[str]:
        return ["--curve-keys", str(self.keys_dir)] if self.keys_dir else []

    def engine_key_args(self) -> list[str]:
        """A fresh engine API key for this start (``base.engine_key``), for the cells and the proxy."""
        if self.engine_key_file is None:
            self.engine_key_file = engine_key.write_key(self.run_dir / "engine.key")
        return ["--engine-key-file", str(self.engine_key_file)]

    def secret_file(self) -> Path:
        """The token secret for the proxy, in a 0600 file of the run folder: a command line is
        readable by every local user through /proc."""
        path = self.run_dir / "proxy.secret"
        write_secret(path, self.secret)
        return path

    def proxy_socket_path(self) -> Path:
        """Where the proxy also listens for the sandboxes' relays: a 0700 folder of its own, bound
        whole into each sandbox (so a proxy restarted in place is found again there), in the run
        folder when the path fits AF_UNIX's 108 bytes, else a temporary one removed at shutdown."""
        folder = self.run_dir / "proxy-socket"
        if len(os.fsencode((folder / "proxy.sock").resolve())) < UNIX_PATH_MAX:
            folder.mkdir(mode=0o700, exist_ok=True)
            return folder / "proxy.sock"
        self.socket_dir = Path(tempfile.mkdtemp(prefix="gyre-"))
        return self.socket_dir / "proxy.sock"

    def attempt_dir(self, name: str) -> Path:
        """``name/`` on a run's first attempt, ``name.<k>/`` on attempt k of a resumed run: the
        processor's log and the workspaces of the old attempt belong to executions that died with
        it, and must not be replayed into (or mistaken for) this attempt's."""
        return self.run_dir / (name if self.attempt == 0 else f"{name}.{self.attempt}")

    def write_json(self, name: str, obj: dict) -> Path:
        path = self.run_dir / name
        path.write_text(json.dumps(obj, indent=1))
        return path

    def write_endpoints(self, cells: CellRegistry) -> None:
        """Where everything listens, for operators and tests (the processor's address is in its ready file)."""
        core = cells.core
        self.write_json("endpoints.json", {"controller": self.controller_addr, "proxy": self.proxy_url,
                                           "cells": {i: cell.engine_url for i, cell in cells.cells.items()},
                                           "cell_servers": {i: cell.engine_urls for i, cell in cells.cells.items()},
                                           "core_weights": core.weights_addr, "core_grads": core.grads_addrs})

    # ================================================================ watching

    def heard_from(self, name: str) -> None:
        """The processor or the proxy said something (Hello, heartbeat): it is not silent."""
        self.seen[name] = time.monotonic()

    def check_services(self) -> None:
        """A dead processor or proxy is restarted in place (``cluster.service_restarts`` times each)
        where it was, so what talks to it finds it again: the processor on its records address
        (it replays its log; the proxy resends what it had not acknowledged; the grades come again
        on its Hello), the proxy on its port and Unix socket (harnesses retry; routes and seals
        come again on its Hello). Past its restarts, it stops the run at once with the reason,
        never a silent hang; the same ``run.run_id`` resumes from the newest checkpoint."""
        now = time.monotonic()
        for name in SERVICES:
            proc = self.children.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                silent = now - self.seen.get(name, now)
                if silent > self.cfg.cluster.heartbeat_timeout_s:
                    # Alive but its loop stopped turning (stuck, or stopped): a hang the run would
                    # wait on forever. Killed, it is restarted or stops the run as a dead one does.
                    self.silenced[name] = f"was silent for {silent:.1f}s (killed)"
                    log.error("the %s %s", name, self.silenced[name])
                    proc.kill()
                    proc.wait()
                else:
                    continue
            why = self.silenced.pop(name, None) or f"exited with {proc.returncode}"
            if self.restarts[name] < self.cfg.cluster.service_restarts:
                self.restarts[name] += 1
                log.error("the %s %s; restarting it in place (%d of %d); its log ends:\n%s", name, why,
                          self.restarts[name], self.cfg.cluster.service_restarts, log_tail(self.log_dir, name, 8))
                self.metrics.log("service_restarted", t=time.monotonic() - self.t0, service=name, why=why,
                                 restarts=self.restarts[name])
                if name == "processor":
                    self.start_processor(self.records_addr)
                else:
                    self.restart_proxy()
                self.heard_from(name)  # heard from again at its Hello
                continue
            raise RunFailed(
                f"the {name} {why}; its log ends:\n{log_tail(self.log_dir, name, 8)}\n"
                f"start the run again with run.run_id={self.run_dir.name} to resume from its newest checkpoint",
                resumable=True)
