"""The Megatron trainer (``trainer=megatron``): a megatron-core GPTModel replica of the policy.

Same interface and the same arithmetic as ``cellrunner.trainer.EmbeddedTrainer``: microsteps
accumulate the GSPO loss's gradient *sum* (``cellrunner.gspo``: masks, per-execution token
weights); ``take_grads`` hands a satellite's sum over; the core's ``apply`` adds the satellites'
sums to its own, divides by the step's executions and steps the optimizer. What differs:

- The model is megatron-core's ``GPTModel`` for Qwen3 (RMSNorm, qk-norm, SwiGLU, no biases, RoPE;
  MoE when the HF config has experts), built from the HF config; weights cross processes in
  the HF layout (``FlatWeights`` with HF names, as the embedded model and SGLang use them),
  converted per TP rank by ``cellrunner.megatron_convert``.
- Gradients accumulate in Megatron's DDP buffers (``param.main_grad``) and the step is taken by
  ``get_megatron_optimizer``. A plain ``torch.optim`` optimizer would read ``param.grad``, which
  Megatron's DDP never fills: it runs but does not train.
- ``calculate_per_token_loss=True`` keeps Megatron from dividing the loss by microbatches and
  tokens and makes its DDP *sum* over data-parallel ranks, so the gradient stays the plain sum
  the cross-cell combination expects.
- A satellite's gradient is its local DDP buffer, flat (after the in-cell DP/TP reductions). Cells
  share one training layout, so rank r of a satellite and rank r of the core hold the same
  layout; the shapes are checked.
- Checkpoints: each rank writes its own shard (parameters and Adam state, Megatron layout) as
  safetensors plus one JSON manifest (``cellrunner.megatron_checkpoint``); the HF export is
  ``weights()``. Process groups, the TransformerConfig and the layer spec come from
  ``cellrunner.megatron_setup``.

Every rank of a cell calls the same methods with the same arguments (SPMD). With one process per
cell (the default) the trainer starts its own one-rank process group.

Runs on CUDA unpatched. On a CPU-only torch megatron-core 0.16 needs the shims of
``tests/cellrunner/megatron_cpu_shims.py`` (tests only); nothing here patches megatron.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from cellrunner import param_offload
from cellrunner.errors import BackendUnavailable
from cellrunner.config import MegatronConfig, ModelConfig
from cellrunner.gspo import LossStats, PackedBatch, gspo_loss, pack
from cellrunner.megatron_convert import (
    HFFolder, export_units, global_expert_name, hf_from_megatron, hf_specs, hf_tensors, is_expert,
    iter_hf_to_megatron, layout_from_hf, tp_split_dim,
)
from cellrunner.megatron_checkpoint import MegatronCheckpoints
from cellrunner.megatron_logprobs import chunked_token_logprobs
from cellrunner.megatron_setup import (  # megatron-core is imported once, there
    IMPORT_ERROR as _IMPORT_ERROR, DistributedDataParallel, DistributedDataParallelConfig, GPTModel, OptimizerConfig,
    attention_backend, block_spec, ensure_process_groups, finalize_model_grads, get_forward_backward_func,
    get_megatron_optimizer, parallel_state, rope_theta, transformer_config,
    fix_moe_without_transformer_engine,
)
from cellrunner.model import FlatWeights, build_model, hf_config
from cellrunner.trainer import MicrostepResult, split_by_tokens
from base.wire import Shard, TensorSpec, WeightsDtype
from base.algo_config import AlgoConfig

log = logging.getLogger(__name__)

INSTALL_HINT = "trainer=megatron needs megatron-core: `pip install megatron-core==0.16.1 psutil` (Python 3.11)"
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class MegatronUnavailable(BackendUnavailable):
    """``trainer=megatron`` was chosen but megatron-core cannot be imported."""


def microbatches(chunks: list[list[Any]], dp_rank: int, dp_size: int, *, even: bool) -> list[PackedBatch]:
    """This DP rank's share of a shard's chunks (every ``dp_size``-th). ``even``: every DP rank
    runs the same number of microbatches, the short ones padded with a copy of a batch whose
    targets are all masked out (no loss, no gradient): with expert parallelism each MoE layer's
    token all-to-all is a collective over the EP group, so a rank with one microbatch fewer would
    leave its peers waiting in it."""
    batches = [pack(c) for c in chunks[dp_rank::dp_size]]
    if even and chunks:
        idle = dataclasses.replace(pack(chunks[0]), num_targets=0)
        idle = dataclasses.replace(idle, target_mask=torch.zeros_like(idle.target_mask))
        batches += [idle] * (-(-len(chunks) // dp_size) - len(batches))
    return batches


# ---------------------------------------------------------------- the trainer


class MegatronTrainer(MegatronCheckpoints):
    """One cell's Megatron replica. Methods and return values as ``EmbeddedTrainer``'s."""

    def __init__(self, *, model_cfg: ModelConfig, algo: AlgoConfig, vocab_size: int, is_core: bool,
                 megatron: MegatronConfig, seed: int = 0, export_dtype: WeightsDtype = "float32"):
        if _IMPORT_ERROR is not None:
            raise MegatronUnavailable(f"{INSTALL_HINT} (import failed: {_IMPORT_ERROR})")
        if algo.tree_packing:
            raise ValueError("algo.tree_packing is implemented by the embedded trainer only; "
                             "set algo.tree_packing=false with trainer=megatron")
        self.model_cfg, self.algo, self.vocab_size, self.is_core, self.cfg = model_cfg, algo, vocab_size, is_core, megatron
        self.export_dtype: WeightsDtype = export_dtype
        """What ``weights()`` and ``apply()`` hand the cell's publisher (``backends.core_export_dtype``):
        every rank of the cell must agree, as each sends its tensors in it."""
        ensure_process_groups(megatron, seed=seed)
        self.hf_config = hf_config(model_cfg, vocab_size)  # the checkpoint's own with model.path
        self.layout = layout_from_hf(self.hf_config, pad_to=megatron.pad_vocab_to,
                                     tp_size=megatron.tensor_model_parallel_size, layer_spec=megatron.layer_spec)
        self.specs = hf_specs(self.layout)
        self._spec_by_name = {s.name: s for s in self.specs}
        self.tconfig = transformer_config(self.hf_config, self.layout, megatron)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        self.pre_process = parallel_state.is_pipeline_first_stage()
        self.post_process = parallel_state.is_pipeline_last_stage()
        self.model: Any = None  # the DDP-wrapped GPTModel
        self.optimizer: Any = None
        self.version = -1
        self.num_microsteps = 0
        self._offloaded = False
        self._host_params: param_offload.Offloaded | None = None
        self._host_state: list[tuple[dict, str]] = []
        self._host_by_id: dict[int, torch.Tensor] = {}
        """While offloaded: each parameter's (and fp32 main copy's) host copy, by ``id``."""
        self._global_layers: list[int] = []
        self._units = export_units(self.layout)
        covered = [n for _, names in self._units for n in names]
        if sorted(covered) != sorted(self._spec_by_name):  # every HF tensor exported exactly once
            raise AssertionError("export units do not cover the HF manifest")
        self._owners: torch.Tensor | None = None
        self.last_folder: HFFolder | None = None
        """The checkpoint folder version 0 was read from (its ``opened`` files: tests)."""
        self.attention_backend = attention_backend(megatron)
        self._pad_cols: torch.Tensor | None = None  # this rank's padded vocabulary columns

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, weights: FlatWeights | None) -> None:
        """Build the replica (or bring the core's back); load ``weights`` when given."""
        built = self._bring_up()
        if weights is not None:
            self._load_hf(hf_tensors(weights, self.layout))
            self.version = weights.version
        elif built:
            self._load_hf(self._initial_hf())
            self.version = 0  # the seeded init (or the HF checkpoint) is version 0 everywhere
        self._ready()

    def _bring_up(self) -> bool:
        """Build the replica, or bring an offloaded core's back; True when it was just built."""
        if self.model is None:
            self._build()
            return True
        if self._offloaded:
            self._restore()
        return False

    def _ready(self) -> None:
        """Into training mode with clean gradients (and the core's optimizer, once)."""
        self.model.train()
        self.model.zero_grad_buffer()
        self.num_microsteps = 0
        if self.is_core and self.optimizer is None:
            b1, b2 = self.algo.betas
            self.optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=self.algo.lr, min_lr=self.algo.lr, weight_decay=self.algo.weight_decay,
                adam_beta1=b1, adam_beta2=b2, adam_eps=1e-8, clip_grad=self.algo.grad_clip,
                bf16=self.cfg.params_dtype == "bfloat16", params_dtype=self.tconfig.params_dtype,
            ), [self.model])

    def stop(self) -> None:
        """Satellites drop everything; the core keeps weights and optimizer state (it owns them)."""
        if self.model is None:
            return
        self.model.zero_grad_buffer()
        self.num_microsteps = 0
        if not self.is_core:
            self.model = None
            self.version = -1
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # hand the memory back to the serving engine
        elif self._offloads():
            self._offload()

    def _offloads(self) -> bool:
        """Whether ``stop`` gives the core's memory to the serving engine: on CUDA, when configured
        (the CPU tests turn it on for the host to run the same path)."""
        return self.cfg.offload_when_serving and torch.cuda.is_available()

    @property
    def params_weights_dtype(self) -> WeightsDtype:
        """The parameters' own dtype: ``weights(dtype=...)`` in it loses nothing (a bf16 model's
        float32 export is only wider) and takes half the bytes of float32 for a bf16 model."""
        return "bfloat16" if self.tconfig.params_dtype == torch.bfloat16 else "float32"

    def weights(self, *, everywhere: bool = True, dtype: WeightsDtype | None = None) -> FlatWeights | None:
        """The full model in the HF layout, in ``dtype`` (by default ``export_dtype``: what the
        cell's publisher hands out; ``params_weights_dtype`` for the smallest exact copy). ``everywhere``: on every
        rank of the cell; else only on the cell's rank 0, the one that publishes it (serving
        engines and satellites read it there), every other rank returning None.

        Streamed one megatron tensor at a time (``_export``): its TP shards are gathered on its
        owner, converted to HF tensors there, and sent to rank 0 (or broadcast), which writes them
        into the one flat buffer. No rank builds a second copy of the model, and only rank 0 holds
        the whole of it; experts come from the EP rank that holds them, stages from their stage."""
        assert self.model is not None, "weights() before start()"
        # An offloaded core (it serves) exports from the host copies the offload keeps: its own
        # parameters' storage is freed. Each tensor visits the device only for its own collectives
        # (the serving engine holds the GPU).
        flat = self._export(lambda p: self._values(p).detach(), dtype=_TORCH_DTYPES[dtype or self.export_dtype],
                            everywhere=everywhere)
        if flat is None:
            return None
        data = flat.view(torch.int16).numpy().view(np.uint16) if flat.dtype == torch.bfloat16 else flat.numpy()
        return FlatWeights(self.version, self.specs, data)

    def _export(self, value: Any, *, dtype: torch.dtype, everywhere: bool) -> torch.Tensor | None:
        """Every parameter's ``value(p)`` (weights, or gradients) as one flat HF-layout host tensor
        of ``dtype`` in ``self.specs`` order: on every rank (``everywhere``) or on rank 0 only
        (None elsewhere). Every rank of the cell calls it (its collectives span the cell)."""
        params = self._named_params()
        local_of = self._local_names()
        owners = self._export_owners()
        me = dist.get_rank()
        multi = dist.get_world_size() > 1
        receive = everywhere or me == 0
        flat = torch.empty(self.specs[-1].offset + math.prod(self.specs[-1].shape), dtype=dtype) if receive else None
        tp_group = parallel_state.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        for unit, (name, hf_names) in enumerate(self._units):
            owner = int(owners[unit])
            local = local_of.get(name)
            produced: dict[str, torch.Tensor] = {}
            if local is not None and self._takes_part(name):
                t = value(params[local])
                if tp_split_dim(name) is not None and tp_group is not None:
                    t = t.to(self.device).contiguous()
                    parts = [torch.empty_like(t) for _ in range(self.tp_size)] if me == owner else None
                    dist.gather(t, parts, dst=parallel_state.get_tensor_model_parallel_src_rank(), group=tp_group)
                    shards = parts or []
                else:
                    shards = [t]
                if me == owner:
                    produced = hf_from_megatron(name, shards, self.layout)
                del t, shards
            for hf_name in hf_names:
                spec = self._spec_by_name[hf_name]
                where = slice(spec.offset, spec.offset + math.prod(spec.shape))
                if not multi or (me == owner and not everywhere and me == 0):
                    if receive:
                        flat[where] = produced[hf_name].reshape(-1)
                    continue
                if everywhere:
                    buf = (produced[hf_name].to(self.device, dtype).contiguous() if me == owner
                           else torch.empty(spec.shape, dtype=dtype, device=self.device))
                    dist.broadcast(buf, src=owner)
                    flat[where] = buf.reshape(-1)
                elif me == owner:
                    dist.send(produced[hf_name].to(self.device, dtype).contiguous(), dst=0)
                elif me == 0:
                    buf = torch.empty(spec.shape, dtype=dtype, device=self.device)
                    dist.recv(buf, src=owner)
                    flat[where] = buf.reshape(-1)
            del produced
        return flat

    def _takes_part(self, name: str) -> bool:
        """Whether this rank joins the export of megatron tensor ``name`` (it holds it): one
        replica's ranks export each tensor, DP replica 0 the dense ones, expert-data-parallel
        replica 0 the experts."""
        if is_expert(name):
            return parallel_state.get_expert_data_parallel_rank() == 0
        return self.dp_rank == 0

    def _owns(self, name: str) -> bool:
        return self._takes_part(name) and (is_expert(name) or self.tp_rank == 0)

    def _local_names(self) -> dict[str, str]:
        """Global megatron name (global expert index) -> this rank's own parameter name."""
        ep = self.cfg.expert_model_parallel_size
        out = {}
        for n in self._named_params():
            if n == "output_layer.weight" and self.layout.tied_embeddings:
                continue  # a copy of the embedding on the last stage
            out[global_expert_name(n, ep_size=ep, ep_rank=self.ep_rank, num_experts=self.layout.num_experts)] = n
        return out

    def _export_owners(self) -> torch.Tensor:
        """The global rank that converts and sends each export unit, agreed by every rank once:
        each owner marks its units, a sum over the cell collects them, and every unit must have
        exactly one (else the layout reasoning above is wrong, and the export would be too)."""
        if self._owners is None:
            local_of = self._local_names()
            table = torch.zeros((2, len(self._units)), dtype=torch.int64)
            for unit, (name, _) in enumerate(self._units):
                if name in local_of and self._owns(name):
                    table[0, unit], table[1, unit] = dist.get_rank(), 1
            if dist.get_world_size() > 1:
                reduced = table.to(self.device)
                dist.all_reduce(reduced)
                table = reduced.cpu()
            bad = [self._units[u][0] for u in range(len(self._units)) if int(table[1, u]) != 1]
            if bad:
                raise RuntimeError(f"weights(): {len(bad)} tensors without exactly one owning rank, e.g. {bad[:3]}")
            self._owners = table[0]
        return self._owners

    def local_weights(self) -> FlatWeights:
        """This rank's own parameters, float32, in the Megatron layout (global names): what the
        same rank of another cell with this layout loads with ``start_local``."""
        assert self.model is not None, "local_weights() before start()"
        params = self._named_params()
        specs, offset = [], 0
        for name, p in params.items():
            specs.append(TensorSpec(name=name, shape=list(p.shape), offset=offset))
            offset += p.numel()
        flat = torch.empty(offset, dtype=torch.float32)  # filled tensor by tensor, no second copy
        for spec, p in zip(specs, params.values()):
            flat[spec.offset : spec.offset + p.numel()] = self._values(p).detach().reshape(-1).cpu()
        return FlatWeights(self.version, tuple(specs), flat.numpy())

    def start_local(self, weights: FlatWeights) -> None:
        """``start`` from the same rank's ``local_weights`` of another cell (no HF conversion, no
        gather): the layouts must match name for name."""
        self._bring_up()
        if [s.name for s in weights.specs] != list(self._named_params()):
            raise ValueError("weights: this rank's manifest does not match the sender's (different layouts)")
        data = weights.tensor()
        self._set_params({s.name: data[s.offset : s.offset + math.prod(s.shape)].view(s.shape) for s in weights.specs})
        self.version = weights.version
        self._ready()

    # -- work ----------------------------------------------------------------------------------

    def microstep(self, shard: Shard) -> MicrostepResult:
        assert self.model is not None, "microstep before start()"
        if shard.run_released:  # GyreConfig.check refuses the combination; a stray shard is refused here
            raise ValueError(f"shard {shard.shard_id} is run-released: trainer=megatron needs algo.release=group")
        t0 = time.perf_counter()
        chunks = split_by_tokens(list(shard.sequences), self.algo.max_tokens_per_microstep)
        batches = microbatches(chunks, self.dp_rank, self.dp_size, even=self.cfg.expert_model_parallel_size > 1)
        totals = torch.zeros(6, dtype=torch.float64)  # loss, tokens, ratio*seqs, clipped*seqs, seqs, kl*tokens
        if batches:
            fb = get_forward_backward_func()
            fb(
                forward_step_func=partial(self._forward_step, totals),
                data_iterator=iter(batches), model=[self.model], num_microbatches=len(batches),
                seq_length=max(b.input_ids.shape[1] for b in batches),
                micro_batch_size=max(b.input_ids.shape[0] for b in batches), forward_only=False,
            )
        if dist.get_world_size() > 1:  # the loss lives on the last stage of each DP replica
            reduced = totals.to(self.device)
            dist.all_reduce(reduced)
            totals = reduced.cpu() / self.tp_size  # every TP rank counted the same batches
        self.num_microsteps += 1
        seqs = max(float(totals[4]), 1.0)
        return MicrostepResult(
            num_tokens=int(round(float(totals[1]))), loss=float(totals[0]), fb_s=time.perf_counter() - t0,
            mean_ratio=float(totals[2]) / seqs, clip_fraction=float(totals[3]) / seqs,
            kl=float(totals[5]) / float(totals[1]) if float(totals[1]) > 0 else None,
        )

    def take_grads(self) -> np.ndarray:
        """The summed gradient of every microstep since the last call, this rank's flat DDP
        buffer (after the cell's own DP/TP reductions); then zero it."""
        assert self.model is not None
        finalize_model_grads([self.model])
        flat = torch.cat([b.reshape(-1).float() for b in self._grad_buffers()]).cpu().numpy().copy()
        self.model.zero_grad_buffer()
        self.num_microsteps = 0
        return flat

    def apply(self, satellite_grads: list[np.ndarray], num_executions: int) -> tuple[FlatWeights | None, float]:
        """Core only: combine gradients, mean over executions, clip, Adam step -> next version
        (its full weights on the cell's rank 0, None on the other ranks)."""
        assert self.is_core and self.model is not None and self.optimizer is not None
        buffers = self._grad_buffers()
        total = sum(b.numel() for b in buffers)
        for g in satellite_grads:  # checked first: a refused step must leave the gradients unreduced
            if g.shape != (total,):
                raise ValueError(f"satellite gradient has {g.size} elements, want {total}")
        finalize_model_grads([self.model])
        offset = 0
        for buf in buffers:
            n = buf.numel()
            for g in satellite_grads:
                buf.add_(torch.from_numpy(g[offset : offset + n]).to(buf.device, buf.dtype).view_as(buf))
            buf.div_(float(num_executions))
            offset += n
        if self._all_zero(buffers):
            # Every advantage 0: no data behind the step. Adam would still move every weight along
            # its decaying first moment, and the next real update would come out oversized (the
            # embedded trainer skips it the same way: tests/cellrunner/test_zero_advantage.py).
            log.info("step to version %d: the gradient is zero everywhere, optimizer step skipped", self.version + 1)
            norm = 0.0
        else:
            ok, norm, _ = self.optimizer.step()
            if not ok:
                raise RuntimeError("optimizer step skipped: non-finite gradients")
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.num_microsteps = 0
        self.version += 1
        # Only the cell's rank 0 publishes the new version: the others return None, not a full copy.
        return self.weights(everywhere=False), float(norm if norm is not None else 0.0)

    @staticmethod
    def _all_zero(buffers: list[torch.Tensor]) -> bool:
        """The cell's whole gradient is zero (all ranks agree: every rank calls this)."""
        nonzero = torch.tensor([float(any(bool(b.any()) for b in buffers))],
                               device=buffers[0].device if buffers else "cpu")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(nonzero, op=dist.ReduceOp.MAX)
        return not bool(nonzero.item())

    def grad_numel(self) -> int:
        """Elements of this rank's flat gradient (``take_grads``' length)."""
        assert self.model is not None
        return sum(b.numel() for b in self._grad_buffers())

    # -- internals -----------------------------------------------------------------------------

    def _build(self) -> None:
        if self.layout.num_experts:
            fix_moe_without_transformer_engine()
        gpt = GPTModel(
            config=self.tconfig, transformer_layer_spec=block_spec(self.tconfig, self.cfg),
            vocab_size=self.layout.padded_vocab_size, max_sequence_length=self.hf_config.max_position_embeddings,
            pre_process=self.pre_process, post_process=self.post_process, parallel_output=True,
            share_embeddings_and_output_weights=self.layout.tied_embeddings,
            position_embedding_type="rope", rotary_percent=1.0, rotary_base=rope_theta(self.hf_config),
        )
        gpt.to(self.device)
        log.info("megatron: attention %s, recompute %s", self.attention_backend, self.cfg.recompute_granularity)
        self._global_layers = [layer.layer_number - 1 for layer in gpt.decoder.layers]
        self.model = DistributedDataParallel(
            self.tconfig,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                          use_distributed_optimizer=False),
            gpt,
        )
        # Padded vocabulary rows must not take probability mass: mask their logits out.
        per_rank = self.layout.padded_vocab_size // self.tp_size
        cols = torch.arange(per_rank, device=self.device) + self.tp_rank * per_rank
        pad = cols >= self.layout.vocab_size
        self._pad_cols = pad if bool(pad.any()) else None

    def _initial_hf(self) -> Any:
        if self.model_cfg.path:
            # Read lazily: this rank opens only the files that hold its own tensors.
            self.last_folder = HFFolder(self.model_cfg.path)
            return self.last_folder
        # The same seeded init as cellrunner.model, so version 0 matches every other cell's.
        return {n: p.detach() for n, p in build_model(self.model_cfg, self.vocab_size).named_parameters()}

    def _global_name(self, local: str) -> str:
        if local.startswith("decoder.layers."):
            idx, rest = local[len("decoder.layers."):].split(".", 1)
            return f"decoder.layers.{self._global_layers[int(idx)]}.{rest}"
        return local

    def _named_params(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters by *global* megatron name (the DDP wrapper's prefix dropped)."""
        return {self._global_name(n): p for n, p in self.model.module.named_parameters()}

    def _local_state(self, fn: Any) -> dict[str, torch.Tensor]:
        state = {n: fn(p) for n, p in self._named_params().items()}
        if self.layout.tied_embeddings:
            state.pop("output_layer.weight", None)  # a copy of the embedding on the last stage
        return state

    def _load_hf(self, hf: Any) -> None:
        """This rank's parameters from HF tensors (a dict, FlatWeights views or an ``HFFolder``),
        converted and copied one tensor at a time: only this rank's tensors are read."""
        params = self._named_params()
        tied_out = self.layout.tied_embeddings and "output_layer.weight" in params
        want = set(params) | ({"embedding.word_embeddings.weight"} if tied_out else set())
        seen = set()
        with torch.no_grad():
            for name, t in iter_hf_to_megatron(hf, self.layout, tp_size=self.tp_size, tp_rank=self.tp_rank,
                                               ep_size=self.cfg.expert_model_parallel_size, ep_rank=self.ep_rank,
                                               layers=self._global_layers, keep=want.__contains__):
                targets = [name, "output_layer.weight"] if tied_out and name == "embedding.word_embeddings.weight" else [name]
                for n in targets:
                    p = params.get(n)
                    if p is None:
                        continue
                    if tuple(t.shape) != tuple(p.shape):
                        raise ValueError(f"weights: no tensor of shape {tuple(p.shape)} for {n}")
                    p.copy_(t.to(p.dtype))
                    seen.add(n)
        missing = sorted(set(params) - seen)
        if missing:
            raise ValueError(f"weights: nothing for {missing[:3]}")
        if self.optimizer is not None and hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()

    def _set_params(self, mine: dict[str, torch.Tensor]) -> None:
        """Copy this rank's parameters in, by global Megatron name, each of its exact shape."""
        with torch.no_grad():
            for name, p in self._named_params().items():
                src = mine.get(name)
                if src is None or tuple(src.shape) != tuple(p.shape):
                    raise ValueError(f"weights: no tensor of shape {tuple(p.shape)} for {name}")
                p.copy_(src.to(p.dtype))
        if self.optimizer is not None and hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()

    def _torch_optimizers(self) -> list[Any]:
        """The torch optimizers inside Megatron's (one per parameter kind when it chains them)."""
        if self.optimizer is None:
            return []
        inner = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [o.optimizer for o in inner if getattr(o, "optimizer", None) is not None
                and not getattr(o, "is_stub_optimizer", False)]

    def _grad_buffers(self) -> list[torch.Tensor]:
        return [b.grad_data for b in self.model.buffers + self.model.expert_parallel_buffers]

    def _forward_step(self, totals: torch.Tensor, data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        batch = self._on_device(next(data_iterator))
        b, length = batch.input_ids.shape
        positions = torch.arange(length, device=self.device).unsqueeze(0).expand(b, length)
        # Right padding: the causal mask alone keeps real positions from seeing pads.
        output = model(batch.input_ids, positions, None)
        return output, partial(self._loss, totals, batch)

    def _loss(self, totals: torch.Tensor, batch: PackedBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        logprobs = self.token_logprobs(logits, batch.targets)
        loss, stats = gspo_loss(logprobs, batch, eps_low=self.algo.eps_low, eps_high=self.algo.eps_high)
        self._count(totals, stats, batch)
        num_tokens = torch.tensor(stats.num_targets, dtype=torch.int, device=self.device)
        return loss, num_tokens, {"loss": loss.detach()}

    def token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log pi_theta of each next token, [B, L-1], from vocab-parallel logits [B, L, V/tp], at the
        sampling temperature (``algo.rollout``), as the engine scored the tokens it drew; a chunk
        of ``logprob_chunk_tokens`` tokens at a time (``cellrunner.megatron_logprobs``)."""
        group = parallel_state.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        return chunked_token_logprobs(logits, targets, temperature=self.algo.rollout.temperature,
                                      pad_cols=self._pad_cols, chunk_tokens=self.cfg.logprob_chunk_tokens, group=group)

    @staticmethod
    def _count(totals: torch.Tensor, stats: LossStats, batch: PackedBatch) -> None:
        n = int((batch.target_mask.sum(dim=1) > 0).sum().item())
        totals += torch.tensor([stats.loss, stats.num_targets, stats.mean_ratio * n, stats.clip_fraction * n, n,
                                stats.kl * stats.num_targets], dtype=torch.float64)

    def _on_device(self, batch: PackedBatch) -> PackedBatch:
        if self.device.type == "cpu":
            return batch
        fields = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()}
        return PackedBatch(**fields)

    def _offload(self) -> None:
        """Weights, gradient buffers and Adam state to host memory while serving (``stop`` calls it
        on CUDA only; on the host it runs the same path, which the CPU tests use).

        Not Megatron's ``optimizer.offload_to_cpu``: it moves the optimizer's parameters by swapping
        their ``.data``, and those include the model's own float32 parameters (the norms of a bf16
        model), whose DDP gradient hooks a device change drops (``param_offload``)."""
        tensors = {id(p): p for p in self.model.module.parameters()}
        for opt in self._torch_optimizers():
            tensors.update((id(p), p) for group in opt.param_groups for p in group["params"])
        self.model.offload_grad_buffers()
        self._host_params = param_offload.offload(list(tensors.values()), reuse=self._host_params)
        self._host_by_id = {id(p): host for p, host in self._host_params.params}
        self._host_state = []  # Adam's moments: plain tensors in a dict, no hooks on them
        for opt in self._torch_optimizers():
            for state in opt.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.is_cuda:
                        state[k] = v.cpu()
                        self._host_state.append((state, k))
        torch.cuda.empty_cache()
        self._offloaded = True

    def _values(self, p: torch.Tensor) -> torch.Tensor:
        """Where ``p``'s values are now: ``p`` itself, or its host copy while offloaded (the
        parameter's own storage is then freed: reading it reads nothing, or freed memory)."""
        if not self._offloaded:
            return p
        host = self._host_by_id.get(id(p))
        if host is None:
            raise RuntimeError("an offloaded parameter without a host copy")
        return host

    def _restore(self) -> None:
        param_offload.restore(self._host_params)  # its host buffers stay for the next offload
        self.model.restore_grad_buffers()
        for state, k in self._host_state:
            state[k] = state[k].to(self.device)
        self._host_state = []
        self._host_by_id = {}
        self._offloaded = False
