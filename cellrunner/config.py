"""Typed mirrors of conf/model/*.yaml, conf/trainer/*.yaml and conf/engine/*.yaml.

Only dataclasses: choosing ``trainer=megatron`` or ``engine=sglang`` must not import megatron-core
or SGLang into processes that only read the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cellrunner.servers import NODE_LOCAL_DIRS


@dataclass(frozen=True, kw_only=True)
class ModelParallel:
    """A model preset's parallel layout defaults per cell; conf/trainer/megatron.yaml and
    conf/engine/sglang.yaml read them by interpolation, and a command line overrides either side."""

    trainer_tp: int
    trainer_pp: int
    trainer_ep: int
    engine_tp: int
    engine_ep: int
    engine_nnodes: int
    """Nodes one SGLang server spans (a cell of 48 nodes with 2 runs 24 servers)."""

    def check(self) -> None:
        for name in ("trainer_tp", "trainer_pp", "trainer_ep", "engine_tp", "engine_ep", "engine_nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name}: want >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str
    path: str
    """A local Hugging Face checkpoint folder (config.json, safetensors shards, tokenizer.json),
    read on every cell, nothing downloaded; "" = the seeded random init from the sizes below."""
    tokenizer: Literal["qwen", "qwen_compact", "hf"]
    """`qwen`: the full Qwen vocabulary; `qwen_compact`: its first `compact_ranks` BPE ranks + Qwen3
    specials; `hf`: the checkpoint's own tokenizer.json (needs `path`)."""
    compact_ranks: int
    hidden_size: int
    """The sizes describe the seeded model; with `path` they are 0 and the checkpoint's config.json rules."""
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool
    init_seed: int
    """Seed of the random init: every cell builds bit-identical version-0 weights from it."""
    parallel: ModelParallel

    SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings")

    def check(self) -> None:
        if not 256 <= self.compact_ranks <= 151643:
            raise ValueError(f"compact_ranks: want 256..151643, got {self.compact_ranks}")
        if self.path == "???":  # Hydra's mark for a value the user must give (conf/model/qwen3_hf.yaml)
            raise ValueError("model.path: required, a local Hugging Face checkpoint folder (model.path=/shared/models/...)")
        if self.tokenizer == "hf" and not self.path:
            raise ValueError("tokenizer: hf reads the checkpoint's tokenizer.json; set model.path")
        if self.path:
            given = [n for n in self.SIZES if getattr(self, n)]
            if given:  # two sources of truth for one model would disagree sooner or later
                raise ValueError(f"path: the checkpoint's config.json gives the sizes; want 0 for {given}")
            return
        if any(getattr(self, n) < 1 for n in self.SIZES):
            raise ValueError(f"want every size >= 1 for a seeded model (or a model.path): {list(self.SIZES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads: want a multiple of num_key_value_heads")


@dataclass(frozen=True, kw_only=True)
class EmbeddedTrainerConfig:
    """Typed mirror of conf/trainer/embedded.yaml: the torch trainer of one process (cellrunner.trainer)."""

    kind: Literal["embedded"]
    device_s_per_token: float = 0.0
    """Emulate a cell's own accelerator: a microstep over n tokens takes at least n x this many
    seconds, sleeping out whatever the real forward-backward did not use. On a cluster every cell
    has its own GPUs; on one small CPU machine the cells' trainers share the cores, so training on
    three cells at once is no faster than on one and no scheduler can show what it would gain.
    With a tiny model and this set, each cell behaves like an independent device (bench.elastic).
    0 (the default): off, the real compute time only."""

    def check(self) -> None:
        if not 0.0 <= self.device_s_per_token < 1.0:
            raise ValueError(f"trainer.device_s_per_token: want a number in [0, 1), got {self.device_s_per_token!r}")


@dataclass(frozen=True, kw_only=True)
class MooncakeConfig:
    """Typed mirror of ``cluster.mooncake`` (conf/cluster/local.yaml): how ``transfer=mooncake`` moves weights."""

    protocol: Literal["tcp", "rdma"]
    """``tcp`` anywhere; ``rdma`` on InfiniBand/RoCE clusters (GPUDirect when ``memory=cuda``)."""
    device_name: str
    """The RDMA NICs Mooncake may use, comma separated (``mlx5_0,mlx5_1``); empty: Mooncake picks
    (its topology discovery). Ignored with ``tcp``."""
    memory: Literal["cpu", "cuda"]
    """Where a satellite's pull lands: host memory, or the cell's current CUDA device without a host
    copy (needs the CUDA 13 build, ``mooncake-transfer-engine-cuda13``, from ``make gpu-env``). The
    core's slots are host memory either way, page-locked where it sees a CUDA device
    (``cellrunner.transfer_mooncake``)."""


@dataclass(frozen=True, kw_only=True)
class EmbeddedKVTierConfig:
    """Typed mirror of ``engine.kv_tier`` in conf/engine/embedded.yaml: a Mooncake Store the run's
    engines share (``cellrunner.kv_tier``), so a session redirected off a draining cell continues
    from its KV instead of computing it again."""

    enabled: bool
    segment_bytes: int
    """Memory the run's store holds for KV pages (its memory holder, started with the run)."""
    page_tokens: int
    """Tokens a page holds: the unit stored, keyed and read; a prompt's last partial page is computed."""

    def check(self) -> None:
        if self.segment_bytes < 1 or self.page_tokens < 1:
            raise ValueError(f"kv_tier: want segment_bytes >= 1 and page_tokens >= 1, got {self.segment_bytes}, "
                             f"{self.page_tokens}")


@dataclass(frozen=True, kw_only=True)
class EmbeddedEngineConfig:
    """Typed mirror of conf/engine/embedded.yaml: the torch engine on SGLang's native API (cellrunner.engine)."""

    kind: Literal["embedded"]
    prefix_cache_bytes: int
    """KV the prefix cache may hold, in bytes (0: off). The tiny model's KV is 512 bytes a token."""
    prefix_cache_min_tokens: int
    """Shortest cached prefix worth reusing: a hit prefills on a row of its own, so a few shared
    template tokens would cost a short prompt its place in the batched prefill."""
    kv_tier: EmbeddedKVTierConfig

    def check(self) -> None:
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"engine.prefix_cache_bytes: want >= 0, got {self.prefix_cache_bytes}")
        if self.prefix_cache_min_tokens < 1:
            raise ValueError(f"engine.prefix_cache_min_tokens: want >= 1, got {self.prefix_cache_min_tokens}")


@dataclass(frozen=True, kw_only=True)
class MegatronConfig:
    """Typed mirror of conf/trainer/megatron.yaml (the parallel layout inside one cell)."""

    kind: Literal["megatron"]
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    expert_model_parallel_size: int
    params_dtype: Literal["float32", "bfloat16"]
    """bfloat16 trains with fp32 main weights and fp32 gradient buffers (Megatron's mixed precision)."""
    layer_spec: Literal["local", "transformer_engine"]
    """``local``: megatron-core modules only (runs anywhere); ``transformer_engine``: TE's fused
    kernels (needs transformer-engine on the GPU install)."""
    pad_vocab_to: int
    """Embedding rows are padded to a multiple of this x TP; padded logits are masked out."""
    offload_when_serving: bool
    """On CUDA, the core moves its weights, gradients and Adam state to host memory while it serves."""
    moe_aux_loss_coeff: float
    command_timeout_s: float
    """How long a multi-rank cell's followers wait for the leader's next command (the timeout of
    their gloo command group, ``cellrunner.spmd``). They wait there through every serving phase,
    which lasts as long as the scheduler wants: torch's 30-minute default lost the followers of a
    cell that served longer. A leader that dies closes its connections and the wait ends at once,
    so a long timeout costs nothing there."""
    local_attention: Literal["sdpa", "unfused"]
    """Core attention of ``layer_spec: local``: ``sdpa``, torch's fused scaled-dot-product attention
    (FlashAttention or the memory-efficient kernel on CUDA; ``cellrunner.megatron_attention``), or
    ``unfused``, megatron-core's own ``DotProductAttention`` (a full [b, heads, s, s] score matrix,
    quadratic in the sequence). ``layer_spec: transformer_engine`` uses TE's attention either way."""
    recompute_granularity: Literal["none", "full", "selective"]
    """Activation recompute (Megatron's ``recompute_granularity``): ``full`` keeps each recomputed
    layer's input only and runs the layer again in the backward pass; ``selective`` recomputes the
    core attention only (little to gain with ``sdpa``, which keeps no score matrix); ``none``."""
    recompute_method: Literal["uniform", "block"]
    """With ``full``: ``uniform`` checkpoints every ``recompute_num_layers`` layers' input,
    ``block`` recomputes the first ``recompute_num_layers`` layers of each pipeline stage."""
    recompute_num_layers: int
    logprob_chunk_tokens: int
    """Tokens whose full-vocabulary float32 log-softmax exists at once when the trainer takes
    log-probs (``token_logprobs``): memory ``chunk x vocab/TP x 4`` bytes, not ``sequence x ...``."""

    def check(self) -> None:
        if self.logprob_chunk_tokens < 1:
            raise ValueError(f"logprob_chunk_tokens: want >= 1, got {self.logprob_chunk_tokens}")
        if self.recompute_num_layers < 1:
            raise ValueError(f"recompute_num_layers: want >= 1, got {self.recompute_num_layers}")
        if self.command_timeout_s <= 0:
            raise ValueError(f"command_timeout_s: want > 0, got {self.command_timeout_s}")
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                     "pad_vocab_to"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: want >= 1, got {getattr(self, name)}")
        if self.moe_aux_loss_coeff < 0:
            raise ValueError(f"moe_aux_loss_coeff: want >= 0, got {self.moe_aux_loss_coeff}")


@dataclass(frozen=True, kw_only=True)
class SGLangKVTierConfig:
    """Typed mirror of ``engine.kv_tier`` (conf/engine/sglang.yaml): SGLang's HiCache with Mooncake
    Store as an L3 shared by every server of the run (``cellrunner.sglang_hicache``, GPU.md).

    Checked here so a bad combination stops at start-up in words, not deep in SGLang's resolution
    hooks (``sglang/srt/arg_groups/hicache_hook.py``), some of which silently rewrite it."""

    enabled: bool
    page_size: int
    """Tokens a KV page holds (``--page-size``): the unit L3 keys and transfers are made of."""
    host_ratio: float
    """L2 host pool as a multiple of the GPU pool (``--hicache-ratio``); 0 when ``host_size_gb`` is set."""
    host_size_gb: int
    """L2 host pool in GB (``--hicache-size``); 0: sized by ``host_ratio``."""
    write_policy: Literal["write_through", "write_through_selective", "write_back"]
    prefetch_policy: Literal["best_effort", "wait_complete", "timeout"]
    mem_layout: Literal["page_first", "page_first_direct", "layer_first"]
    io_backend: Literal["kernel", "direct"]
    master_address: str
    """``host:port`` of the run's ``mooncake_master`` RPC; "" = the run's, filled in when it starts one."""
    master_metrics_port: int
    """The master's HTTP port (``--metrics_port``). > 0: a server starts only once the master there
    lists a segment (SGLang's ``check_server``); 0: no such wait (the run's store starts with its
    memory mounted already)."""
    protocol: Literal["tcp", "rdma"]
    device_name: str
    """RDMA NICs for the store, comma separated; "" = Mooncake's discovery. Ignored with ``tcp``."""
    segment_bytes: int
    """Memory the run's store holds for pages, in its memory holders (``mooncake_client``), which
    the run starts with its master. Pages there outlive a server's version switch and release."""
    server_segment_bytes: int
    """Memory each server lends the store besides (0, the default: none). Its pages go whenever
    the server re-attaches the store, that is at every weight version."""
    namespace: str
    """First part of every L3 key tag (the weight version and the layout follow it)."""

    def check(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size: want >= 1, got {self.page_size}")
        if (self.host_ratio > 0) == (self.host_size_gb > 0) or self.host_ratio < 0 or self.host_size_gb < 0:
            raise ValueError("set exactly one of host_ratio (> 0) and host_size_gb (> 0), the other 0; "
                             f"got host_ratio={self.host_ratio}, host_size_gb={self.host_size_gb}")
        if self.write_policy == "write_back":
            raise ValueError("write_policy: write_back puts a page in the shared L3 only when the host "
                             "tier evicts it, so other servers rarely find it; want write_through")
        if self.mem_layout == "layer_first":  # hicache_hook.resolve_storage_layout_compatibility rewrites it
            raise ValueError("mem_layout: SGLang's Mooncake backend cannot store layer_first pages; "
                             "want page_first (io_backend kernel) or page_first_direct (io_backend direct)")
        wanted_io = {"page_first": "kernel", "page_first_direct": "direct"}[self.mem_layout]
        if self.io_backend != wanted_io:  # hicache_hook.resolve_layout_io_compatibility would switch one
            raise ValueError(f"mem_layout {self.mem_layout} goes with io_backend {wanted_io}, "
                             f"got {self.io_backend}")
        if self.master_address and not _is_host_port(self.master_address):
            raise ValueError(f"master_address: want host:port or \"\", got {self.master_address!r}")
        if not 0 <= self.master_metrics_port < 65536:
            raise ValueError(f"master_metrics_port: want 0..65535, got {self.master_metrics_port}")
        if self.segment_bytes < 0 or self.server_segment_bytes < 0 or not self.segment_bytes + self.server_segment_bytes:
            raise ValueError(f"segment_bytes, server_segment_bytes: want >= 0 and not both 0 (the store needs "
                             f"memory), got {self.segment_bytes}, {self.server_segment_bytes}")
        if self.master_metrics_port and self.server_segment_bytes:  # MooncakeStore.check_server runs before setup
            raise ValueError("master_metrics_port: a server lending memory (server_segment_bytes) would wait for "
                             "its own segment, mounted only after that check; want 0")
        if not self.namespace or not all(c.isalnum() or c in "-." for c in self.namespace):
            raise ValueError(f"namespace: want letters, digits, '-' or '.', got {self.namespace!r}")


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


KV_TIER_FLAGS = ("--enable-hierarchical-cache", "--enable-hicache", "--page-size", "--served-model-name",
                 "--admin-api-key")
"""Flags ``engine.kv_tier`` sets itself (with every ``--hicache-*``): not also in ``extra_args``."""


@dataclass(frozen=True, kw_only=True)
class SGLangConfig:
    """Typed mirror of conf/engine/sglang.yaml: a cell's SGLang servers (``cellrunner.servers``)."""

    kind: Literal["sglang"]
    python: str
    """Interpreter with sglang installed ("" = this one)."""
    tp_size: int
    dp_size: int
    ep_size: int
    nnodes: int
    """Nodes one server spans (a cell runs as many servers as fit it); node ranks come from the
    launcher, the rendezvous host is the server's first node."""
    dist_init_port: int
    mem_fraction_static: float
    dtype: Literal["bfloat16", "float16", "float32"]
    context_length: int
    """0 = the model's ``max_position_embeddings``."""
    disable_cuda_graph: bool
    weight_update: Literal["disk"]
    weight_dir: str
    """Where new versions are written for ``/update_weights_from_disk`` (tmpfs: /dev/shm/...)."""
    startup_timeout_s: float
    request_timeout_s: float
    poll_interval_s: float
    extra_args: tuple[str, ...]
    """Passed through to ``sglang.launch_server`` as they are (HiCache: ``kv_tier``, not here)."""
    flush_cache_timeout_s: float
    """How long ``/flush_cache`` may answer 400 (requests still running or waiting in the scheduler)
    before a release or load gives up; it is retried with backoff until then."""
    kv_tier: SGLangKVTierConfig
    """HiCache with Mooncake Store as the run's shared L3 (off: each server keeps its own cache)."""

    def check(self) -> None:
        for name in ("tp_size", "dp_size", "ep_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: want >= 1, got {getattr(self, name)}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static: want (0, 1), got {self.mem_fraction_static}")
        if self.startup_timeout_s <= 0 or self.request_timeout_s <= 0 or self.poll_interval_s <= 0:
            raise ValueError("startup_timeout_s, request_timeout_s, poll_interval_s: want > 0")
        if not self.weight_dir:
            raise ValueError("weight_dir: want a folder for weight updates")
        if self.nnodes > 1 and self.weight_dir.startswith(NODE_LOCAL_DIRS):
            # Every node's ranks of the server load each version from weight_dir, which node 0 writes.
            raise ValueError(f"weight_dir: {self.weight_dir} is node-local, and a server spanning {self.nnodes} "
                             "nodes loads each version on every node; set engine.weight_dir to a shared folder")
        self._check_kv_tier_flags()

    def _check_kv_tier_flags(self) -> None:
        """One source for the HiCache flags: an L3 from ``extra_args`` would have no weight version
        in its keys, and a server at v+1 would read pages computed under v."""
        given = [a.split("=", 1)[0] for a in self.extra_args if a.startswith("--")]
        if "--hicache-storage-backend" in given:
            raise ValueError("extra_args: --hicache-storage-backend keeps no weight version in its keys; "
                             "use engine.kv_tier (it tags every page with the version)")
        if self.kv_tier.enabled:
            clash = sorted({g for g in given if g in KV_TIER_FLAGS or g.startswith("--hicache-")})
            if clash:
                raise ValueError(f"extra_args: {clash} are set by engine.kv_tier; drop them from extra_args")
