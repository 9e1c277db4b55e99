"""cellrunner.param_offload: values come back, the device memory goes, the tensors (and the
gradient hooks Megatron's DDP puts on them) stay the same objects."""

from __future__ import annotations

import torch

from cellrunner import param_offload


def hooked(p: torch.Tensor, main_grad: torch.Tensor) -> object:
    """What Megatron's DDP does: a hook on the parameter's gradient accumulator that moves each
    gradient into its buffer (``main_grad``) and leaves ``p.grad`` empty."""
    acc = p.expand_as(p).grad_fn.next_functions[0][0]

    def move(*_: object) -> None:
        main_grad.add_(p.grad)
        p.grad = None

    acc.register_hook(move)
    return acc  # DDP keeps it alive; so does the caller


def test_values_come_back_and_gradients_still_reach_the_buffer():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    keep = [hooked(p, buffers[n]) for n, p in model.named_parameters()]
    ids = {n: id(p) for n, p in model.named_parameters()}

    off = param_offload.offload(model.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # the memory is given back
    param_offload.restore(off)

    for n, p in model.named_parameters():
        assert id(p) == ids[n]
        assert torch.equal(p.detach(), before[n])
    model(torch.ones(3, 8)).sum().backward()
    for n, p in model.named_parameters():
        assert p.grad is None, f"{n}: the gradient bypassed the DDP hook"
        assert buffers[n].abs().sum() > 0, f"{n}: nothing reached the buffer"
    assert keep  # the accumulators (and their hooks) lived through the backward pass, as DDP keeps them


def test_views_of_one_buffer_share_one_storage():
    flat = torch.arange(12, dtype=torch.float32)
    a, b = torch.nn.Parameter(flat[:6].view(2, 3)), torch.nn.Parameter(flat[6:].view(3, 2))
    off = param_offload.offload([a, b])
    assert len(off.storages) == 1
    assert a.untyped_storage().nbytes() == 0
    param_offload.restore(off)
    assert torch.equal(a.detach().reshape(-1), torch.arange(6, dtype=torch.float32))
    assert torch.equal(b.detach().reshape(-1), torch.arange(6, 12, dtype=torch.float32))
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_a_second_offload_reuses_the_host_buffers_and_takes_the_new_values():
    model = torch.nn.Linear(4, 4)
    first = param_offload.offload(model.parameters())
    param_offload.restore(first)
    with torch.no_grad():
        model.weight.add_(1.0)  # trained between the two switches
    expected = model.weight.detach().clone()
    second = param_offload.offload(model.parameters(), reuse=first)
    assert all(a is b for (_, a), (_, b) in zip(first.params, second.params))
    param_offload.restore(second)
    assert torch.equal(model.weight.detach(), expected)


def test_other_parameters_get_fresh_host_buffers():
    first = param_offload.offload(torch.nn.Linear(4, 4).parameters())
    other = torch.nn.Linear(4, 2)
    before = other.weight.detach().clone()
    second = param_offload.offload(other.parameters(), reuse=first)
    assert all(a is not b for (_, a), (_, b) in zip(first.params, second.params))
    param_offload.restore(second)
    assert other.weight.shape == (2, 4) and torch.equal(other.weight.detach(), before)
