"""Entrypoint of the trajectory processor process.

    python -m trajectory.main --config-json CONFIG --controller tcp://HOST:PORT \\
        --bind-records tcp://127.0.0.1:0 --log-dir DIR --ready-file PATH [--no-fsync] [--curve-keys DIR]

CONFIG is JSON ``{"algo": {AlgoConfig fields}, "workload": {"min_usable_per_group": int}}``, built strictly (unknown or missing keys are errors). Once the records
socket is bound, ``{"records_addr": "tcp://127.0.0.1:PORT"}`` is written to the ready file
(atomically). The log lives in ``DIR/processor.log``; a restart with the same DIR resumes.
SIGTERM or SIGINT (or a ``Shutdown`` from the controller) ends the process cleanly, rc 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from base import curve
from base.lifecycle import exit_with_parent
from base.typed_config import ConfigError, build
from base.algo_config import AlgoConfig
from trajectory.delivery import ProcessorService
from trajectory.log import AppendLog
from trajectory.processor import Processor
from trajectory.service import serve

log = logging.getLogger(__name__)

LOG_FILE_NAME = "processor.log"


@dataclass(frozen=True, kw_only=True)
class ProcessorWorkloadConfig:
    min_usable_per_group: int
    """A group with fewer usable executions is dropped whole, and counted."""


@dataclass(frozen=True, kw_only=True)
class ProcessorConfig:
    """What the controller hands the processor (a slice of the root config)."""

    algo: AlgoConfig
    workload: ProcessorWorkloadConfig

    def check(self) -> None:
        if self.algo.max_trajectories_per_execution < 1:
            raise ValueError("algo.max_trajectories_per_execution: want >= 1")
        if self.workload.min_usable_per_group < 1:
            raise ValueError("workload.min_usable_per_group: want >= 1")


def load_config(path: str | os.PathLike[str]) -> ProcessorConfig:
    data = json.loads(Path(path).read_text())
    return build(ProcessorConfig, data)


def _write_ready(path: Path, records_addr: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"records_addr": records_addr}))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    # Everything a run writes (checkpoints, logs, prompts, task files with gold patches and hidden
    # tests) is the run user's alone on a shared node: files 0600, folders 0700.
    os.umask(0o077)
    parser = argparse.ArgumentParser(prog="python -m trajectory.main", description=__doc__.split("\n")[0])
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--controller", required=True, help="the controller's ROUTER address")
    parser.add_argument("--bind-records", required=True, help="address of the records ROUTER (CallRecords and seals from the proxy)")
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--no-fsync", action="store_true", help="flush the log but skip os.fsync")
    parser.add_argument("--heartbeat-s", type=float, default=1.0, help="seconds between ServiceHeartbeats")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    parser.add_argument("--curve-keys", default="", help="the run's CURVE keys folder (base.curve); '' for plain sockets")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        config = load_config(args.config_json)
        curve.install(args.curve_keys, "processor")
    except (ConfigError, ValueError, OSError, curve.CurveError) as exc:
        log.error("bad config %s: %s", args.config_json, exc)
        return 2

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    exit_with_parent()  # a controller that died without stopping us

    processor = Processor(
        algo=config.algo,
        min_usable=config.workload.min_usable_per_group,
        max_trajectories=config.algo.max_trajectories_per_execution,
    )
    service = ProcessorService(
        processor, AppendLog(Path(args.log_dir) / LOG_FILE_NAME, fsync=not args.no_fsync)
    )
    serve(
        service,
        records_addr=args.bind_records,
        controller_addr=args.controller,
        stop=stop,
        on_ready=lambda addr: _write_ready(Path(args.ready_file), addr),
        heartbeat_s=args.heartbeat_s,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
