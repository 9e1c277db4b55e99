"""Parameters to host memory and back, keeping every tensor (and its autograd hooks) as it was.

The core's trainer gives its GPU memory to the serving engine while it serves
(``trainer.offload_when_serving``). Moving a parameter by swapping its ``.data`` for a host copy
and back gives it new storage on another device, and autograd then makes it a new gradient
accumulator: the hooks Megatron's DDP put on the old one never fire again, so the backward pass
leaves gradients in ``param.grad`` and the DDP buffer the optimizer reads stays zero. Measured on
an H200 on 2026-12-04 (``scripts/gpu_check.py --no-sglang``): the core's first step after a switch
had a gradient norm of exactly 0.

So this keeps each parameter's tensor and storage: it copies the values out, shrinks the storage to
nothing (freeing the device memory, as Megatron does for its gradient buffers), and on the way back
grows the same storage again and copies the values in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class Offloaded:
    params: list[tuple[torch.Tensor, torch.Tensor]]
    """(parameter, its values on the host)."""
    storages: list[tuple[torch.UntypedStorage, int]]
    """Each distinct storage behind the parameters, with its size in bytes (views share one)."""


def offload(params: Iterable[torch.Tensor], *, reuse: Offloaded | None = None) -> Offloaded:
    """Copy the values to host memory (pinned when CUDA is there) and free the parameters' storage.
    ``reuse``: the previous offload of the same parameters, whose host buffers are taken again
    (pinning gigabytes anew at every switch costs seconds)."""
    pin = torch.cuda.is_available()
    params = list(params)
    old = [h for _, h in reuse.params] if reuse is not None else []
    if len(old) != len(params) or any(h.shape != p.shape or h.dtype != p.dtype for h, p in zip(old, params)):
        old = [torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin) for p in params]
    saved, storages, seen = [], [], set()
    for p, host in zip(params, old):
        host.copy_(p.detach(), non_blocking=pin)
        saved.append((p, host))
        storage = p.data.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            storages.append((storage, storage.nbytes()))
    if pin:
        torch.cuda.synchronize()  # the copies must land before the storage goes
    for storage, _ in storages:
        storage.resize_(0)
    return Offloaded(saved, storages)


def restore(off: Offloaded) -> None:
    """Grow each storage back to its size and copy the values in: the same tensors, the same hooks."""
    for storage, nbytes in off.storages:
        storage.resize_(nbytes)
    for p, host in off.params:
        p.data.copy_(host, non_blocking=host.is_pinned())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
