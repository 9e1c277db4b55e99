"""The root config: typed mirror of conf/config.yaml, composed of each package's own sub-config.

Built once at the entrypoint from Hydra's resolved config; every component then gets only its
own sub-config. Cross-package facts are checked here, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from cellrunner.config import (
    EmbeddedEngineConfig, EmbeddedTrainerConfig, MegatronConfig, ModelConfig, MooncakeConfig, SGLangConfig,
)
from cellrunner.hf_folder import check_folder
from controller.health import HealthConfig
from controller.loggers.config import LoggerConfig
from base.typed_config import build
from harness_proxy.config import ProxyConfig
from base.algo_config import AlgoConfig
from workloads.config import HarnessConfig, SandboxConfig, WorkloadConfig


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str
    runs_dir: str
    steps: int
    """GSPO steps to train; the run ends when weight version `steps` is published."""
    seed: int
    eval_at_start: bool
    eval_at_end: bool
    eval_every: int
    """Evaluate on the held-out tasks each time this many more versions are applied, while
    training goes on (0: only at the start and end). Such a round only serves: its runs are
    never trained on."""
    run_id: str
    """The run folder's name under runs_dir; '' for a fresh timestamped one. Slurm scripts pass the
    job id, so a requeued job finds its folder and resumes from the core's newest checkpoint."""
    resume: bool
    """Start from the newest complete checkpoint in the run folder, when there is one."""
    checkpoint_every: int
    """The core saves weights + AdamW state every this many steps (0: only at the end)."""
    keep_checkpoints: int
    auto_resume: int
    """Times ``gyre`` starts a new attempt by itself, from the newest checkpoint, after a failure
    one can get past (the core died: it alone holds the optimizer state; a service died past its
    restarts). 0: stop with the message and the run_id to resume with."""
    """The newest this many complete checkpoints stay; older ones are deleted as new ones land (0:
    all stay). A checkpoint of a large model is large, and a resume needs only the newest."""
    log_level: Literal["DEBUG", "INFO", "WARNING"]
    progress_every_s: float

    def check(self) -> None:
        if self.eval_every < 0:
            raise ValueError(f"run.eval_every: want >= 0 (0: off), got {self.eval_every}")


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    kind: Literal["local", "slurm"]
    """local: cells are child processes here; slurm: each cell is an srun step on its share of the
    job's nodes (controller.slurm_launch), run from inside an allocation."""
    num_cells: int
    core_cell: int
    """The cell that owns the authoritative weights and optimizer state."""
    host: str
    """Address every process binds to; ``auto`` (slurm): each process's own node address."""
    controller_port: int
    curve: bool
    """CURVE on every ZeroMQ socket between the run's processes (base.curve)."""
    curve_keys: str
    """'' for fresh keys per run attempt in ``runs/<id>/keys/``; else a folder made once with
    ``python -m base.curve DIR --cells N``."""
    torch_threads: int
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    """A cell silent this long is dropped and its work re-routed."""
    start_timeout_s: float
    service_restarts: int
    """Times the controller restarts a dead (or silent) trajectory processor, and the harness proxy,
    in place, each (``RunServices.check_services``), before the run stops with the reason."""
    drain_timeout_s: float
    """A cell turning to training lets in-flight calls finish this long, then aborts them (the
    proxy re-routes them)."""
    transfer_timeout_s: float
    microsteps_in_flight: int
    """Microsteps a training cell holds at once (controller.steps.assign): 2 queues the next one
    behind the running one, so a busy controller's round trip does not leave the cell idle."""
    transfer: Literal["zmq", "mooncake"]
    """How satellites pull weights from the core: `zmq` frames, or `mooncake` Transfer Engine reads
    (TCP here, RDMA on clusters; needs the mooncake package, see cellrunner/transfer_mooncake.py)."""
    mooncake: MooncakeConfig
    """With ``transfer=mooncake``: protocol, RDMA NICs, host or CUDA memory."""
    ranks_per_node: int
    """Processes per node of a cell, one per GPU, with ``trainer=megatron`` (its ranks); the
    embedded trainer is one process per cell, so 1. Rank 0 leads (cellrunner/follower.py)."""
    dist_port: int
    """A multi-rank cell's process group meets at its leader's ``dist_port + cell_id``."""

    def check(self) -> None:
        if self.num_cells < 1:
            raise ValueError("num_cells: want >= 1")
        if self.service_restarts < 0:
            raise ValueError("service_restarts: want >= 0")
        if self.microsteps_in_flight < 1:
            raise ValueError("microsteps_in_flight: want >= 1")
        if self.ranks_per_node < 1:
            raise ValueError("ranks_per_node: want >= 1")
        if not 1024 <= self.dist_port <= 65535 - self.num_cells:
            raise ValueError(f"dist_port: want 1024..{65535 - self.num_cells}")
        if not 0 <= self.core_cell < self.num_cells:
            raise ValueError("core_cell: want 0..num_cells-1")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    kind: Literal["elastic", "async", "colocate"]
    capacity_per_cell: int
    """Live executions one serving cell holds."""
    staleness: int
    """Step s may train on data produced by weight versions >= s - staleness (same for all policies)."""
    min_serving_cells: int
    """Serving cells kept while any live work or next-step work exists (elastic)."""
    train_cells: int
    """`async` only: size of the fixed training pool."""
    straggler_runs: int
    """`elastic` only: while microsteps wait for a cell and every running execution belongs to a
    step after the trainable one, up to this many of them may wait without a serving cell (their
    calls wait at the proxy, past ``proxy.route_wait_s`` as a retriable 529, as under colocate)
    so the cell holding them trains; 0 never leaves running work unserved. Their timeout keeps
    running while they wait."""

    def check(self) -> None:
        if self.capacity_per_cell < 1 or self.staleness < 0:
            raise ValueError("capacity_per_cell >= 1 and staleness >= 0")
        if self.straggler_runs < 0:
            raise ValueError("straggler_runs >= 0")


@dataclass(frozen=True, kw_only=True)
class GyreConfig:
    run: RunConfig
    cluster: ClusterConfig
    model: ModelConfig
    workload: WorkloadConfig
    harness: HarnessConfig
    """What runs each execution (conf/harness): ``bundled``, ``claude_code``, ``mini_swe_agent``, ``qwen_code``, ``command``."""
    sandbox: SandboxConfig
    """What confines each harness run and grader (conf/sandbox)."""
    scheduler: SchedulerConfig
    algo: AlgoConfig
    proxy: ProxyConfig
    trainer: EmbeddedTrainerConfig | MegatronConfig
    """``trainer=embedded`` (torch, one process) or ``trainer=megatron`` (GPU install, cellrunner/GPU.md)."""
    engine: EmbeddedEngineConfig | SGLangConfig
    """``engine=embedded`` (torch, SGLang's native API) or ``engine=sglang`` (the real servers)."""
    logger: LoggerConfig
    """Where the run's figures go besides metrics.jsonl (conf/logger, several at once)."""
    health: HealthConfig
    """Thresholds of the training-health warnings (controller.health)."""

    def check(self) -> None:
        if self.model.path:  # here, once, before any cell starts on a folder that is not there
            check_folder(self.model.path, want_tokenizer=self.model.tokenizer == "hf")
        if self.cluster.ranks_per_node > 1 and not isinstance(self.trainer, MegatronConfig):
            raise ValueError(f"cluster.ranks_per_node={self.cluster.ranks_per_node}: trainer={self.trainer.kind} "
                             "is one process per cell; several ranks per node need trainer=megatron")
        if self.algo.release == "run" and isinstance(self.trainer, MegatronConfig):
            raise ValueError("algo.release=run keeps a gradient-sized buffer per execution until its group "
                             "closes, which the embedded trainer does and trainer=megatron does not: set "
                             "algo.release=group")
        engine_start_s = self.engine.startup_timeout_s if isinstance(self.engine, SGLangConfig) else 0.0
        if self.cluster.start_timeout_s < engine_start_s:
            # A cell is ready only once its engine is: a shorter wait stops a run whose engine is
            # still inside its own start timeout (cluster=slurm had 300 s against SGLang's 600).
            raise ValueError(f"cluster.start_timeout_s={self.cluster.start_timeout_s:g} is shorter than "
                             f"engine.startup_timeout_s={engine_start_s:g}, the engine's own start: raise it")
        if self.scheduler.kind == "async" and not 1 <= self.scheduler.train_cells < self.cluster.num_cells:
            raise ValueError("scheduler.train_cells: async needs 1..num_cells-1 training cells")
        # Only the bundled harness asks for workload.max_new_tokens; real harnesses ask their own
        # max_tokens, which the proxy's cap bounds either way.
        if self.harness.kind == "bundled" and self.workload.max_new_tokens > self.proxy.max_new_tokens_cap:
            raise ValueError("workload.max_new_tokens: over proxy.max_new_tokens_cap")


def build_config(resolved: dict[str, Any]) -> GyreConfig:
    """`resolved` is `OmegaConf.to_container(cfg, resolve=True)` without the `hydra` key."""
    # `launcher` says how the run starts (controller/submit.py), not what it is: not part of GyreConfig.
    data = {k: v for k, v in resolved.items() if k not in ("hydra", "launcher")}
    # conf/logger is a multi-select group: only the chosen options' keys exist; the others are off.
    data["logger"] = {**{name: None for name in ("tensorboard", "wandb", "prometheus")}, **(data.get("logger") or {})}
    return build(GyreConfig, data)
