"""Test support only: make megatron-core 0.16.1 run on a machine without CUDA.

megatron-core's GPTModel, its DDP, optimizer and schedules are written for CUDA: a handful of places allocate with ``device="cuda"`` / ``torch.cuda.current_device()``, keep
RNG state in the CUDA generator, or assert a ``torch.cuda.FloatTensor``. On a CPU-only torch each
of those raises ``AssertionError: Torch not compiled with CUDA enabled`` (the list and the reasons
are ``shared/notes/cpu-stack.md`` §3). ``install()`` patches exactly those places and nothing else:

1. ``GlobalMemoryBuffer.get_tensor`` (the attention's ``baddbmm`` input buffer) allocates on
   ``torch.cuda.current_device()``                          -> module-local torch, see below.
2. RNG tracker: ``model_parallel_cuda_manual_seed`` and ``CudaRNGStatesTracker.add/fork`` read and
   write the CUDA generator (``get_rng_state``, ``_lazy_call``) -> they use the CPU generator.
3./4. (the notes' dist_checkpointing shims) not installed: Gyre's checkpoints are safetensors
   shards written by the trainer, because dist_checkpointing pickles its metadata.
5. ``get_forward_backward_func()`` schedules count tokens in ``torch.zeros([], device="cuda")``
   (also for pp=1)                                           -> module-local torch.
6. Megatron ``DistributedDataParallel`` + ``get_megatron_optimizer``: ``torch.tensor([1.0],
   device='cuda')`` in optimizer.py, ``local_multi_tensor_l2_norm`` (megatron/core/utils.py),
   clip_grads.py and param_and_grad_buffer.py              -> module-local torch.
7. ``clip_grad_by_total_norm_fp32`` asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``
   before scaling                                            -> an equivalent without the assert.
8. ``get_default_causal_mask`` builds the causal mask with ``device="cuda"`` -> module-local torch.
9. ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` (the notes'
   shim 4 covered it by patching ``torch.cuda.current_device`` globally) -> module-local torch.
10. MoE: ``TopKRouter.gating`` moves the router weight to ``torch.cuda.current_device()``
   -> module-local torch. (The MoE router's other 0.16.1 problem, an undefined
   ``te_general_gemm`` without Transformer Engine, is not CPU-specific: the trainer fixes it.)
11. MoE with expert parallelism: ``MoEAlltoAllTokenDispatcher.__init__`` makes a
   ``torch.cuda.Stream()`` for its device-to-host copies -> module-local torch, whose
   ``cuda.Stream`` is an inert stand-in. Enough to build and export an EP model; its forward
   pass still needs CUDA (the dispatcher's all-to-all runs on that stream).

"Module-local torch" replaces the name ``torch`` inside the listed megatron modules only with a
proxy that forwards everything to the real torch but maps a ``cuda`` device to ``cpu`` in the
few tensor factories, and answers ``torch.cuda.current_device()`` with ``"cpu"``,
``get_rng_state``/``manual_seed`` with the CPU generator and ``synchronize``/``empty_cache``
with no-ops. The real ``torch`` module is not touched, so the embedded trainer in the same
process is unaffected.

The trap the notes warn about is not a shim: Megatron's DDP with a plain ``torch.optim.AdamW``
runs but does not train (gradients land in ``param.main_grad``); ``MegatronTrainer`` uses
``get_megatron_optimizer``, and ``test_megatron_trainer`` checks that the loss goes down.

Never import this from production code: ``cellrunner/`` must run on CUDA unpatched.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

_installed = False

# Modules whose global name ``torch`` becomes the CPU proxy (shims 1, 2, 5, 6, 8-10).
PROXIED_MODULES = (
    "megatron.core.utils",  # 1 GlobalMemoryBuffer, 6 local_multi_tensor_l2_norm
    "megatron.core.transformer.utils",  # 8 get_default_causal_mask
    "megatron.core.pipeline_parallel.schedules",  # 5 total_num_tokens
    "megatron.core.optimizer.optimizer",  # 6 found_inf / _scale_one / _dummy_overflow_buf
    "megatron.core.optimizer.clip_grads",  # 6 total_norm_cuda, dummy_overflow_buf
    "megatron.core.distributed.param_and_grad_buffer",  # 6 buffer allocation
    "megatron.core.tensor_parallel.random",  # 2 torch.cuda.get_rng_state / manual_seed
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # 9 inv_freq.to(current_device())
    "megatron.core.transformer.moe.router",  # 10 router weight .to(current_device())
    "megatron.core.transformer.moe.token_dispatcher",  # 11 the all-to-all dispatcher's stream
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like", "ones_like")


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaAsCpu:
    """``torch.cuda`` as megatron uses it, answered for the CPU."""

    def current_device(self) -> str:
        return "cpu"

    def synchronize(self, *args: Any, **kwargs: Any) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_rng_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    class Stream:
        """Shim 11: a stream nothing runs on (torch.cuda.Stream raises without CUDA)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchWithCudaAsCpu:
    """The real ``torch`` module, except that CUDA placements become CPU ones."""

    cuda = _CudaAsCpu()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name in _FACTORIES:
            def factory(*args: Any, **kwargs: Any) -> Any:
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return attr(*args, **kwargs)
            return factory
        return attr


def _clip_grad_by_total_norm_fp32(parameters: Any, max_norm: float, total_norm: float,
                                  use_decoupled_grad: bool = False) -> None:
    """Shim 7: megatron's clip without its CUDA-type assertion (same scaling, in place)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for p in parameters:
            g = getattr(p, attr, None)
            if g is not None:
                g.detach().mul_(clip_coeff)


def _cpu_rng_get(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_rng_set(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def install() -> None:
    """Apply every shim above, once per process. Call before building a megatron model."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():  # a GPU machine runs megatron unpatched
        _installed = True
        return
    proxy = _TorchWithCudaAsCpu()
    for name in PROXIED_MODULES:
        importlib.import_module(name).torch = proxy
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = _cpu_rng_get  # shim 2
    random._set_cuda_rng_state = _cpu_rng_set
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32  # shim 7
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    _installed = True
