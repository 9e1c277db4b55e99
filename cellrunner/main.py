"""One cell's muscle: serve with the engine or train with the trainer, as the controller says.

The cellrunner never decides its role. It obeys SwitchRole / LoadWeights / RunMicrostep /
SendGrads / ApplyStep from the controller (ZeroMQ DEALER -> the controller's ROUTER), times every
phase of a switch, and sends heartbeats from a thread of its own (``ControlLink``), so a phase
that blocks for minutes does not look like a dead cell. The core cell also owns the
authoritative weights and optimizer state (its trainer's replica lives across switches), serves
them to other cells, and takes the satellites' gradient sums, each of its ranks on its own PULL
socket from the same rank of every satellite (``cellrunner.grads``). Weights move over ZeroMQ or the Mooncake Transfer Engine
(``transfer``); gradients always over ZeroMQ.

A cell may span several processes (``cluster.ranks_per_node``, Megatron: one per GPU). Rank 0 is
this CellRunner, the cell's leader; the other ranks run ``cellrunner.follower`` and mirror its
trainer calls (``cellrunner.spmd_trainer``). Which rank a process is comes from the launcher's
environment (``base.ranks``).

    python -m cellrunner.main --config-json F --cell-id N --controller tcp://H:P
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
import zmq

from cellrunner.backends import (
    CellRunnerConfig, check_ranks, make_engine, make_rank_links, make_trainer, make_weight_publisher,
    core_export_dtype, make_weight_puller, serving_dtype, trainer_dtype,
)
from cellrunner.config import MegatronConfig
from cellrunner.errors import BackendUnavailable
from cellrunner.grads import GradExchange
from cellrunner.model import (
    FlatWeights, build_model, flatten_params, initial_weights, to_bf16, vocab_rows, weights_digest,
)
from base.ranks import CellRanks, ranks_from_env
from cellrunner.spmd import CommandChannel, solo
from cellrunner.spmd_trainer import LeaderTrainer
from cellrunner.trainer import EmbeddedTrainer
from cellrunner.transfer import WeightPublisher, WeightPuller
from base import curve, engine_key, wire
from base.checkpoints import Checkpoint
from base.lifecycle import exit_with_parent
from base.typed_config import build

log = logging.getLogger("cellrunner")


class ControlLink:
    """The cell's connection to the controller, on a thread of its own that also sends the heartbeats.

    The cell's one thread blocks far longer than ``cluster.heartbeat_timeout_s`` in some phases:
    an offload (3.1 s per 0.6B parameters measured on an H200), a full gather, a bf16 write and
    SGLang's load, a checkpoint on a shared file system. A heartbeat sent between commands would
    stop for all of that, and the controller would drop a cell that is working. Here it does not
    wait on the cell's work: it says the cell's process is alive and its phase; a cell stuck for
    good in one phase is the controller's to judge from its phase and its replies.

    ZeroMQ sockets are not thread-safe, so each has one user. The DEALER to the controller keeps
    the identity ``cell-N`` the controller knows from the Hello (it refuses a heartbeat from any
    other connection), so it is the link thread's alone; the cell's thread talks to it through an
    inproc PAIR (``sock``), whose frames pass through unchanged and in order. Both are made here
    and handed to the thread as it starts (a socket may move to another thread that way)."""

    def __init__(self, ctx: zmq.Context, identity: str, controller_addr: str,
                 beat: Callable[[], wire.Message], interval_s: float):
        self._beat, self._interval_s = beat, interval_s
        self._dealer = ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, identity.encode())
        self._dealer.setsockopt(zmq.LINGER, 1000)
        curve.client(self._dealer, "controller")
        self._dealer.connect(controller_addr)
        addr = f"inproc://gyre-control-link-{os.getpid()}-{id(self)}"
        self._inner = ctx.socket(zmq.PAIR)
        self.sock = ctx.socket(zmq.PAIR)
        """The cell's end: what it sends goes to the controller; what the controller sends arrives here."""
        for sock in (self._inner, self.sock):  # a cell busy for minutes must not stall the link
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self._inner.bind(addr)
        self.sock.connect(addr)
        self._beating = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{identity}-link", daemon=True)
        self._thread.start()

    def start_beating(self) -> None:
        self._beating.set()

    def close(self) -> None:
        """Send what the cell sent, then close (the cell's thread, after its last ``send``)."""
        self._stopping.set()
        self._thread.join(timeout=5.0 + self._interval_s)
        self.sock.close(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._inner, zmq.POLLIN)
        next_beat = 0.0
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                if self._beating.is_set() and now >= next_beat:
                    try:
                        self._dealer.send(wire.encode(self._beat()))
                    except Exception:  # a heartbeat must not end the link (the next one may go)
                        log.exception("heartbeat failed")
                    next_beat = now + self._interval_s
                wait_s = max(next_beat - time.monotonic(), 0.0) if self._beating.is_set() else self._interval_s
                events = dict(poller.poll(int(min(wait_s, self._interval_s) * 1000) + 1))
                if self._inner in events:
                    self._forward(self._inner, self._dealer)
                if self._dealer in events:
                    self._forward(self._dealer, self._inner)
            self._forward(self._inner, self._dealer)  # the cell's last words
        except Exception:  # the controller then hears nothing more and drops the cell, as a dead one
            log.exception("control link to the controller failed")
        finally:
            self._dealer.close(linger=500)
            self._inner.close(linger=0)

    @staticmethod
    def _forward(src: zmq.Socket, dst: zmq.Socket) -> None:
        while True:
            try:
                frame = src.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            dst.send(frame)


class CellRunner:
    def __init__(self, cfg: CellRunnerConfig, cell_id: int, controller_addr: str, ranks: CellRanks,
                 engine_api_key: str = ""):
        self.cfg = cfg
        self.ranks = ranks
        self.cell_id = cell_id
        self.is_core = cell_id == cfg.core_cell
        self.ctx = zmq.Context.instance()
        self.phase: wire.CellPhase = "starting"
        self.num_running = 0
        """The engine's load as the cell's thread last read it (an HTTP call with SGLang): the
        heartbeat thread reports it, never asks the engine itself."""
        self.link = ControlLink(self.ctx, f"cell-{cell_id}", controller_addr, self.heartbeat_message,
                                cfg.heartbeat_interval_s)
        self.ctl = self.link.sock
        self.vocab_size = vocab_rows(cfg.model)
        self.trainer = make_trainer(cfg, self.vocab_size, self.is_core, multi_rank=self.ranks.is_multi_rank)
        channel = None
        if self.ranks.is_multi_rank:  # the followers build theirs, then open the channel with us
            # check_ranks: a multi-rank cell is trainer=megatron, whose config has the timeout
            channel = CommandChannel(timeout_s=self.cfg.trainer.command_timeout_s)
            links, inboxes, shards = make_rank_links(cfg, self.ctx, ranks, self.is_core, channel)
            self.trainer = LeaderTrainer(self.trainer, channel, links)
            self.grads = links.grads
        else:
            self.grads = GradExchange(self.ctx, cfg.host, ranks.rank, self.is_core)
            inboxes, shards = [self.grads.addr], []
        self.core_grads_addrs = inboxes if self.is_core else []
        """The core's ranks' gradient inboxes (ours on the core; the controller's word elsewhere)."""
        self.core_rank_weights_addrs = shards if self.is_core else []
        """A multi-rank core's ranks' own shards, which a multi-rank satellite pulls to train."""
        # Collective with the followers' make_node_engine: they start their parts of the cell's
        # servers, and the engine learns every server's URL.
        self.engine = make_engine(cfg, self.vocab_size, cell_id, self.ranks, engine_api_key, channel)
        self.core_weights_addr = ""
        self.weight_server: WeightPublisher | None = None
        self.weight_puller: WeightPuller | None = None
        self.running = True

    # -- setup -----------------------------------------------------------------------------

    def setup(self) -> None:
        self.send(wire.Hello(peer="cell", cell_id=self.cell_id, pid=os.getpid()))
        if self.is_core:
            ckpt = Checkpoint(self.cfg.resume_version, Path(self.cfg.resume_from)) if self.cfg.resume_from else None
            if ckpt is not None:  # a requeued job: weights and optimizer state as they were saved
                self.trainer.restore(ckpt)
                log.info("core: resumed from %s (version %d)", ckpt.path, ckpt.version)
            else:
                self.trainer.start(None)  # version 0 from the init seed; lives for the whole run
            initial = self.trainer.weights()  # assembled once (a collective on a multi-rank core)
            # Multi-rank satellites train from each rank's own shard: no float32 whole-model slots.
            self.weight_server = make_weight_publisher(self.cfg, self.ctx, serving=True,
                                                       trainers_pull=not self.ranks.is_multi_rank)
            self.weight_server.publish(initial)
            self.weight_server.start()
            self.core_weights_addr = self.weight_server.addr
        else:
            self.weight_puller = make_weight_puller(self.cfg, self.ctx)
            initial = satellite_initial(self.cfg, self.vocab_size, trainers_pull=not self.ranks.is_multi_rank)
        self.engine.start()
        self.engine.resume(initial)
        self.phase = "serving"
        self.send(wire.CellReady(
            cell_id=self.cell_id, engine_url=self.engine.url, engine_urls=self.engine_urls(),
            weights_addr=self.core_weights_addr,
            grads_addrs=self.core_grads_addrs, is_core=self.is_core, weight_version=initial.version,
            rank_weights_addrs=self.core_rank_weights_addrs, weights_digest=weights_digest(initial),
        ))

    # -- loop --------------------------------------------------------------------------------

    def run(self) -> None:
        self.setup()
        self.link.start_beating()
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        next_load = 0.0
        while self.running:
            now = time.monotonic()
            if now >= next_load:
                self.num_running = self.engine.num_running()
                next_load = now + self.cfg.heartbeat_interval_s
            events = dict(poller.poll(int(self.cfg.heartbeat_interval_s * 1000)))
            if self.ctl in events:
                self.handle(self.ctl.recv())
        self.shutdown()

    def handle(self, frame: bytes) -> None:
        try:
            msg = wire.decode(frame)
        except wire.ProtocolError as exc:
            log.error("cell %d: rejected control frame: %s", self.cell_id, exc)
            self.send(wire.ErrorReply(where=f"cell-{self.cell_id}", message=str(exc)))
            return
        handler = self.handlers().get(type(msg))
        if handler is None:
            log.error("cell %d: %s is not a command for a cell", self.cell_id, msg.TAG)
            self.send(wire.ErrorReply(where=f"cell-{self.cell_id}", message=f"unexpected {msg.TAG}"))
            return
        try:
            handler(msg)
        except Exception as exc:  # report, keep the cell alive; the controller decides what next
            log.exception("cell %d: %s failed", self.cell_id, msg.TAG)
            self.send(wire.ErrorReply(where=f"cell-{self.cell_id}:{msg.TAG}", message=f"{type(exc).__name__}: {exc}"))

    def handlers(self):
        return {
            wire.SwitchRole: self.on_switch_role,
            wire.LoadWeights: self.on_load_weights,
            wire.RunMicrostep: self.on_run_microstep,
            wire.SendGrads: self.on_send_grads,
            wire.ApplyStep: self.on_apply_step,
            wire.Shutdown: self.on_shutdown,
            wire.ErrorReply: lambda m: log.error("cell %d: controller says: %s", self.cell_id, m.message),
        }

    # -- commands ----------------------------------------------------------------------------

    def on_switch_role(self, msg: wire.SwitchRole) -> None:
        self.core_weights_addr = msg.core_weights_addr or self.core_weights_addr
        self.core_grads_addrs = msg.core_grads_addrs or self.core_grads_addrs
        self.core_rank_weights_addrs = msg.core_rank_weights_addrs or self.core_rank_weights_addrs
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        if msg.role == "train":
            self.phase = "draining"
            aborted = self.engine.drain(self.cfg.drain_timeout_s)
            phases["drain"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            self.phase = "to_train"
            self.engine.release()
            phases["release"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            if self.is_core:
                self.trainer.start(None)
                phases["pull"] = 0.0
            else:
                phases["pull"] = self.start_satellite(msg.weight_version)
            phases["start_trainer"] = time.perf_counter() - t2 - phases["pull"]
            self.phase = "training"
            log.info("cell %d: serve -> train in %.3fs (aborted %d calls)", self.cell_id, time.perf_counter() - t0, aborted)
        else:
            self.phase = "to_serve"
            self.trainer.stop()
            phases["stop_trainer"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            weights = self.trainer.weights() if self.is_core else self.fetch_weights(msg.weight_version,
                                                                                      serving_dtype(self.cfg))
            phases["pull"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            self.engine.resume(weights)
            phases["resume_engine"] = time.perf_counter() - t2
            self.phase = "serving"
            log.info("cell %d: train -> serve in %.3fs", self.cell_id, time.perf_counter() - t0)
        self.send(wire.RoleSwitched(
            cell_id=self.cell_id, role=msg.role, weight_version=self.current_version(),
            total_s=time.perf_counter() - t0, phases_s=phases,
        ))

    def on_load_weights(self, msg: wire.LoadWeights) -> None:
        self.core_weights_addr = msg.core_weights_addr or self.core_weights_addr
        t0 = time.perf_counter()
        if self.phase == "serving":
            weights = (self.trainer.weights() if self.is_core
                       else self.fetch_weights(msg.weight_version, serving_dtype(self.cfg)))
            self.engine.update_weights(weights)
        elif self.phase == "training" and not self.is_core:
            if self.trainer.num_microsteps:
                raise RuntimeError("load_weights while holding unsent gradients")
            self.start_satellite(msg.weight_version)
        # the core's trainer replica is the authority: nothing to load
        self.send(wire.WeightsLoaded(cell_id=self.cell_id, weight_version=self.current_version(), load_s=time.perf_counter() - t0))

    def on_run_microstep(self, msg: wire.RunMicrostep) -> None:
        shard = msg.shard
        if self.phase != "training":
            raise RuntimeError(f"microstep while {self.phase}")
        if self.trainer.version != shard.step:
            raise RuntimeError(f"shard of step {shard.step} on weights version {self.trainer.version}")
        res = self.trainer.microstep(shard)
        self.send(wire.MicrostepDone(
            cell_id=self.cell_id, step=shard.step, shard_id=shard.shard_id,
            num_tokens=res.num_tokens, loss=res.loss, fb_s=res.fb_s,
            mean_ratio=res.mean_ratio, clip_fraction=res.clip_fraction, kl=res.kl,
        ))

    def fold_groups(self, groups: list[wire.GroupStats]) -> float:
        """Run-released gradients in, now that their groups are closed (only the embedded trainer
        takes run-released shards; GyreConfig.check refuses algo.release=run with Megatron)."""
        return self.trainer.fold_groups(groups) if isinstance(self.trainer, EmbeddedTrainer) else 0.0

    def on_send_grads(self, msg: wire.SendGrads) -> None:
        n = self.trainer.num_microsteps
        late_loss = self.fold_groups(msg.groups)
        if isinstance(self.trainer, LeaderTrainer):
            self.trainer.send_grads(self.core_grads_addrs, cell_id=self.cell_id, step=msg.step)
        else:
            self.grads.send(self.trainer, self.core_grads_addrs, cell_id=self.cell_id, step=msg.step, agree=solo)
        self.send(wire.GradsSent(cell_id=self.cell_id, step=msg.step, num_shards=n, late_loss=late_loss))

    def on_apply_step(self, msg: wire.ApplyStep) -> None:
        if not self.is_core or self.phase != "training":
            raise RuntimeError("apply_step needs the core cell in training")
        t0 = time.perf_counter()
        late_loss = self.fold_groups(msg.groups)
        how = dict(step=msg.step, satellites=msg.satellite_cells, num_executions=msg.num_executions,
                   timeout_s=self.cfg.transfer_timeout_s)
        if isinstance(self.trainer, LeaderTrainer):
            weights, norm = self.trainer.apply_grads(**how)
        else:
            weights, norm = self.grads.apply(self.trainer, **how, agree=solo)
        self.weight_server.publish(weights)
        if msg.checkpoint:
            log.info("core: checkpoint %s", self.trainer.save_checkpoint(self.cfg.checkpoint_dir))
        self.send(wire.StepApplied(
            cell_id=self.cell_id, step=msg.step, weight_version=weights.version,
            grad_norm=norm, apply_s=time.perf_counter() - t0, late_loss=late_loss,
        ))

    def on_shutdown(self, msg: wire.Shutdown) -> None:
        self.running = False

    # -- helpers -------------------------------------------------------------------------------

    def start_satellite(self, version: int) -> float:
        """Start the trainer on the core's weights of ``version`` (or newer); returns the pull's
        seconds. A multi-rank satellite pulls and loads in one, each rank its peer's shard."""
        t0 = time.perf_counter()
        if isinstance(self.trainer, LeaderTrainer):
            self.trainer.start_from_peers(self.core_rank_weights_addrs, min_version=version,
                                          timeout_s=self.cfg.transfer_timeout_s)
            return time.perf_counter() - t0
        weights = self.fetch_weights(version, trainer_dtype(self.cfg))
        pulled = time.perf_counter() - t0
        self.trainer.start(weights)
        return pulled

    def fetch_weights(self, version: int, dtype: wire.WeightsDtype) -> FlatWeights:
        """Version >= ``version`` from the core: the trainer's dtype for a trainer, the engine's for serving."""
        assert self.weight_puller is not None, "only satellites pull weights"
        return self.weight_puller.pull(self.core_weights_addr, version, self.cfg.transfer_timeout_s, dtype)

    def engine_urls(self) -> list[str]:
        """Every server the cell serves through (the embedded engine is one)."""
        return list(getattr(self.engine, "urls", [self.engine.url]))

    def current_version(self) -> int:
        if self.phase in ("serving", "draining"):
            return self.engine.weight_version if self.engine.weight_version is not None else -1
        return self.trainer.version

    def heartbeat_message(self) -> wire.Heartbeat:
        """Built on the link's thread while the cell's may be busy: it reads attributes only."""
        return wire.Heartbeat(
            cell_id=self.cell_id, phase=self.phase, num_running=self.num_running,
            weight_version=max(self.current_version(), 0), rss_bytes=psutil.Process().memory_info().rss,
            down_urls=list(getattr(self.engine, "down_urls", ())) if self.phase == "serving" else [],
        )

    def send(self, msg: wire.Message) -> None:
        self.ctl.send(wire.encode(msg))

    def shutdown(self) -> None:
        if self.is_core and self.trainer.model is not None:
            path = self.trainer.save_checkpoint(self.cfg.checkpoint_dir)
            log.info("core: saved weights and optimizer state of version %d to %s", self.trainer.version, path)
        if isinstance(self.trainer, LeaderTrainer):
            self.trainer.close()
            self.trainer.links.close()
        else:
            self.grads.close()
        self.engine.stop()
        if self.weight_server is not None:
            self.weight_server.close()
        if self.weight_puller is not None:
            self.weight_puller.close()
        self.link.close()
        curve.stop()


def satellite_initial(cfg: CellRunnerConfig, vocab_size: int, *, trainers_pull: bool) -> FlatWeights:
    """Version 0 as a satellite's engine starts from it without asking the core: the same values,
    in the same dtype, as the core's first export, so their digests agree (``CellReady``)."""
    # A Megatron core exports per-expert HF names whatever transformers builds: read them.
    initial = (initial_weights(cfg.model, vocab_size) if isinstance(cfg.trainer, MegatronConfig)
               else flatten_params(build_model(cfg.model, vocab_size), 0))
    if trainer_dtype(cfg) == "bfloat16":
        # The core's version 0 is its bf16 parameters: start from the same values (a bf16
        # checkpoint loses nothing; a float32 one is rounded here as the core rounded it).
        initial = to_bf16(initial)
    export = core_export_dtype(cfg, trainers_pull=trainers_pull)
    if export == "bfloat16" and initial.dtype != "bfloat16":  # what the core's bf16 export rounds to
        initial = to_bf16(initial)
    elif export == "float32" and initial.dtype != "float32":  # bf16 values, widened exactly
        initial = FlatWeights(0, initial.specs, initial.tensor().float().numpy())
    return initial


def main() -> None:
    # Everything a run writes (checkpoints, logs, prompts, task files with gold patches and hidden
    # tests) is the run user's alone on a shared node: files 0600, folders 0700.
    os.umask(0o077)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--cell-id", type=int, required=True)
    ap.add_argument("--controller", required=True)
    ap.add_argument("--curve-keys", default="", help="the run's CURVE keys folder (base.curve); '' for plain sockets")
    ap.add_argument("--engine-key-file", default="",
                    help="0600 file with the run's engine API key (base.engine_key); '' for an open engine")
    args = ap.parse_args()
    with open(args.config_json) as f:
        cfg = build(CellRunnerConfig, json.load(f))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s cell{args.cell_id} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(cfg.torch_threads)
    try:
        ranks = ranks_from_env(os.environ)
        check_ranks(cfg, ranks)
        curve.install(args.curve_keys, f"cell-{args.cell_id}", core=f"cell-{cfg.core_cell}")
        api_key = engine_key.read_key(args.engine_key_file) if args.engine_key_file else ""
    except (ValueError, OSError, curve.CurveError) as exc:
        log.error("cell %d: %s", args.cell_id, exc)
        raise SystemExit(2) from None
    exit_with_parent()  # a controller that died without stopping us
    try:
        if not ranks.is_leader:
            from cellrunner.follower import run_follower

            run_follower(cfg, args.cell_id, ranks, vocab_rows(cfg.model), api_key)
        else:
            runner = CellRunner(cfg, args.cell_id, args.controller, ranks, api_key)
            signal.signal(signal.SIGTERM, lambda *_: setattr(runner, "running", False))
            runner.run()
    except BackendUnavailable as exc:  # a setup problem, not a bug: say what to install, no traceback
        log.error("cell %d: %s", args.cell_id, exc)
        raise SystemExit(2) from None
    if ranks.is_multi_rank:
        # Everything is saved and every socket closed by now. The interpreter's teardown of
        # megatron-core and a process group takes seconds, which srun would count against the
        # step's polite end (it is then cancelled, not completed): leave at once.
        log.info("cell %d: rank %d done", args.cell_id, ranks.rank)
        logging.shutdown()
        os._exit(0)


if __name__ == "__main__":
    main()
