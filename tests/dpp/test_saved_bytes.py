"""The activations a microbatch leaves on CPU, for DPP's slack choice under a memory budget
(megatron/dpp/slack_measurement.py): the tensors a forward's autograd graph saved, each
storage once, parameters left out, read from the graph so that a backward which reads
attributes of its saved weight (the fused weight-gradient accumulation's main_grad) still
finds them."""

from __future__ import annotations

import torch

from megatron.dpp.actions import FORWARD, Task
from megatron.dpp.slack_measurement import IterationRecord, saved_tensor_bytes


class _AccumulatingLinear(torch.autograd.Function):
    """x @ w^T whose backward adds w's gradient into w.main_grad, as the fused
    weight-gradient accumulation does."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        weight.main_grad += grad.t() @ x
        return grad @ weight, None


def _model():
    torch.manual_seed(0)
    first = torch.nn.Parameter(torch.randn(64, 32))
    first.main_grad = torch.zeros_like(first)
    second = torch.nn.Parameter(torch.randn(16, 64))
    return first, second


def _forward(x, first, second):
    hidden = torch.nn.functional.gelu(_AccumulatingLinear.apply(torch.relu(x * 2), first))
    return torch.nn.functional.layer_norm(hidden, (64,)) @ second.t()


def test_the_graph_walk_counts_what_the_saved_tensor_hooks_see():
    first, second = _model()
    x = torch.randn(8, 32, requires_grad=True)
    parameters = {first.untyped_storage().data_ptr(), second.untyped_storage().data_ptr()}
    packed, seen = [], set()

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in parameters and pointer not in seen and tensor.dim() > 0:
            seen.add(pointer)
            packed.append(tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _forward(x, first, second)
    output = _forward(x, first, second)
    walked = saved_tensor_bytes(output.grad_fn, parameters)
    # a zero-dimensional scalar the multiplication keeps is the only difference (8 bytes)
    assert sum(packed) > 8 * 32 * 4 and 0 <= walked - sum(packed) <= 8
    # parameters counted too when not left out: exactly their storages more
    everything = saved_tensor_bytes(output.grad_fn, set())
    assert everything - walked == first.untyped_storage().nbytes() + \
        second.untyped_storage().nbytes()


def test_a_measured_forward_keeps_main_grad_reachable_and_is_counted_after_its_time():
    first, second = _model()
    record = IterationRecord()
    x = torch.randn(8, 32, requires_grad=True)
    with record.timed(Task(FORWARD, 0, 0), torch.device("cpu")):
        with record.saving([first, second], torch.device("cpu")) as saving:
            output = _forward(x, first, second)
            saving.keep(output)
        assert record.saved_bytes == []  # counted once the task's time is taken
    assert len(record.saved_bytes) == 1 and record.saved_bytes[0] > 8 * 32 * 4
    output.sum().backward()
    assert first.main_grad.abs().sum() > 0 and second.grad is not None
    # a second graph after the backward freed the first: each forward counted alone
    with record.timed(Task(FORWARD, 0, 1), torch.device("cpu")):
        with record.saving([first, second], torch.device("cpu")) as saving:
            saving.keep(_forward(x, first, second))
    assert record.saved_bytes[1] == record.saved_bytes[0]
