"""One layout check before anything queues: does a cell of N nodes x G GPUs hold the trainer's and
the engine's parallel layout, by Megatron's and SGLang's own rules?

    python -m controller.layout PRESET --nodes-per-cell N --gpus-per-node G [--gpu-mem-gib M] [overrides]

prints one JSON object ``{"ok", "why", "rule", "trainer", "engine", "memory", "not_built", ...}``
and exits 0 when ``ok``, 1 when a rule refuses the layout, 2 when the config itself is bad.
``overrides`` are Hydra's (``engine.tp_size=8``, ``model.parallel.trainer_pp=2``); the GPU stack
(``trainer=megatron engine=sglang``) is assumed unless they name another.

``check_layout`` is the pure decision; ``request_from_config`` and ``check_job`` are the thin
shells the command, the sbatch recipes (on the login node) and ``gyre`` (first thing in a Slurm
job) use. The rules, each named in the line that refuses a layout:

- Megatron (megatron-core 0.16, ``parallel_state.initialize_model_parallel``; Gyre's trainer sets
  ``expert_tensor_parallel_size=1``): the world (nodes x GPUs, one rank per GPU) is a multiple of
  TP x PP and of EP x PP; attention heads and KV heads divide by TP; layers by PP; experts by EP.
- SGLang 0.5.23 (``arg_groups/validation_hook.py``): ``(tp*pp) % nnodes == 0``; no ``dp_size > 1``
  across nodes; EP lives inside the TP group (``tp % ep == 0``); attention heads divide by TP.
  Gyre's own placement (``cellrunner.servers``): a server on several nodes fills them, one on a
  node divides it; the cell's nodes split into whole servers, so a cell runs ``nodes*gpus /
  (tp*pp*dp)`` independent servers, each started by the cell's ranks, the proxy routing among
  them. Several servers need a rank on every node (``trainer=megatron``), and a cell of several
  nodes a shared ``engine.weight_dir`` (each server loads the versions its leader writes there).
- Memory per GPU, estimated from the model's shape (the checkpoint's config.json, else the
  published shape of a shipped preset; skipped, and said so, when neither is known): training
  holds bf16 weights, fp32 gradients and fp32 Adam state (master, m, v: 18 bytes a parameter;
  Gyre's trainer uses no distributed optimizer) within ``TRAIN_MEM_FRACTION`` of the GPU;
  serving holds bf16 weights plus a KV pool of at least one context within ``mem_fraction_static``.
  Activations are not estimated.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from cellrunner.servers import NODE_LOCAL_DIRS, engine_pp_of, num_servers

GIB = 1 << 30
DEFAULT_GPU_MEM_GIB = 80.0
GPU_MEM_ENV = "GYRE_GPU_MEM_GIB"
"""Set by the sbatch recipes (ADAPT there): the memory of one GPU, for the check inside the job."""
TRAIN_MEM_FRACTION = 0.9
"""Of a GPU's memory, what weights, gradients and Adam state may take: the rest is activations."""
TRAIN_BYTES_PER_PARAM = {"bfloat16": 2 + 4 + 12, "float32": 4 + 4 + 8}
"""Weights, fp32 gradient buffer, Adam (bf16: fp32 master copy, m, v; float32: m, v)."""
SERVE_BYTES_PER_PARAM = {"bfloat16": 2, "float16": 2, "float32": 4}
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the estimates need from a Qwen3 (dense or MoE) config.json."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int = 0
    moe_intermediate_size: int = 0

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelShape:
        heads = hf["num_attention_heads"]
        return cls(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                   intermediate_size=hf.get("intermediate_size", 0), num_attention_heads=heads,
                   num_key_value_heads=hf.get("num_key_value_heads", heads),
                   head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, vocab_size=hf["vocab_size"],
                   max_position_embeddings=hf.get("max_position_embeddings", 0),
                   tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                   num_experts=hf.get("num_experts", 0) or 0, moe_intermediate_size=hf.get("moe_intermediate_size", 0) or 0)

    def expert_params(self) -> int:
        return self.num_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def dense_params(self) -> int:
        """Everything but the experts: embeddings, attention, dense MLPs or routers, norms."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + 2 * self.head_dim + 2 * h
        mlp = h * self.num_experts if self.num_experts else 3 * h * self.intermediate_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attention + mlp) + embeddings + h


# Published config.json shapes of the shipped presets (conf/model/*.yaml), for when their folder
# is not at hand (the login node usually has it: its config.json wins).
PRESET_SHAPES: dict[str, ModelShape] = {
    "qwen3_0_6b": ModelShape(num_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                             tie_word_embeddings=True),
    "qwen3_8b": ModelShape(num_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                           tie_word_embeddings=False),
    "qwen3_32b": ModelShape(num_layers=64, hidden_size=5120, intermediate_size=25600, num_attention_heads=64,
                            num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                            tie_word_embeddings=False),
    "qwen3_30b_a3b": ModelShape(num_layers=48, hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                                num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                                tie_word_embeddings=False, num_experts=128, moe_intermediate_size=768),
    "qwen3_235b_a22b": ModelShape(num_layers=94, hidden_size=4096, intermediate_size=12288, num_attention_heads=64,
                                  num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                                  tie_word_embeddings=False, num_experts=128, moe_intermediate_size=1536),
}


@dataclass(frozen=True, kw_only=True)
class LayoutRequest:
    nodes_per_cell: int
    gpus_per_node: int
    gpu_mem_gib: float
    ranks_per_node: int
    trainer: Literal["megatron", "embedded"]
    trainer_tp: int = 1
    trainer_pp: int = 1
    trainer_ep: int = 1
    params_dtype: str = "bfloat16"
    engine: Literal["sglang", "embedded"]
    engine_tp: int = 1
    engine_pp: int = 1
    engine_dp: int = 1
    engine_ep: int = 1
    engine_nnodes: int = 1
    engine_dtype: str = "bfloat16"
    engine_weight_dir: str = ""
    mem_fraction_static: float = 0.9
    context_length: int = 0
    shape: ModelShape | None = None
    shape_from: str = ""
    """Where ``shape`` came from (a config.json path, ``preset <name>``), for the report."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    ok: bool
    why: str
    """One line: the first rule broken, or what the layout comes to."""
    rule: str
    """The broken rule's name (``megatron.world_tp_pp``), "" when ok."""
    broken: list[str] = field(default_factory=list)
    trainer: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    not_built: list[str] = field(default_factory=list)
    """What the layout needs that Gyre does not do yet: reported, not refused."""

    def to_json(self) -> dict:
        return asdict(self)


def check_layout(req: LayoutRequest) -> Layout:
    """Apply every rule to one cell; ``ok`` only when none is broken."""
    broken: list[tuple[str, str]] = []
    if req.nodes_per_cell < 1 or req.gpus_per_node < 1:
        broken.append(("cell.size", f"a cell needs >= 1 node of >= 1 GPU, got {req.nodes_per_cell} x {req.gpus_per_node}"))
        return _result(req, broken, {}, {}, {}, [])
    trainer = _trainer_rules(req, broken)
    engine = _engine_rules(req, broken)
    memory = _memory_rules(req, broken)
    not_built = []
    return _result(req, broken, trainer, engine, memory, not_built)


def _result(req, broken, trainer, engine, memory, not_built) -> Layout:
    if broken:
        rule, line = broken[0]
        return Layout(ok=False, why=f"{rule}: {line}", rule=rule, broken=[f"{r}: {m}" for r, m in broken],
                      trainer=trainer, engine=engine, memory=memory, not_built=not_built)
    why = (f"{req.nodes_per_cell} node(s) x {req.gpus_per_node} GPU(s) a cell: trainer {trainer.get('summary')}; "
           f"engine {engine.get('summary')}; memory {memory.get('summary')}")
    if not_built:
        why += f"; NOT BUILT YET: {len(not_built)} part(s), see not_built"
    return Layout(ok=True, why=why, rule="", trainer=trainer, engine=engine, memory=memory, not_built=not_built)


def _trainer_rules(req: LayoutRequest, broken: list) -> dict:
    if req.trainer != "megatron":
        return {"kind": req.trainer, "summary": f"{req.trainer}: one process per cell"}
    world = req.nodes_per_cell * req.ranks_per_node
    tp, pp, ep = req.trainer_tp, req.trainer_pp, req.trainer_ep
    if req.ranks_per_node != req.gpus_per_node:
        broken.append(("gyre.ranks_per_node", f"trainer=megatron runs one rank per GPU: cluster.ranks_per_node="
                       f"{req.ranks_per_node}, the nodes have {req.gpus_per_node} GPU(s)"))
    if world % (tp * pp):
        broken.append(("megatron.world_tp_pp", f"world size {world} is not a multiple of TP x PP = {tp} x {pp}"))
    if world % (ep * pp):
        broken.append(("megatron.world_ep_pp", f"world size {world} is not a multiple of EP x PP = {ep} x {pp} "
                       "(expert_tensor_parallel_size=1)"))
    s = req.shape
    if s is not None:
        if s.num_attention_heads % tp:
            broken.append(("megatron.heads_tp", f"{s.num_attention_heads} attention heads do not split over TP={tp}"))
        if s.num_key_value_heads % tp:
            broken.append(("megatron.kv_heads_tp", f"{s.num_key_value_heads} KV heads (num_query_groups) do not "
                           f"split over TP={tp}"))
        if s.num_layers % pp:
            broken.append(("megatron.layers_pp", f"{s.num_layers} layers do not split evenly over PP={pp}"))
        if ep > 1 and (not s.num_experts or s.num_experts % ep):
            broken.append(("megatron.experts_ep", f"{s.num_experts} experts do not split over EP={ep}"))
    dp = world // (tp * pp) if world % (tp * pp) == 0 else None
    return {"kind": "megatron", "world_size": world, "tp": tp, "pp": pp, "ep": ep, "dp": dp,
            "summary": f"megatron TP{tp} x PP{pp} x EP{ep}, DP {dp} over {world} ranks"}


def _engine_rules(req: LayoutRequest, broken: list) -> dict:
    if req.engine != "sglang":
        return {"kind": req.engine, "servers_per_cell": 1, "summary": f"{req.engine}: one server per cell"}
    tp, pp, dp, ep, nnodes = req.engine_tp, req.engine_pp, req.engine_dp, req.engine_ep, req.engine_nnodes
    gpus_per_server = tp * pp * dp
    if (tp * pp) % nnodes:
        broken.append(("sglang.tp_pp_nnodes", f"(tp*pp) % nnodes == 0 is required: tp {tp} x pp {pp} over "
                       f"{nnodes} nodes (pass --pp-size in engine.extra_args for pipeline stages)"))
    if dp > 1 and nnodes > 1:
        broken.append(("sglang.dp_nnodes", f"dp_size {dp} > 1 across {nnodes} nodes is refused by SGLang"))
    if tp % ep:
        broken.append(("sglang.ep_tp", f"ep_size {ep} must divide tp_size {tp} (EP runs inside the TP group)"))
    if req.shape is not None and req.shape.num_attention_heads % tp:
        broken.append(("sglang.heads_tp", f"{req.shape.num_attention_heads} attention heads do not split over tp {tp}"))
    if req.shape is not None and pp > req.shape.num_layers:
        broken.append(("sglang.layers_pp", f"pp {pp} is more stages than the {req.shape.num_layers} layers"))
    if nnodes > 1 and gpus_per_server != nnodes * req.gpus_per_node:
        broken.append(("gyre.server_fills_nodes", f"a server over {nnodes} nodes uses {gpus_per_server} GPUs "
                       f"(tp*pp*dp), not the {nnodes * req.gpus_per_node} those nodes have"))
    if nnodes == 1 and req.gpus_per_node % gpus_per_server:
        broken.append(("gyre.servers_per_node", f"a one-node server of {gpus_per_server} GPUs (tp*pp*dp) does "
                       f"not divide a node's {req.gpus_per_node}"))
    if req.nodes_per_cell % nnodes:
        broken.append(("gyre.servers_per_cell", f"a cell's {req.nodes_per_cell} nodes do not split into servers "
                       f"of {nnodes} nodes"))
    try:
        servers: int | None = num_servers(cell_nodes=req.nodes_per_cell, gpus_per_node=req.gpus_per_node,
                                          server_nodes=nnodes, gpus_per_server=gpus_per_server)
    except ValueError:
        servers = None  # refused above, by the rule that names why
    if servers and servers > 1 and req.trainer != "megatron":
        broken.append(("gyre.one_process_serving", f"trainer={req.trainer} runs one process per cell, which starts "
                       f"one SGLang server, and this layout has {servers}: use trainer=megatron (a rank per GPU "
                       "starts each server) or one server per cell"))
    if req.nodes_per_cell > 1 and req.engine_weight_dir.startswith(NODE_LOCAL_DIRS):
        broken.append(("gyre.weight_dir_shared", f"engine.weight_dir={req.engine_weight_dir} is node-local, and the "
                       f"servers on a cell's other {req.nodes_per_cell - 1} node(s) load each version the leader "
                       "writes there: set engine.weight_dir to a shared folder"))
    return {"kind": "sglang", "tp": tp, "pp": pp, "dp": dp, "ep": ep, "nnodes": nnodes,
            "gpus_per_server": gpus_per_server, "servers_per_cell": servers,
            "summary": f"sglang {servers} server(s) a cell, each TP{tp} x PP{pp} x DP{dp} on {nnodes} node(s)"}


def _memory_rules(req: LayoutRequest, broken: list) -> dict:
    s = req.shape
    if s is None:
        return {"estimated": False, "summary": "not estimated (no config.json at model.path, not a shipped preset)"}
    out: dict[str, Any] = {"estimated": True, "shape_from": req.shape_from, "gpu_mem_gib": req.gpu_mem_gib,
                           "params_b": round((s.dense_params() + s.expert_params()) / 1e9, 2)}
    parts = []
    if req.trainer == "megatron":
        tp, pp, ep = req.trainer_tp, req.trainer_pp, req.trainer_ep
        per_gpu = s.dense_params() / (tp * pp) + s.expert_params() / (ep * pp)
        need = per_gpu * TRAIN_BYTES_PER_PARAM.get(req.params_dtype, 18) / GIB
        limit = TRAIN_MEM_FRACTION * req.gpu_mem_gib
        out |= {"train_state_gib": round(need, 1), "train_limit_gib": round(limit, 1)}
        parts.append(f"training {need:.1f} of {limit:.1f} GiB")
        if need > limit:
            broken.append(("memory.train", f"weights, gradients and Adam state take ~{need:.1f} GiB a GPU at TP{tp} x "
                           f"PP{pp} x EP{ep}, over {limit:.1f} GiB ({TRAIN_MEM_FRACTION:.0%} of {req.gpu_mem_gib:g})"))
    if req.engine == "sglang":
        shards = req.engine_tp * req.engine_pp
        weights = (s.dense_params() + s.expert_params()) * SERVE_BYTES_PER_PARAM.get(req.engine_dtype, 2) / shards / GIB
        kv_heads = math.ceil(s.num_key_value_heads / req.engine_tp)  # replicated when tp > KV heads
        kv_token = 2 * math.ceil(s.num_layers / req.engine_pp) * kv_heads * s.head_dim * 2 / GIB
        context = req.context_length or s.max_position_embeddings
        static = req.mem_fraction_static * req.gpu_mem_gib
        pool = static - weights
        out |= {"serve_weights_gib": round(weights, 1), "serve_static_gib": round(static, 1),
                "kv_pool_gib": round(pool, 1), "kv_pool_tokens": max(0, int(pool / kv_token)), "context_length": context}
        parts.append(f"serving {weights:.1f} GiB weights + {max(pool, 0):.1f} GiB KV (~{max(0, int(pool / kv_token))} tokens)")
        if pool < kv_token * context:
            broken.append(("memory.serve", f"bf16 weights take ~{weights:.1f} GiB a GPU at tp{req.engine_tp} x "
                           f"pp{req.engine_pp}, leaving {pool:.1f} of {static:.1f} GiB (mem_fraction_static) for a "
                           f"KV pool that needs {kv_token * context:.1f} GiB for one {context}-token context"))
    out["summary"] = ", ".join(parts) + " (estimated, activations excluded)" if parts else "nothing on the GPU"
    return out


# ==================================================================== shells: config -> request



def model_shape(model: Mapping[str, Any]) -> tuple[ModelShape | None, str]:
    """The checkpoint's config.json when it is readable, else a shipped preset's published shape,
    else the seeded model's own sizes (``model=tiny``), else None."""
    path = str(model.get("path") or "")
    if path and path != "???":
        hf_json = Path(path) / "config.json"
        try:
            return ModelShape.from_hf(json.loads(hf_json.read_text())), str(hf_json)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    name = str(model.get("name", ""))
    if name in PRESET_SHAPES:
        return PRESET_SHAPES[name], f"preset {name}"
    if not path and model.get("num_hidden_layers"):
        return ModelShape(num_layers=model["num_hidden_layers"], hidden_size=model["hidden_size"],
                          intermediate_size=model["intermediate_size"], num_attention_heads=model["num_attention_heads"],
                          num_key_value_heads=model["num_key_value_heads"], head_dim=model["head_dim"],
                          vocab_size=model.get("compact_ranks", 1024) + 64,
                          max_position_embeddings=model["max_position_embeddings"],
                          tie_word_embeddings=model["tie_word_embeddings"]), f"model {name} sizes"
    return None, ""


def request_from_config(*, model: Mapping[str, Any], trainer: Any, engine: Any, ranks_per_node: int,
                        nodes_per_cell: int, gpus_per_node: int, gpu_mem_gib: float) -> LayoutRequest:
    """``model`` as plain resolved YAML (its path may still be ``???``); ``trainer``/``engine`` the
    typed configs (cellrunner.config)."""
    shape, shape_from = model_shape(model)
    kw: dict[str, Any] = {}
    if trainer.kind == "megatron":
        kw |= {"trainer_tp": trainer.tensor_model_parallel_size, "trainer_pp": trainer.pipeline_model_parallel_size,
               "trainer_ep": trainer.expert_model_parallel_size, "params_dtype": trainer.params_dtype}
    if engine.kind == "sglang":
        kw |= {"engine_tp": engine.tp_size, "engine_pp": engine_pp_of(engine.extra_args), "engine_dp": engine.dp_size,
               "engine_ep": engine.ep_size, "engine_nnodes": engine.nnodes, "engine_dtype": engine.dtype,
               "engine_weight_dir": engine.weight_dir,
               "mem_fraction_static": engine.mem_fraction_static, "context_length": engine.context_length}
    return LayoutRequest(nodes_per_cell=nodes_per_cell, gpus_per_node=gpus_per_node, gpu_mem_gib=gpu_mem_gib,
                         ranks_per_node=ranks_per_node, trainer=trainer.kind, engine=engine.kind, shape=shape,
                         shape_from=shape_from, **kw)


def check_job(cfg: Any, env: Mapping[str, str]) -> Layout | None:
    """``gyre`` inside a Slurm job: this job's cells (``SLURM_JOB_NUM_NODES`` over
    ``cluster.num_cells``; spare nodes stay idle, as ``slurm_launch.split_cells`` leaves them), one
    rank per GPU. None outside an allocation (``SlurmCells.from_env`` says so next)."""
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if not nodes or not nodes.isdigit():
        return None
    model = {k: getattr(cfg.model, k) for k in ("name", "path", "num_hidden_layers", "hidden_size",
                                                "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                                "head_dim", "max_position_embeddings", "tie_word_embeddings",
                                                "compact_ranks")}
    gpus = cfg.cluster.ranks_per_node if cfg.trainer.kind == "megatron" else max(1, cfg.cluster.ranks_per_node)
    req = request_from_config(model=model, trainer=cfg.trainer, engine=cfg.engine,
                              ranks_per_node=cfg.cluster.ranks_per_node,
                              nodes_per_cell=int(nodes) // max(1, cfg.cluster.num_cells), gpus_per_node=gpus,
                              gpu_mem_gib=float(env.get(GPU_MEM_ENV) or DEFAULT_GPU_MEM_GIB))
    return check_layout(req)


def compose(preset: str, overrides: list[str]) -> dict:
    """conf/ with ``model=PRESET``, the GPU stack unless the overrides pick another, and the overrides."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    groups = {o.split("=", 1)[0] for o in overrides if "=" in o}
    if "model" in groups:
        named = [o.split("=", 1)[1] for o in overrides if o.startswith("model=")]
        if any(n != preset for n in named):
            raise ValueError(f"PRESET {preset} and the override model={named[-1]} disagree")
        overrides = [o for o in overrides if not o.startswith("model=")]
    stack = [f"{g}={v}" for g, v in (("trainer", "megatron"), ("engine", "sglang")) if g not in groups]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        raw = hydra_compose(config_name="config", overrides=[f"model={preset}", *stack, *overrides])
    return OmegaConf.to_container(raw, resolve=True)


def main(argv: list[str] | None = None) -> int:
    from cellrunner.config import EmbeddedEngineConfig, EmbeddedTrainerConfig, MegatronConfig, SGLangConfig
    from base.typed_config import ConfigError, build

    ap = argparse.ArgumentParser(prog="python -m controller.layout", description=__doc__.split("\n\n")[0])
    ap.add_argument("preset", help="a model preset (conf/model/*.yaml): qwen3_hf, qwen3_8b, ...")
    ap.add_argument("--nodes-per-cell", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, required=True)
    ap.add_argument("--gpu-mem-gib", type=float, default=float(os.environ.get(GPU_MEM_ENV) or DEFAULT_GPU_MEM_GIB))
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as gyre takes them")
    args = ap.parse_intermixed_args(argv)
    head = {"preset": args.preset, "nodes_per_cell": args.nodes_per_cell, "gpus_per_node": args.gpus_per_node}
    try:
        resolved = compose(args.preset, list(args.overrides))
        trainer_cls = MegatronConfig if resolved["trainer"].get("kind") == "megatron" else EmbeddedTrainerConfig
        engine_cls = SGLangConfig if resolved["engine"].get("kind") == "sglang" else EmbeddedEngineConfig
        trainer = build(trainer_cls, resolved["trainer"], "trainer")
        engine = build(engine_cls, resolved["engine"], "engine")
    except Exception as exc:  # Hydra's and the typed config's errors alike: one line, as JSON
        line = " ".join(str(exc).split())
        print(json.dumps({"ok": False, "why": f"config: {line}", "rule": "config", **head}))
        return 2
    req = request_from_config(model=resolved["model"], trainer=trainer, engine=engine,
                              ranks_per_node=resolved["cluster"]["ranks_per_node"], nodes_per_cell=args.nodes_per_cell,
                              gpus_per_node=args.gpus_per_node, gpu_mem_gib=args.gpu_mem_gib)
    result = check_layout(req)
    print(json.dumps({"ok": result.ok, "why": result.why, **head, **result.to_json()}))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
