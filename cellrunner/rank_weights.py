"""A multi-rank satellite's training weights, rank to rank.

The HF-layout weights a serving engine loads leave the core through its rank 0 (``weights()``
assembles the whole model there). A satellite that is to *train* needs no such thing: rank r of
it holds exactly what rank r of the core holds (cells share one training layout). So every rank
of a multi-rank core publishes its own parameters (``local_weights``) after each start, restore
and apply, with the cell's transfer (ZeroMQ or the Mooncake Transfer Engine, the same publisher
and puller as the whole-model path), and rank r of a satellite pulls from the core's rank r and
loads it with ``start_local``. Nothing is gathered and no rank holds more than its own shard.

The ranks then agree that all of them loaded the same version; otherwise every rank drops the
replica again, so a cell never trains on mixed weights.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from cellrunner.spmd import CommandChannel
from cellrunner.transfer import WeightPublisher, WeightPuller

log = logging.getLogger(__name__)


class RankWeights:
    """This rank's side: a publisher of its own shard on the core, a puller on a satellite."""

    def __init__(self, *, rank: int, publisher: WeightPublisher | None = None, puller: WeightPuller | None = None):
        self.rank, self.publisher, self.puller = rank, publisher, puller
        if publisher is not None:
            publisher.start()

    @property
    def addr(self) -> str:
        return self.publisher.addr if self.publisher is not None else ""

    def publish(self, trainer: Any) -> None:
        """Core: make this rank's current parameters pullable."""
        if self.publisher is not None and trainer.model is not None:
            self.publisher.publish(trainer.local_weights())

    def start(self, trainer: Any, addrs: list[str], *, min_version: int, timeout_s: float,
              channel: CommandChannel) -> int:
        """Satellite, every rank: pull ``addrs[rank]``'s shard (version >= ``min_version``) and
        start the trainer on it; returns the version all ranks loaded."""
        assert self.puller is not None, "only satellites pull"
        error, version, t0 = "", -1, time.perf_counter()
        try:
            weights = self.puller.pull(addrs[self.rank], min_version, timeout_s)
            trainer.start_local(weights)
            version = weights.version
            log.info("rank %d: started on version %d from the core's rank %d (%d elements, %.3fs)", self.rank,
                     version, self.rank, weights.num_elements, time.perf_counter() - t0)
        except Exception as exc:  # a refused or timed-out pull, another layout: the cell says why
            error = f"{type(exc).__name__}: {exc}"
            log.error("rank %d: weights of version >= %d not loaded: %s", self.rank, min_version, error)
        failed = channel.all_ok(not error)
        loaded = channel.gather_ints(version)
        if failed or len(set(loaded)) != 1:
            trainer.stop()  # never train on some ranks' old or mixed weights
            why = f"ranks {failed} could not load weights" if failed else f"ranks loaded versions {loaded}"
            raise RuntimeError(f"{why}" + (f" ({error})" if error else ""))
        return version

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self.puller is not None:
            self.puller.close()
