"""Megatron's process groups and the model's TransformerConfig and layer spec, from an HF config
and ``MegatronConfig``: what ``cellrunner.megatron_trainer`` builds its replica from.

megatron-core is imported here, once: it is in the [test] and [gpu] installs, not the default
one, so ``IMPORT_ERROR`` says why a run that asks for ``trainer=megatron`` cannot have it.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cellrunner.config import MegatronConfig
from cellrunner.megatron_convert import Qwen3Layout

try:  # megatron-core is in the [test] and [gpu] installs, not the default one
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig
    IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # pragma: no cover - exercised only on installs without megatron
    IMPORT_ERROR = exc
    # The names the trainer imports exist either way; MegatronTrainer refuses to start with IMPORT_ERROR.
    parallel_state = tensor_parallel = DistributedDataParallel = DistributedDataParallelConfig = None
    finalize_model_grads = get_gpt_decoder_block_spec = GPTModel = OptimizerConfig = None
    get_megatron_optimizer = get_forward_backward_func = TransformerConfig = None


# ---------------------------------------------------------------- process groups and config


def ensure_process_groups(cfg: MegatronConfig, *, seed: int) -> None:
    """Start torch.distributed (one rank, or env:// under torchrun/srun) and Megatron's groups."""
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group(backend, init_method="env://")
        else:  # a one-process cell needs no rendezvous: an in-process store
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    tp, pp, ep = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.expert_model_parallel_size
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (tp, pp, ep):
            raise RuntimeError(f"megatron groups already initialised as tp/pp/ep={have}, want {(tp, pp, ep)}")
        return
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of tp*pp = {tp * pp}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(hf: Any, layout: Qwen3Layout, cfg: MegatronConfig) -> TransformerConfig:
    """A Qwen3 TransformerConfig from an HF config (dense, or MoE when it has experts)."""
    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if cfg.params_dtype == "bfloat16" else torch.float32
    moe: dict[str, Any] = {}
    if layout.num_experts:
        moe = dict(
            num_moe_experts=layout.num_experts,
            moe_router_topk=int(hf.num_experts_per_tok),
            moe_ffn_hidden_size=layout.moe_ffn_hidden_size,
            moe_layer_freq=[1 if layout.is_moe(i) else 0 for i in range(layout.num_layers)],
            # Qwen3-MoE: softmax over all experts, top-k, renormalised iff norm_topk_prob; Megatron's
            # top-k-then-softmax equals the renormalised form.
            moe_router_pre_softmax=not bool(getattr(hf, "norm_topk_prob", True)),
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            # all-to-all is the one for expert parallelism and the one variable sequence lengths
            # (PP > 1) allow; Megatron's default all-gather otherwise.
            moe_token_dispatcher_type="alltoall" if cfg.expert_model_parallel_size > 1
            or cfg.pipeline_model_parallel_size > 1 else "allgather",
            moe_grouped_gemm=False,
            expert_tensor_parallel_size=1,
        )
    return TransformerConfig(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_kv_heads,
        kv_channels=layout.head_dim,
        ffn_hidden_size=layout.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(getattr(hf, "attention_bias", False)),
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        sequence_parallel=False,
        # Leave the loss a sum: no division by tokens or microbatches, DDP sums over DP ranks.
        calculate_per_token_loss=True,
        variable_seq_lengths=cfg.pipeline_model_parallel_size > 1,
        # Weights are always loaded right after the build, so nothing is initialised.
        perform_initialization=False,
        use_cpu_initialization=not on_gpu,
        # Fusions need apex / Megatron's compiled kernels; the unfused paths compute the same.
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **recompute_args(cfg),
        **moe,
    )


def recompute_args(cfg: MegatronConfig) -> dict[str, Any]:
    """Megatron's activation recompute fields from ``MegatronConfig``."""
    if cfg.recompute_granularity == "none":
        return {}
    if cfg.recompute_granularity == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    return dict(recompute_granularity="full", recompute_method=cfg.recompute_method,
                recompute_num_layers=cfg.recompute_num_layers)


def fix_moe_without_transformer_engine() -> None:
    """megatron-core 0.16.1's router gate tests ``te_general_gemm is not None`` but defines the
    name only when Transformer Engine imports, so a MoE model without TE dies with a NameError
    on any device. Define it as None: the unfused matmul path it guards then runs, as intended."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def block_spec(tconfig: TransformerConfig, cfg: MegatronConfig) -> Any:
    """This pipeline stage's layers: dense or MoE per ``moe_layer_freq``, local or TE modules;
    the local spec's core attention is torch's SDPA unless ``local_attention: unfused``."""
    spec = get_gpt_decoder_block_spec(tconfig, use_transformer_engine=cfg.layer_spec == "transformer_engine",
                                      normalization="RMSNorm")
    if cfg.layer_spec == "local" and cfg.local_attention == "sdpa":
        from cellrunner.megatron_attention import SDPAttention

        spec = copy.deepcopy(spec)  # megatron may hand out shared spec objects
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def attention_backend(cfg: MegatronConfig) -> str:
    """Which core attention the model runs, as reported in the log and by the trainer."""
    if cfg.layer_spec == "transformer_engine":
        return "transformer_engine"
    return "torch_sdpa" if cfg.local_attention == "sdpa" else "megatron_unfused"


def rope_theta(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None)  # transformers 5 moved it here
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(hf.rope_theta)
