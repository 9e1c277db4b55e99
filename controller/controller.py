"""The one brain: starts the processes, runs the execution lifecycle, steps and role switches.

One thread, one ZeroMQ ROUTER: cellrunners, the proxy and the processor are DEALER peers. Each
tick gathers state (messages, harness exits, heartbeats), asks the pure scheduler what to do,
and applies it. Every decoded message is validated; a bad one is logged and answered with an
ErrorReply, and the run goes on. Its child services (processor, proxy) are a
``controller.services.RunServices`` it owns; its stages walk ``controller.stages.STAGES``.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from pathlib import Path

import zmq

from base import curve, wire
from controller.cells import Cell, CellRegistry
from base.checkpoints import due, latest_checkpoint, prune
from controller.config import GyreConfig
from controller.health import HealthMonitor
from controller.executions import Execution, ExecutionManager
from controller.processes import CellLauncher, LocalCells, StartError, log_tail
from controller.loggers import build_loggers
from controller.report import MetricsSink
from controller.scheduler import SchedulerView, decide, executions_at_apply, launch_room, steps_to_plan
from controller.services import RunFailed, RunServices, cellrunner_config, make_keys, make_run_dir
from controller.slurm_launch import SlurmCells, resolve_host
from controller.stages import EvalRound, RunStages, Stage
from controller.step_stats import StepFigures
from controller.steps import StepCoordinator
from workloads.parts import build_parts, cgroup_run_name

log = logging.getLogger(__name__)

# Some live in controller.services and controller.stages; importable here, where callers look.
__all__ = ["Controller", "EvalRound", "RunFailed", "cellrunner_config", "make_run_dir"]

MAX_REPLACEMENT_GROUPS_PER_STEP = 4


class Controller(RunStages):
    def __init__(self, cfg: GyreConfig, run_dir: Path):
        self.cfg = cfg
        self.run_dir = run_dir.resolve()  # sandboxes bind paths (workspaces, the proxy's socket) as they are
        self.log_dir = run_dir / "logs"
        # Where cells run: one explicit choice per cluster.kind (the node list is read here, so a
        # bad allocation fails before any process starts).
        self.cell_launcher: CellLauncher = (
            SlurmCells.from_env(cfg.cluster.num_cells, ranks_per_node=cfg.cluster.ranks_per_node,
                                multi_rank=cfg.trainer.kind == "megatron", dist_port=cfg.cluster.dist_port)
            if cfg.cluster.kind == "slurm"
            else LocalCells(cfg.cluster.ranks_per_node, cfg.cluster.dist_port, cfg.cluster.host))
        self.host = resolve_host(cfg.cluster.host)
        # This attempt's own context, terminated at its shutdown: a new attempt in the same process
        # (run.auto_resume) starts on a clean one, with its own ZAP handler and inproc names.
        self.ctx = zmq.Context()
        keys_dir = make_keys(cfg.cluster, run_dir)
        curve.install(keys_dir, "controller")
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        curve.server(self.sock)
        self.sock.bind(f"tcp://{self.host}:{cfg.cluster.controller_port}")
        self.addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.cells = CellRegistry(cfg.cluster.num_cells, cfg.cluster.core_cell)
        self.steps = StepCoordinator(
            core_cell=cfg.cluster.core_cell, total_steps=cfg.run.steps, checkpoint_every=cfg.run.checkpoint_every)
        # A requeued job (same run folder): the core starts from the newest complete checkpoint.
        self.resume_from = latest_checkpoint(run_dir / "checkpoints") if cfg.run.resume else None
        # Read before this attempt appends: a streak or a fall that spans a resume is still seen.
        self.health = HealthMonitor(cfg.health, run_dir / "metrics.jsonl")
        self.metrics = MetricsSink(run_dir / "metrics.jsonl", build_loggers(cfg.logger, run_dir, cfg))
        self.step_figures = StepFigures()
        # What the run works on and through what (task set, harness, sandbox): built before any
        # process starts, so a missing harness binary or sandbox stops the run here.
        self.parts = build_parts(cfg.workload, cfg.harness, cfg.sandbox, run_name=cgroup_run_name(run_dir))
        self.train_tasks, self.eval_tasks = self.parts.taskset.split()
        self.rng = random.Random(cfg.run.seed)
        self.secret = secrets.token_bytes(32)
        self.executions: ExecutionManager | None = None
        self.last_execution_error = ""
        self.routing_version = 0
        self.routed: tuple = ()
        self.planned_steps = 0
        self.replacements: dict[int, int] = {}
        self.group_last_end: dict[str, float] = {}  # training group -> its latest run's end (monotonic)
        self.stage: Stage = "starting"  # moved by set_stage, along controller.stages.STAGES
        self.facts_seen: set[str] = set()
        self.closing_until = 0.0
        self.evals: list[EvalRound] = []
        self.eval_from = 0
        self.step_rewards: list[tuple[int, float]] = []
        self.num_bad_frames = 0
        self.num_groups_dropped = 0
        self.identities: dict[str, bytes] = {}
        # Grades the processor may not have logged yet, resent when a restarted processor says
        # Hello; one leaves when the processor says it has it (ExecutionFacts, GroupDone).
        self.grades_owed: dict[str, wire.Grade] = {}
        self.delivered = wire.Delivered()  # what the processor sent that we took, acknowledged per tick
        self.sealed: list[str] = []  # executions whose SealExecution went out, again to a new proxy
        self.start_digests: dict[int, tuple[int, str]] = {}  # weight version -> (first cell, its weights digest)
        self.ident_names: dict[bytes, str] = {}  # the reverse, for the per-frame sender check
        self.t0 = time.monotonic()
        self.next_progress = 0.0
        # The processor and the proxy, and what the run's children are started with.
        self.services = RunServices(cfg, self.run_dir, self.log_dir, controller_addr=self.addr, keys_dir=keys_dir,
                                    secret=self.secret, metrics=self.metrics, t0=self.t0)

    # ================================================================ start and stop

    def start(self) -> None:
        c, svc = self.cfg, self.services
        proxy = svc.start(f"tcp://{self.host}:0", c.proxy.port, host=self.host)
        self.executions = ExecutionManager(
            workload=c.workload, taskset=self.parts.taskset, harness=self.parts.harness, sandbox=self.parts.sandbox,
            work_dir=svc.attempt_dir("work"), proxy=proxy,
            model_name=c.proxy.model_name, secret=self.secret, limits=self.parts.limits, cgroups=self.parts.cgroups,
        )
        cell_cfg = cellrunner_config(c, checkpoint_dir=self.run_dir / "checkpoints", log_dir=self.log_dir,
                                     resume_from=self.resume_from, kv_tier_address=svc.kv_tier_address)
        cfg_path = svc.write_json("cellrunner.json", cell_cfg)
        for cell in self.cells.cells.values():
            cell.proc = self.cell_launcher.launch(
                cell.cell_id, ["--config-json", str(cfg_path), "--cell-id", str(cell.cell_id), "--controller", self.addr,
                               *svc.curve_args(), *svc.engine_key_args()],
                self.log_dir)
        deadline = time.monotonic() + c.cluster.start_timeout_s
        # Grades and routing tables go to peers by name: wait for every Hello, not just the cells.
        while (any(cell.phase == "starting" for cell in self.cells.cells.values())
               or not {"processor", "proxy"} <= self.identities.keys()):
            if time.monotonic() > deadline:
                raise StartError(f"not ready in time; peers heard from: {sorted(self.identities)}")
            for cell in self.cells.cells.values():
                if cell.proc.poll() is not None and cell.phase == "starting":
                    raise StartError(f"cell {cell.cell_id} exited:\n{log_tail(self.log_dir, f'cell{cell.cell_id}')}")
            self._drain_socket(timeout_ms=100)
        self.resume_from_core()
        self.eval_from = self.steps.version
        self.push_routing()
        svc.write_endpoints(self.cells)
        self.set_stage("eval_start" if c.run.eval_at_start and self.steps.version == 0 else "train")
        if self.stage == "eval_start":
            self.start_eval("start")
        log.info("gyre: %d cells up, proxy at %s, controller at %s", len(self.cells.cells), svc.proxy_url, self.addr)

    def resume_from_core(self) -> None:
        """A requeued job: the core came up from checkpoint N > 0 (``self.resume_from``), so the run
        goes on at step N (the start eval was done by the first attempt) and satellites pull N."""
        version = self.cells.cells[self.cfg.cluster.core_cell].weight_version
        expected = self.resume_from.version if self.resume_from else 0
        if version != expected:
            raise StartError(f"the core started at version {version}, the controller resumed it from {expected}")
        if version == 0:
            return
        if version >= self.cfg.run.steps:
            log.warning("gyre: the checkpoint is at version %d, run.steps is %d: nothing left to train",
                        version, self.cfg.run.steps)
        self.steps.version = version
        self.planned_steps = version
        self.metrics.log("resumed", t=time.monotonic() - self.t0, weight_version=version)
        log.info("gyre: resuming at step %d from the core's checkpoint", version)
        for cell in self.cells.cells.values():
            if not cell.is_core:
                self.send_to(f"cell-{cell.cell_id}",
                             wire.LoadWeights(weight_version=version, core_weights_addr=self.core_addr()))

    def shutdown(self) -> None:
        if self.executions is not None:
            self.executions.kill_all()
        self.parts.close()
        for cell in self.cells.alive():
            self.send_to(f"cell-{cell.cell_id}", wire.Shutdown(reason="run over"))
        self.services.shutdown([c.proc for c in self.cells.cells.values() if c.proc is not None])
        self.metrics.close()
        self.sock.close(0)
        curve.stop(self.ctx)
        self.ctx.term()

    # ================================================================ the loop

    def run(self) -> None:
        while self.stage != "done":
            self.tick()

    def tick(self) -> None:
        self._drain_socket(timeout_ms=20)
        self.send_delivered()
        now = time.monotonic()
        for ex in self.executions.poll(now):
            self.on_execution_ended(ex)
        self.check_cells(now)
        self.services.check_services()
        self.plan_steps()
        self.launch_executions(now)
        self.apply_schedule(now)
        self.drive_steps()
        self.push_routing()
        self.advance_stage()
        if now >= self.next_progress:
            self.progress(now)
            self.next_progress = now + self.cfg.run.progress_every_s

    def _drain_socket(self, timeout_ms: int) -> None:
        if not self.sock.poll(timeout_ms):
            return
        while True:
            try:
                ident, body = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)[:2]
            except zmq.Again:
                return
            except ValueError:
                self.num_bad_frames += 1
                log.error("control socket: a frame without identity and body; ignored")
                continue
            self.on_frame(ident.bytes, body.bytes, curve.sender(body))

    # ================================================================ messages in

    def on_frame(self, ident: bytes, frame: bytes, sender: str | None = None) -> None:
        """``sender``: the run member CURVE authenticated for the connection (None with CURVE off)."""
        if sender is not None and self.ident_names.get(ident, sender) != sender:
            self.num_bad_frames += 1
            log.error("control socket: %r is %s's connection, but %s sent on it; ignored", ident,
                      self.ident_names[ident], sender)
            return
        try:
            msg = wire.decode(frame)
        except wire.ProtocolError as exc:
            self.num_bad_frames += 1
            log.error("control socket: rejected frame from %r: %s", ident, exc)
            self.send_raw(ident, wire.ErrorReply(where="controller", message=str(exc)))
            return
        handler = {
            wire.Hello: self.on_hello, wire.CellReady: self.on_cell_ready, wire.Heartbeat: self.on_heartbeat,
            wire.ServiceHeartbeat: self.on_service_heartbeat,
            wire.RoleSwitched: self.on_role_switched, wire.MicrostepDone: self.on_microstep_done,
            wire.GradsSent: self.on_grads_sent, wire.StepApplied: self.on_step_applied,
            wire.WeightsLoaded: self.on_weights_loaded, wire.ShardReady: self.on_shard_ready,
            wire.GroupDone: self.on_group_done, wire.ExecutionFacts: self.on_execution_facts,
            wire.ErrorReply: self.on_error_reply,
        }.get(type(msg))
        if handler is None:
            self.num_bad_frames += 1
            log.error("control socket: %s from %r is not a message for the controller", msg.TAG, ident)
            self.send_raw(ident, wire.ErrorReply(where="controller", message=f"unexpected {msg.TAG}"))
            return
        if isinstance(msg, wire.Hello):
            self.on_hello(ident, msg, sender)
        else:
            handler(ident, msg)

    def send_delivered(self) -> None:
        """Tell the processor which of its shards and GroupDones we took (duplicates included), so
        it logs them as delivered and never sends them again."""
        if self.delivered.shard_ids or self.delivered.group_ids:
            self.send_to("processor", self.delivered)
            self.delivered = wire.Delivered()

    def on_hello(self, ident: bytes, msg: wire.Hello, sender: str | None = None) -> None:
        name = msg.peer if msg.peer != "cell" else f"cell-{msg.cell_id}"
        if msg.peer == "cell" and msg.cell_id not in self.cells.cells:
            self.send_raw(ident, wire.ErrorReply(where="controller", message=f"no cell {msg.cell_id}"))
            return
        if sender is not None and sender != name:
            # A member may speak only as itself: without this, any process that can send a Hello
            # would take over the identity `processor`, `proxy` or `cell-N` and get its messages.
            self.num_bad_frames += 1
            log.error("control socket: %s said Hello as %s; refused", sender, name)
            self.send_raw(ident, wire.ErrorReply(where="controller", message=f"you are not {name}"))
            return
        old = self.identities.get(name)
        if old is not None:
            self.ident_names.pop(old, None)
        self.identities[name] = ident
        self.ident_names[ident] = name
        if name in ("processor", "proxy"):
            self.services.heard_from(name)
        if name == "processor" and old is not None and self.grades_owed:
            # A restarted processor: it replayed its log; what it may not have logged, it gets
            # again (it drops grades it has by execution).
            log.info("processor back: resending %d grade(s) it may not have logged", len(self.grades_owed))
            for grade in list(self.grades_owed.values()):
                self.send_to("processor", grade)
        if name == "proxy" and old is not None:
            # A restarted proxy knows no routes and no sealed execution: it gets the table, and
            # every seal again, so an ended execution's token stays refused (a seal it sends the
            # processor twice is dropped there).
            log.info("proxy back: routing table and %d seal(s) again", len(self.sealed))
            self.routed = ()
            self.push_routing()
            for execution_id in self.sealed:
                self.send_to("proxy", wire.SealExecution(execution_id=execution_id))

    def _cell(self, ident: bytes, cell_id: int) -> Cell | None:
        cell = self.cells.cells.get(cell_id)
        if cell is None or self.identities.get(f"cell-{cell_id}") != ident:
            self.num_bad_frames += 1
            log.error("control socket: %r speaks for cell %d, which it is not", ident, cell_id)
            self.send_raw(ident, wire.ErrorReply(where="controller", message=f"not cell {cell_id}"))
            return None
        return cell

    def on_cell_ready(self, ident: bytes, msg: wire.CellReady) -> None:
        cell = self._cell(ident, msg.cell_id)
        if cell is None or cell.phase != "starting":
            return
        cell.engine_url, cell.weights_addr, cell.grads_addrs = msg.engine_url, msg.weights_addr, msg.grads_addrs
        cell.engine_urls = msg.serving_urls()
        cell.rank_weights_addrs = msg.rank_weights_addrs
        cell.weight_version = msg.weight_version
        now = time.monotonic()
        self.metrics.log("cell_ready", t=now - self.t0, cell=cell.cell_id, weight_version=msg.weight_version,
                         weights_digest=msg.weights_digest, num_servers=len(cell.engine_urls))
        self._check_same_start(cell.cell_id, msg.weight_version, msg.weights_digest)
        cell.last_seen = now
        cell.phase_since = now
        cell.set_phase("serving", now)

    def _check_same_start(self, cell_id: int, version: int, digest: str) -> None:
        """Two cells serving one version from different bytes would train on samples of a policy
        that does not exist (a satellite on its own random init, a stale folder on one node)."""
        if not digest:
            return
        first = self.start_digests.setdefault(version, (cell_id, digest))
        if first[1] != digest:
            raise RunFailed(f"cell {cell_id} starts version {version} from other weights than cell {first[0]} "
                            f"(digest {digest} against {first[1]}): every cell must load the same model.path")

    def on_heartbeat(self, ident: bytes, msg: wire.Heartbeat) -> None:
        cell = self._cell(ident, msg.cell_id)
        if cell is not None:
            cell.last_seen = time.monotonic()
            cell.num_running = msg.num_running
            went, back = cell.set_down(msg.down_urls)
            for url in went:
                log.warning("cell %d: server %s stopped answering: no calls go to it until it answers",
                            cell.cell_id, url)
            for url in back:
                log.info("cell %d: server %s answers again: calls go to it", cell.cell_id, url)
            if went or back:
                self.push_routing()

    def on_service_heartbeat(self, ident: bytes, msg: wire.ServiceHeartbeat) -> None:
        if self.identities.get(msg.peer) != ident:
            self.num_bad_frames += 1
            log.error("control socket: %r sent a heartbeat as the %s, which it is not", ident, msg.peer)
            self.send_raw(ident, wire.ErrorReply(where="controller", message=f"not the {msg.peer}"))
            return
        self.services.heard_from(msg.peer)

    def on_role_switched(self, ident: bytes, msg: wire.RoleSwitched) -> None:
        cell = self._cell(ident, msg.cell_id)
        if cell is None or cell.phase == "dead":
            return
        now = time.monotonic()
        cell.set_phase("training" if msg.role == "train" else "serving", now)
        cell.weight_version = msg.weight_version
        cell.switches.append({"role": msg.role, "total_s": msg.total_s, "phases_s": msg.phases_s})
        self.metrics.log("switch", t=now - self.t0, cell=cell.cell_id, role=msg.role, total_s=msg.total_s, phases_s=msg.phases_s)
        if msg.weight_version < self.steps.version and not cell.is_core:
            self.send_to(f"cell-{cell.cell_id}", wire.LoadWeights(weight_version=self.steps.version, core_weights_addr=self.core_addr()))

    def on_microstep_done(self, ident: bytes, msg: wire.MicrostepDone) -> None:
        if self._cell(ident, msg.cell_id) is not None:
            shard = self.steps.on_microstep_done(msg.cell_id, msg.step, msg.shard_id, msg.loss, msg.num_tokens)
            if shard is not None:
                self.step_figures.on_microstep(msg)
            self.metrics.log("microstep", t=time.monotonic() - self.t0, cell=msg.cell_id, step=msg.step,
                             shard=msg.shard_id, fb_s=msg.fb_s, num_tokens=msg.num_tokens, mean_ratio=msg.mean_ratio,
                             clip_fraction=msg.clip_fraction, kl=msg.kl,
                             run_released=shard is not None and shard.run_released)

    def on_grads_sent(self, ident: bytes, msg: wire.GradsSent) -> None:
        if self._cell(ident, msg.cell_id) is not None:
            self.steps.on_grads_sent(msg.cell_id, msg.step, msg.late_loss)
            self.metrics.log("grads_sent", t=time.monotonic() - self.t0, cell=msg.cell_id, step=msg.step)

    def on_step_applied(self, ident: bytes, msg: wire.StepApplied) -> None:
        core = self._cell(ident, msg.cell_id)
        if core is None:
            return
        st = self.steps.on_step_applied(msg.step, msg.weight_version, msg.late_loss)
        core.weight_version = msg.weight_version
        if due(msg.weight_version, self.cfg.run.checkpoint_every):  # the core saved it before it said so
            pruned = prune(self.run_dir / "checkpoints", self.cfg.run.keep_checkpoints)
            if pruned:
                log.info("checkpoints: kept the newest %d, deleted %s", self.cfg.run.keep_checkpoints, pruned)
        now = time.monotonic()
        if st.mean_reward is not None:
            self.step_rewards.append((msg.step, st.mean_reward))
        ev = dict(
            step=msg.step, weight_version=msg.weight_version, reward_mean=st.mean_reward,
            num_executions=st.num_executions, groups_dropped=st.groups_dropped, loss=st.loss,
            num_tokens=st.num_tokens, grad_norm=msg.grad_norm, apply_s=msg.apply_s,
            trainers=sorted(st.done_by_cell), **self.step_figures.figures(msg.step, st),
        )
        health_fields, warnings = self.health.observe(ev)
        self.metrics.log("step", t=now - self.t0, **ev, **health_fields)
        for w in warnings:
            log.warning("health: %s", w.message)
            self.metrics.log("health", t=now - self.t0, **w.fields())
        log.info("step %d applied -> version %d (reward %.3f, %d executions, %d shards on cells %s)",
                 msg.step, msg.weight_version, st.mean_reward or 0.0, st.num_executions,
                 sum(len(v) for v in st.done_by_cell.values()), sorted(st.done_by_cell))
        for cell in self.cells.in_phase("serving", "training"):
            if not cell.is_core:
                self.send_to(f"cell-{cell.cell_id}", wire.LoadWeights(weight_version=msg.weight_version, core_weights_addr=self.core_addr()))
            elif cell.phase == "serving":
                self.send_to(f"cell-{cell.cell_id}", wire.LoadWeights(weight_version=msg.weight_version, core_weights_addr=""))

    def on_weights_loaded(self, ident: bytes, msg: wire.WeightsLoaded) -> None:
        cell = self._cell(ident, msg.cell_id)
        if cell is not None:
            cell.weight_version = msg.weight_version
            self.metrics.log("weights_loaded", t=time.monotonic() - self.t0, cell=msg.cell_id,
                             weight_version=msg.weight_version, load_s=msg.load_s)
            self.push_routing()  # now, not at the end of the tick: the new step's first calls wait for it

    def on_shard_ready(self, ident: bytes, msg: wire.ShardReady) -> None:
        if self._is_peer(ident, "processor"):
            self.steps.on_shard(msg.shard)  # a resend is dropped there, by shard id
            self.delivered.shard_ids.append(msg.shard.shard_id)

    def on_group_done(self, ident: bytes, msg: wire.GroupDone) -> None:
        if not self._is_peer(ident, "processor"):
            return
        self.delivered.group_ids.append(msg.group_id)
        for eid in [e for e, g in self.grades_owed.items() if g.group_id == msg.group_id]:
            del self.grades_owed[eid]
        if not self.steps.is_new_group(msg):
            log.warning("group %s of step %d taken before: a resend; dropped", msg.group_id, msg.step)
            return
        last_end = self.group_last_end.pop(msg.group_id, None)
        # From the group's last run ending to its shard reaching us: grading, tree building, packing
        # (what the simulator calls grade_s; bench.elastic measures it from these events).
        self.metrics.log("group", t=time.monotonic() - self.t0, step=msg.step, group=msg.group_id,
                         num_usable=msg.num_usable,
                         shard_latency_s=None if last_end is None else time.monotonic() - last_end)
        if self.steps.on_group_done(msg):
            self.num_groups_dropped += 1
            n = self.replacements.get(msg.step, 0)
            log.warning("group %s of step %d dropped (%s)%s", msg.group_id, msg.step, msg.dropped,
                        "; planning a replacement" if n < MAX_REPLACEMENT_GROUPS_PER_STEP else "")
            if n < MAX_REPLACEMENT_GROUPS_PER_STEP:
                self.replacements[msg.step] = n + 1
                self.plan_groups(msg.step, 1, tag=f"r{n}")
                return
            st = self.steps.steps.get(msg.step)
            if st is not None and st.rollouts_done and st.num_executions == 0:
                # Nothing left to train this step on and no replacement to wait for: stop with the
                # reason rather than wait forever (a harness that cannot start, a grader that always fails).
                raise RunFailed(
                    f"step {msg.step}: every group was dropped, {n} replacements included (too few usable "
                    f"executions: {self.executions.num_crashed} crashed, {self.executions.num_grade_failed} grader "
                    f"failures so far); the last execution error: {self.last_execution_error or '-'}")

    def on_execution_facts(self, ident: bytes, msg: wire.ExecutionFacts) -> None:
        """What an execution did, counted from its CallRecords by the processor (the report's
        per-execution and per-harness tables read these)."""
        if not self._is_peer(ident, "processor"):
            return
        self.facts_seen.add(msg.execution_id)
        self.grades_owed.pop(msg.execution_id, None)  # facts come once its grade is in the processor's log
        ex = self.executions.executions.get(msg.execution_id) if self.executions else None
        if ex is not None and ex.train:
            self.step_figures.on_facts(ex.step, msg)
        self.metrics.log("execution_facts", t=time.monotonic() - self.t0, **wire.to_plain(msg))

    def on_error_reply(self, ident: bytes, msg: wire.ErrorReply) -> None:
        log.error("peer %r reports an error in %s: %s", ident, msg.where, msg.message)

    def _is_peer(self, ident: bytes, name: str) -> bool:
        if self.identities.get(name) == ident:
            return True
        self.num_bad_frames += 1
        log.error("control socket: %r sent a %s-only message", ident, name)
        self.send_raw(ident, wire.ErrorReply(where="controller", message=f"only the {name} sends this"))
        return False

    # ================================================================ messages out

    def send_raw(self, ident: bytes, msg: wire.Message) -> None:
        try:
            self.sock.send_multipart([ident, wire.encode(msg)])
        except zmq.ZMQError as exc:  # EHOSTUNREACH under ROUTER_MANDATORY: the peer is gone
            log.warning("control socket: cannot reach %r: %s", ident, exc)

    def send_to(self, name: str, msg: wire.Message) -> None:
        ident = self.identities.get(name)
        if ident is None:
            log.error("no peer %s to send %s to", name, msg.TAG)
            return
        self.send_raw(ident, msg)

    def core_addr(self) -> str:
        return self.cells.core.weights_addr

    def push_routing(self) -> None:
        """Every serving engine, with the weight version it serves. Which engine may take a call is
        the proxy's per-call check against the floor in the execution's token (step - staleness
        for training, the evaluated version for eval), so no floor is applied here."""
        routes = self.cells.routes()
        if routes == self.routed or "proxy" not in self.identities:
            return
        self.routed = routes
        self.routing_version += 1
        self.send_to("proxy", wire.RoutingTable(
            version=self.routing_version, engines=[wire.EngineRoute(cell_id=i, url=u, weight_version=v) for i, u, v in routes]))

    # ================================================================ executions

    def plan_steps(self) -> None:
        if self.stage != "train":
            return
        limit = steps_to_plan(version=self.steps.version, staleness=self.cfg.scheduler.staleness,
                              total_steps=self.cfg.run.steps)
        while self.planned_steps < limit:
            self.plan_groups(self.planned_steps, self.cfg.workload.groups_per_step, tag="g")
            self.planned_steps += 1

    def plan_groups(self, step: int, num_groups: int, *, tag: str) -> None:
        w = self.cfg.workload
        self.steps.plan(step, num_groups)
        for g in range(num_groups):
            task = self.rng.choice(self.train_tasks)
            self.executions.plan_group(step=step, group_id=f"s{step}-{tag}{g}", task=task, train=True,
                                       temperature=self.cfg.algo.rollout.temperature, size=w.group_size,
                                       min_version=step - self.cfg.scheduler.staleness)

    def launch_executions(self, now: float) -> None:
        # elastic keeps the core's slots free while the core is due to train (scheduler.launch_room)
        room = launch_room(self.scheduler_view(), self.cfg.scheduler)
        if room <= 0:
            return
        # Eval first (it gates the stage), then the oldest step's groups.
        queued = sorted(self.executions.queued(), key=lambda ex: (ex.train, ex.step))
        for ex in queued[:room]:
            self.executions.launch(ex, now)

    def on_execution_ended(self, ex: Execution) -> None:
        self.metrics.log("execution", t=time.monotonic() - self.t0, id=ex.execution_id, step=ex.step, train=ex.train,
                         task=ex.task.task_id, harness=self.cfg.harness.kind, outcome=ex.outcome,
                         run_s=ex.ended_at - ex.started_at, reward=ex.reward, state=ex.state,
                         error=ex.error[:300] if ex.error else "")
        if ex.error:
            self.last_execution_error = f"{ex.execution_id}: {ex.error[:500]}"
        if ex.train:  # the processor answers a training group with GroupDone, which takes this out
            self.group_last_end[ex.group_id] = max(ex.ended_at, self.group_last_end.get(ex.group_id, 0.0))
        grade = wire.Grade(
            execution_id=ex.execution_id, group_id=ex.group_id, step=ex.step, group_size=ex.group_size,
            outcome=ex.outcome, reward=ex.reward, train=ex.train,
        )
        self.grades_owed[ex.execution_id] = grade
        self.send_to("processor", grade)
        self.sealed.append(ex.execution_id)
        self.send_to("proxy", wire.SealExecution(execution_id=ex.execution_id))

    # ================================================================ cells, roles, steps

    def check_cells(self, now: float) -> None:
        for cell in self.cells.alive():
            if cell.phase == "starting":
                continue
            exited = cell.proc is not None and cell.proc.poll() is not None
            silent = now - cell.last_seen > self.cfg.cluster.heartbeat_timeout_s
            if not (exited or silent):
                continue
            why = f"exited with {cell.proc.returncode}" if exited else f"silent for {now - cell.last_seen:.1f}s"
            log.error("cell %d %s: dropped; its calls are re-routed and its microsteps re-queued", cell.cell_id, why)
            cell.set_phase("dead", now)
            self.metrics.log("cell_lost", t=now - self.t0, cell=cell.cell_id, why=why)
            if cell.proc is not None and not exited:
                cell.proc.kill()
            self.steps.on_cell_lost(cell.cell_id)
            if cell.is_core:
                # The core owns the weights and the optimizer state: a satellite holds the weights
                # but not the optimizer's moments, so the run restarts from the newest checkpoint
                # (what is lost: the steps since it and the runs in flight).
                raise RunFailed(
                    f"the core cell {cell.cell_id} {why}; it owns the weights and optimizer state; its log ends:\n"
                    f"{log_tail(self.log_dir, f'cell{cell.cell_id}', 8)}\n"
                    f"start the run again with run.run_id={self.run_dir.name} to resume from its newest checkpoint",
                    resumable=True)

    def scheduler_view(self) -> SchedulerView:
        st = self.steps.current
        return SchedulerView(
            cells=self.cells.views(self.steps.busy_cells()),
            queued=self.executions.count("queued"),
            running=self.executions.count("running"),
            queued_ahead=self.executions.queued_after(st.step + 1) if st is not None and self.stage == "train" else 0,
            running_ahead=self.executions.running_after(st.step) if st is not None and self.stage == "train" else 0,
            rollouts_pending=self.stage in ("train", "eval_start") and self.planned_steps < self.cfg.run.steps,
            train_demand=self.steps.train_demand() if self.stage == "train" else 0,
            step_rollouts_done=st is not None and st.rollouts_done,
            ready_microsteps=len(st.ready) if st is not None and self.stage == "train" else 0,
            queued_at_apply=executions_at_apply(
                version=self.steps.version, staleness=self.cfg.scheduler.staleness, total_steps=self.cfg.run.steps,
                planned=self.planned_steps, per_step=self.cfg.workload.groups_per_step * self.cfg.workload.group_size,
            ) if self.stage == "train" else 0,
            steps_left=self.cfg.run.steps - self.steps.version,
            # a resumed attempt fills its pipeline again from the checkpoint's version
            updates_applied=self.steps.version - (self.resume_from.version if self.resume_from else 0),
            grading_groups=self.grading_groups(),
        )

    def grading_groups(self) -> int:
        """Groups of the trainable step whose runs all ended and whose GroupDone is not in yet."""
        st = self.steps.current
        if st is None or self.stage != "train":
            return 0
        return len(self.executions.ended_groups(st.step) - st.groups.keys())

    def apply_schedule(self, now: float) -> None:
        for sw in decide(self.scheduler_view(), self.cfg.scheduler):
            cell = self.cells.cells[sw.cell_id]
            cell.set_phase("draining" if sw.role == "train" else "to_serve", now)
            self.send_to(f"cell-{cell.cell_id}", wire.SwitchRole(
                cell_id=cell.cell_id, role=sw.role, weight_version=self.steps.version,
                core_weights_addr=self.core_addr(), core_grads_addrs=self.cells.core.grads_addrs,
                core_rank_weights_addrs=self.cells.core.rank_weights_addrs,
            ))
        self.push_routing()

    def drive_steps(self) -> None:
        # assign and finish do nothing without a trainable step
        holding = [c.cell_id for c in self.cells.in_phase("training") if c.weight_version == self.steps.version]
        order = sorted(holding, key=lambda i: (i != self.cfg.cluster.core_cell, i))
        for cell_id, msg in self.steps.assign(order, in_flight=self.cfg.cluster.microsteps_in_flight):
            self.send_to(f"cell-{cell_id}", msg)
        core_training = self.cells.core.phase == "training"
        for cell_id, msg in self.steps.finish(core_training=core_training):
            self.send_to(f"cell-{cell_id}", msg)

    def progress(self, now: float) -> None:
        roles = " ".join(f"{c.cell_id}{'*' if c.is_core else ''}:{c.phase[:5]}" for c in self.cells.cells.values())
        last = self.step_rewards[-1][1] if self.step_rewards else float("nan")
        line = (f"[{now - self.t0:6.1f}s] {self.stage:9s} step {self.steps.version}/{self.cfg.run.steps} "
                f"reward {last:.3f} | live {self.executions.count('queued')}q/{self.executions.count('running')}r "
                f"| demand {self.steps.train_demand()} | cells {roles}")
        print(line, flush=True)
        self.metrics.log("progress", t=now - self.t0, stage=self.stage, version=self.steps.version,
                         phases={c.cell_id: c.phase for c in self.cells.cells.values()},
                         versions={c.cell_id: c.weight_version for c in self.cells.cells.values()},
                         queued=self.executions.count("queued"), running=self.executions.count("running"))
