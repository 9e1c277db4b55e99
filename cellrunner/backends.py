"""What a cellrunner process is built from: its config, and the engine, trainer and weight
transfer that config names (heavy backends are imported only when chosen)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import zmq

from cellrunner.config import (
    EmbeddedEngineConfig, EmbeddedTrainerConfig, MegatronConfig, ModelConfig, MooncakeConfig, SGLangConfig,
)
from cellrunner.engine import EmbeddedEngine
from cellrunner.grads import GradExchange
from cellrunner.rank_weights import RankWeights
from base.ranks import CellRanks
from cellrunner.servers import NODE_LOCAL_DIRS, ServerPart, engine_pp_of, part_of_rank, placement_problem
from cellrunner.spmd import CommandChannel
from cellrunner.spmd_trainer import RankLinks
from cellrunner.trainer import EmbeddedTrainer
from cellrunner.transfer import WeightPublisher, WeightPuller, WeightServer, ZmqWeightPuller
from cellrunner.transfer_mooncake import MooncakeWeightPublisher, MooncakeWeightPuller
from base.wire import WeightsDtype
from base.algo_config import AlgoConfig


@dataclass(frozen=True, kw_only=True)
class CellRunnerConfig:
    """What a cellrunner process gets from the controller (sub-configs of the root)."""

    model: ModelConfig
    algo: AlgoConfig
    host: str
    core_cell: int
    torch_threads: int
    heartbeat_interval_s: float
    drain_timeout_s: float
    capacity_per_cell: int
    transfer_timeout_s: float
    transfer: Literal["zmq", "mooncake"]
    """How satellites pull weights from the core: ZeroMQ frames, or Mooncake Transfer Engine reads."""
    mooncake: MooncakeConfig
    seed: int
    checkpoint_dir: str
    """The core writes weights + AdamW state here (``v<N>/``, cellrunner.checkpoint) when an
    ApplyStep asks for it and at shutdown."""
    trainer: EmbeddedTrainerConfig | MegatronConfig
    engine: EmbeddedEngineConfig | SGLangConfig
    log_dir: str
    """Where the cell's own children (SGLang servers) log."""
    resume_from: str
    """The checkpoint folder the controller chose for the core to start from ('' = the seeded init)."""
    resume_version: int
    kv_tier_address: str
    """The run's Mooncake Store master (``engine.kv_tier``), host:port; '' = no shared KV tier."""


def make_trainer(cfg: CellRunnerConfig, vocab_size: int, is_core: bool, *, multi_rank: bool = False) -> Any:
    """The trainer ``cfg.trainer.kind`` names; megatron-core is imported only when chosen.
    ``multi_rank``: the cell has several ranks (every rank of it passes the same)."""
    if isinstance(cfg.trainer, MegatronConfig):
        from cellrunner.megatron_trainer import MegatronTrainer

        return MegatronTrainer(model_cfg=cfg.model, algo=cfg.algo, vocab_size=vocab_size, is_core=is_core,
                               megatron=cfg.trainer, seed=cfg.seed,
                               export_dtype=core_export_dtype(cfg, trainers_pull=not multi_rank))
    return EmbeddedTrainer(model_cfg=cfg.model, algo=cfg.algo, vocab_size=vocab_size, is_core=is_core,
                           device_s_per_token=cfg.trainer.device_s_per_token)


def server_shape(engine: SGLangConfig) -> tuple[int, int]:
    """(nodes, GPUs) of one of the cell's SGLang servers; pipeline stages travel in extra_args."""
    return engine.nnodes, engine.tp_size * engine_pp_of(engine.extra_args) * engine.dp_size


def serving_part(cfg: CellRunnerConfig, ranks: CellRanks) -> ServerPart | None:
    """This rank's share of the cell's SGLang servers (``cellrunner.servers``), None for none. A
    one-process cell runs one server; a multi-rank cell has one rank per GPU."""
    if not isinstance(cfg.engine, SGLangConfig):
        return None
    if not ranks.is_multi_rank:
        return ServerPart(server=0, node_rank=0, base_gpu_id=0, first_node=0)
    nodes, gpus = server_shape(cfg.engine)
    return part_of_rank(ranks.rank, cell_nodes=ranks.nnodes, gpus_per_node=ranks.world_size // ranks.nnodes,
                        server_nodes=nodes, gpus_per_server=gpus)


def check_ranks(cfg: CellRunnerConfig, ranks: CellRanks) -> None:
    """A multi-rank cell needs a trainer that is one (``trainer=megatron``), and SGLang servers that
    tile the cell's GPUs (``cellrunner.servers``: otherwise some would sit idle while serving);
    servers on several nodes load the leader's weight files, so those must be shared."""
    if ranks.is_multi_rank and not isinstance(cfg.trainer, MegatronConfig):
        raise ValueError(f"this cell has {ranks.world_size} ranks, but trainer={cfg.trainer.kind} runs one "
                         "process per cell: set cluster.ranks_per_node=1, or trainer=megatron")
    if not isinstance(cfg.engine, SGLangConfig):
        return
    nodes, gpus = server_shape(cfg.engine)
    if not ranks.is_multi_rank:
        if nodes != 1:
            raise ValueError(f"engine.nnodes={nodes}, but this cell is one process on one node: a server over "
                             "several nodes needs a rank on each (trainer=megatron)")
        return
    problem = placement_problem(cell_nodes=ranks.nnodes, gpus_per_node=ranks.world_size // ranks.nnodes,
                                server_nodes=nodes, gpus_per_server=gpus)
    if problem:
        raise ValueError(f"engine: {problem} (the cell: {ranks.nnodes} node(s) x {ranks.world_size // ranks.nnodes} "
                         f"rank(s), one per GPU; a server: engine.nnodes={nodes}, tp*pp*dp={gpus})")
    if ranks.nnodes > 1 and cfg.engine.weight_dir.startswith(NODE_LOCAL_DIRS):
        raise ValueError(f"engine.weight_dir={cfg.engine.weight_dir} is node-local, and this cell's servers on its "
                         f"other {ranks.nnodes - 1} node(s) load each version the leader writes there: set "
                         "engine.weight_dir to a shared folder")


def sglang_engine_config(cfg: CellRunnerConfig) -> SGLangConfig:
    """``cfg.engine`` with the run's Mooncake Store as HiCache's L3 where ``engine.kv_tier`` is on
    and names no master of its own (the controller started one with the run)."""
    engine = cfg.engine
    assert isinstance(engine, SGLangConfig)
    if not engine.kv_tier.enabled or engine.kv_tier.master_address or not cfg.kv_tier_address:
        return engine
    return dataclasses.replace(engine, kv_tier=dataclasses.replace(engine.kv_tier, master_address=cfg.kv_tier_address))


def _part_process(cfg: CellRunnerConfig, vocab_size: int, cell_id: int, ranks: CellRanks, part: ServerPart,
                  hosts: list[str], api_key: str) -> Any:
    from cellrunner.engine_sglang import SGLangProcess

    assert isinstance(cfg.engine, SGLangConfig)
    engine = sglang_engine_config(cfg)
    addr = ""
    if cfg.engine.nnodes > 1:  # the server's first node hosts its rendezvous; one port per server
        per_node = ranks.world_size // ranks.nnodes
        addr = f"{hosts[part.first_node * per_node]}:{cfg.engine.dist_init_port + part.server}"
    return SGLangProcess(engine, model_cfg=cfg.model, vocab_size=vocab_size, host=cfg.host, port=0,
                         cell_id=cell_id, max_running=cfg.capacity_per_cell,
                         seed=cfg.seed * 1000 + cell_id + 1_000_000 * part.server,  # servers sample apart
                         log_dir=cfg.log_dir, server=part.server, node_rank=part.node_rank,
                         base_gpu_id=part.base_gpu_id, dist_init_addr=addr, api_key=api_key)


def make_engine(cfg: CellRunnerConfig, vocab_size: int, cell_id: int, ranks: CellRanks | None = None,
                api_key: str = "", channel: CommandChannel | None = None) -> Any:
    """The leader's engine ``cfg.engine.kind`` names; both speak SGLang's native API to the proxy and
    want ``api_key`` on every route but /health ("" = open; ``base.engine_key``).

    A multi-rank SGLang cell: collective with every follower's ``make_node_engine`` over
    ``channel`` (the nodes' addresses, then the servers' URLs), so the engine drives every server."""
    seed = cfg.seed * 1000 + cell_id
    if isinstance(cfg.engine, SGLangConfig):
        from cellrunner.engine_sglang import SGLangEngine, server_log_path

        own, others = None, []
        if ranks is not None and ranks.is_multi_rank:
            assert channel is not None, "a multi-rank cell's servers are placed over its command channel"
            hosts = channel.gather_strings(cfg.host)
            part = serving_part(cfg, ranks)
            assert part is not None and part.server == 0 and part.serves_http, "rank 0 starts server 0"
            own = _part_process(cfg, vocab_size, cell_id, ranks, part, hosts, api_key)
            # in rank order, which is server order (cellrunner.servers numbers them so)
            others = [u for u in channel.gather_strings(own.url)[1:] if u]
        return SGLangEngine(sglang_engine_config(cfg), model_cfg=cfg.model, vocab_size=vocab_size, host=cfg.host, port=0,
                            cell_id=cell_id, max_running=cfg.capacity_per_cell, seed=seed, log_dir=cfg.log_dir,
                            api_key=api_key, process=own, other_servers=others,
                            log_paths=[server_log_path(cfg.log_dir, cell_id, k, 0) for k in range(1, 1 + len(others))])
    tier = None
    if cfg.kv_tier_address and cfg.engine.kv_tier.enabled:
        from cellrunner.kv_tier import KVTier

        # namespace: the model, so no other model's pages are ever read (versions restart per run)
        tier = KVTier(cfg.kv_tier_address, namespace=cfg.model.name.replace(" ", "_") or "model",
                      page_tokens=cfg.engine.kv_tier.page_tokens, local_hostname=cfg.host)
    return EmbeddedEngine(model_cfg=cfg.model, vocab_size=vocab_size, host=cfg.host, port=0,
                          cell_id=cell_id, max_running=cfg.capacity_per_cell, seed=seed,
                          prefix_cache_bytes=cfg.engine.prefix_cache_bytes,
                          prefix_cache_min_tokens=cfg.engine.prefix_cache_min_tokens, api_key=api_key, kv_tier=tier)


def make_node_engine(cfg: CellRunnerConfig, vocab_size: int, cell_id: int, ranks: CellRanks, api_key: str = "",
                     channel: CommandChannel | None = None) -> Any:
    """A follower's share of serving, started: its part of one of the cell's SGLang servers
    (``serving_part``), else None. Collective with the leader's ``make_engine`` (every rank of a
    multi-rank SGLang cell calls one of the two, in the same place)."""
    if not isinstance(cfg.engine, SGLangConfig):
        return None
    assert channel is not None, "a multi-rank cell's servers are placed over its command channel"
    hosts = channel.gather_strings(cfg.host)
    part = serving_part(cfg, ranks)
    proc = _part_process(cfg, vocab_size, cell_id, ranks, part, hosts, api_key) if part is not None else None
    if proc is not None:
        proc.start()  # the leader waits for every server's health
    channel.gather_strings(proc.url if proc is not None and proc.serves_http else "")
    return proc


def serving_dtype(cfg: CellRunnerConfig) -> WeightsDtype:
    """What a serving engine pulls new versions in: bf16 for SGLang serving in bf16 (half the bytes
    of the float32 a trainer starts from), float32 for the embedded engine, which computes in it."""
    engine = cfg.engine
    return "bfloat16" if isinstance(engine, SGLangConfig) and engine.dtype == "bfloat16" else "float32"


def trainer_dtype(cfg: CellRunnerConfig) -> WeightsDtype:
    """What a satellite's trainer starts from: its parameters' own dtype (Megatron's
    ``params_dtype``; the embedded trainer computes in float32). A bf16 model's float32 copy
    would only be wider, at twice the bytes."""
    trainer = cfg.trainer
    return "bfloat16" if isinstance(trainer, MegatronConfig) and trainer.params_dtype == "bfloat16" else "float32"


def whole_model_dtypes(cfg: CellRunnerConfig, *, trainers_pull: bool) -> tuple[WeightsDtype, ...]:
    """What the core's whole-model publisher is asked for: the engines' serving dtype, and the
    trainer's where satellites' trainers start from the whole model (single-rank cells; a
    multi-rank satellite pulls each rank's own shard instead, ``cellrunner.rank_weights``)."""
    return tuple(dict.fromkeys((*((trainer_dtype(cfg),) if trainers_pull else ()), serving_dtype(cfg))))


def core_export_dtype(cfg: CellRunnerConfig, *, trainers_pull: bool) -> WeightsDtype:
    """The dtype the core assembles its whole model in, once per version: the widest the
    publisher hands out. Where only serving engines take the whole model (a multi-rank core),
    that is the serving dtype, so a bf16 server's core never builds a float32 copy on rank 0."""
    dtypes = whole_model_dtypes(cfg, trainers_pull=trainers_pull)
    return "float32" if "float32" in dtypes else "bfloat16"


def make_weight_publisher(cfg: CellRunnerConfig, ctx: zmq.Context, *, serving: bool = False,
                          trainers_pull: bool = True) -> WeightPublisher:
    """``serving``: the core's publisher of whole versions, which serving engines pull too (a
    Mooncake publisher then keeps the slots ``whole_model_dtypes`` names); not a rank's own-shard
    publisher, which trainers pull in float32."""
    if cfg.transfer == "mooncake":
        m = cfg.mooncake
        dtypes = whole_model_dtypes(cfg, trainers_pull=trainers_pull) if serving else ("float32",)
        return MooncakeWeightPublisher(ctx, f"tcp://{cfg.host}:0", host=cfg.host, protocol=m.protocol,
                                       device_name=m.device_name, memory=m.memory, dtypes=dtypes)
    return WeightServer(ctx, f"tcp://{cfg.host}:0")


def make_weight_puller(cfg: CellRunnerConfig, ctx: zmq.Context) -> WeightPuller:
    if cfg.transfer == "mooncake":
        m = cfg.mooncake
        return MooncakeWeightPuller(ctx, host=cfg.host, protocol=m.protocol, device_name=m.device_name, memory=m.memory)
    return ZmqWeightPuller(ctx)


def make_rank_links(cfg: CellRunnerConfig, ctx: zmq.Context, ranks: CellRanks, is_core: bool,
                    channel: CommandChannel) -> tuple[RankLinks, list[str], list[str]]:
    """Collective, every rank of a multi-rank cell: this rank's gradient inbox (core) and own-shard
    publisher (core) or puller (satellite), and every rank's addresses of both, in rank order."""
    grads = GradExchange(ctx, cfg.host, ranks.rank, is_core)
    weights = RankWeights(rank=ranks.rank, publisher=make_weight_publisher(cfg, ctx) if is_core else None,
                          puller=None if is_core else make_weight_puller(cfg, ctx))
    return RankLinks(grads, weights), channel.gather_strings(grads.addr), channel.gather_strings(weights.addr)
