"""Ranks 1..n-1 of a multi-rank cell: build the same trainer, mirror the leader's calls.

A follower never talks to the controller. It joins the cell's process group (the trainer's
constructor does, ``env://`` from ``cellrunner.ranks``), opens the command channel, and runs
``spmd_trainer.follow`` until the leader says ``exit``. On a node other than the leader's, local
rank 0 also runs that node's part of the cell's SGLang server (``--node-rank``): SGLang drives
all nodes from node 0's HTTP API, so nothing else is asked of it.

Stopping: SIGTERM (srun, scancel, the local launcher) stops the SGLang part and exits at once.
The follower's main thread usually sits in a collective, where Python would not run a signal
handler, so the signal is taken by a thread with ``sigwait``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from cellrunner.backends import make_node_engine, make_trainer
from cellrunner.ranks import CellRanks
from cellrunner.spmd import CommandChannel
from cellrunner.spmd_trainer import follow

log = logging.getLogger("cellrunner.follower")

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def stop_on_signal(on_stop: Any) -> None:
    """Block STOP_SIGNALS in this thread (and every thread started after), take them in a watcher."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def watch() -> None:
        sig = signal.sigwait(STOP_SIGNALS)
        log.info("follower: %s: stopping", signal.Signals(sig).name)
        try:
            on_stop()
        finally:
            os._exit(0)

    threading.Thread(target=watch, name="follower-signals", daemon=True).start()


def run_follower(cfg: Any, cell_id: int, ranks: CellRanks, vocab_size: int) -> None:
    engine = make_node_engine(cfg, vocab_size, cell_id, ranks)
    stop_on_signal(lambda: engine.stop() if engine is not None else None)
    trainer = make_trainer(cfg, vocab_size, is_core=cell_id == cfg.core_cell)
    channel = CommandChannel()
    if engine is not None:
        engine.start()
    log.info("cell %d: rank %d of %d (node %d, local rank %d) follows rank 0", cell_id, ranks.rank,
             ranks.world_size, ranks.node_rank, ranks.local_rank)
    try:
        follow(trainer, channel)
    finally:
        if engine is not None:
            engine.stop()
    log.info("cell %d: rank %d: the leader said exit", cell_id, ranks.rank)
