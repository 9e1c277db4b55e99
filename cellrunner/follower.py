"""Ranks 1..n-1 of a multi-rank cell: build the same trainer, mirror the leader's calls.

A follower never talks to the controller. It joins the cell's process group (the trainer's
constructor does, ``env://`` from ``base.ranks``), opens the command channel, and runs
``spmd_trainer.follow`` until the leader says ``exit``. The rank of a server's first GPU on a
node runs its part of one of the cell's SGLang servers
(``cellrunner.servers``: a whole server, or a node of one spanning several, ``--node-rank``); the
leader drives every server over HTTP, so nothing else is asked of it.

Stopping: srun and the local launcher signal every rank of a cell at once, but the leader's
graceful stop still needs its followers (the core's final checkpoint is a collective). So SIGTERM
only starts a grace period: a follower leaves when the leader says ``exit``, or when the grace
runs out (a leader that died), stopping its SGLang part either way. The follower's main thread
usually sits in a collective, where Python would not run a signal handler, so a thread learns of
the signal through ``signal.set_wakeup_fd``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import zmq

from cellrunner.backends import make_node_engine, make_rank_links, make_trainer
from base.ranks import CellRanks
from cellrunner.spmd import CommandChannel
from cellrunner.spmd_trainer import follow

log = logging.getLogger("cellrunner.follower")

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
GRACE_S = 120.0
"""How long a signalled follower waits for the leader's ``exit`` (its final checkpoint)."""


def stop_on_signal(on_stop: Any, done: threading.Event, grace_s: float = GRACE_S) -> None:
    """Take STOP_SIGNALS without dying: give the main loop ``grace_s`` to end (``done``), then
    call ``on_stop`` and exit. Main thread only (signal handlers and the wakeup fd are set here)."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: None)  # the wakeup fd below is what acts
    # The C-level handler writes the signal number here at once, even while the main thread
    # sits in a collective (a Python handler would only run after it returns).
    signal.set_wakeup_fd(w)

    def watch() -> None:
        sig = os.read(r, 1)[0]
        log.info("follower: %s: leaving when the leader says exit, at most %.0fs from now",
                 signal.Signals(sig).name, grace_s)
        if done.wait(grace_s):
            return  # the main thread ends the process
        log.warning("follower: no exit from the leader in %.0fs: stopping", grace_s)
        try:
            on_stop()
        finally:
            os._exit(3)

    threading.Thread(target=watch, name="follower-signals", daemon=True).start()


def run_follower(cfg: Any, cell_id: int, ranks: CellRanks, vocab_size: int, api_key: str = "") -> None:
    done = threading.Event()
    serving: list[Any] = []  # this rank's part of a server, once started
    stop_on_signal(lambda: [p.stop() for p in serving], done)
    is_core = cell_id == cfg.core_cell
    trainer = make_trainer(cfg, vocab_size, is_core=is_core, multi_rank=True)  # a follower's cell has several ranks
    channel = CommandChannel(timeout_s=cfg.trainer.command_timeout_s)  # a multi-rank cell is Megatron
    # The core's ranks each take their peers' gradients and publish their own shards; the
    # leader tells the controller where (the same collective calls as its own).
    links, _, _ = make_rank_links(cfg, zmq.Context.instance(), ranks, is_core, channel)
    # Then serving, as the leader's make_engine (collective): start this rank's part of one of the
    # cell's servers, if it has one, and tell the leader its URL.
    engine = make_node_engine(cfg, vocab_size, cell_id, ranks, api_key, channel)
    if engine is not None:
        serving.append(engine)
    log.info("cell %d: rank %d of %d (node %d, local rank %d) follows rank 0", cell_id, ranks.rank,
             ranks.world_size, ranks.node_rank, ranks.local_rank)
    try:
        follow(trainer, channel, links)
    finally:
        links.close()
        done.set()
        if engine is not None:
            engine.stop()
    log.info("cell %d: rank %d: the leader said exit", cell_id, ranks.rank)
