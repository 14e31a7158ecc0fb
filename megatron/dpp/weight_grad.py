"""The backward split of zero-bubble pipelining: B (input gradients) now, W (weight gradients)
later, in a task of its own.

megatron-core's linear layers (ColumnParallelLinear, RowParallelLinear, the output layer)
and the project's fused ones (fused_layers.py) end their backward, when the
gradient-accumulation fusion is on, with one call
`fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32/fp16(total_input, grad_output,
main_grad)`: the weight-gradient GEMM, accumulating into the fp32 main_grad. While a
backward runs inside `WeightGradStore.deferring(key)` that module is swapped for one that
records the call (the GEMM is not run) under `key`; `run(key)` performs them later. The
input gradient, the placeholder weight gradient that DDP's hook skips
(`grad_added_to_main_grad`) and the tensor-parallel communication of B are megatron-core's,
untouched.

What stays in B: bias and layer-norm gradients (a reduction over tokens, cheap, and they
reach main_grad through DDP's hook as usual), the word embedding's gradient (rows scattered
into main_grad or autograd's gradient; memory-bound and small), and whatever a layer
computes without the fusion path (Transformer Engine's layers are refused for that reason).

What a deferred microbatch holds until its W, per deferred linear: its input as the
weight-gradient GEMM reads it and the gradient of its output. For a GPT layer with
tensor-parallel size t, T tokens and hidden size h that is T·h·(4 + 12/t) elements (inputs
T·h·(2 + 5/t), output gradients T·h·(2 + 7/t)); the output layer adds T·h plus the logits'
gradient T·V/t. `held_bytes` counts it.

Sequence parallelism: megatron-core's backward all-gathers the layer's input again for its
weight gradient, into a buffer shared by all layers (the next layer's gather overwrites
it). The store keeps a copy of the gathered input rather than gathering once more in W:
per GPT layer that holds the qkv and fc1 inputs whole, 2·T·h elements, where the local
slices autograd keeps are 2·T·h/t; re-gathering instead would cost W two all-gathers of
T·h per layer, tie every W to its tensor-parallel peers (a bubble filler that waits for
them), and waste the gather megatron-core's B does anyway.

Data parallelism (megatron-core DDP): the per-parameter hooks run during B, when the
placeholder gradient arrives; with --overlap-grad-reduce the chunk's last B would start the
reduction before its Ws have accumulated. `begin_iteration(config, ...)` takes the
schedule's hooks from the TransformerConfig: every B runs under the chunk's
`config.no_sync_func`, and after the chunk's last W the store calls its
`config.grad_sync_func` (set only with --overlap-grad-reduce; without it
finalize_model_grads reduces synchronously, after every W).

The order of the sums: a W's GEMM accumulates into main_grad in place, so W tasks run in
another order sum the same gradients in another order, and their last bits differ. A
store made with `any_weight_order=True` lets the W tasks run in any order and still sums in
one: each GEMM writes into a zeroed buffer of its own, and the buffers are added to
main_grad in the order the chunk's B tasks ran (which the schedule keeps whatever the W
order), each as soon as every earlier one is in. It costs a weight-sized buffer per deferred
linear for each W that runs ahead of an earlier one, and an addition per GEMM: the DPP rule
uses it where the host times each B (CPU), to order the W tasks by it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Callable, Hashable, Iterator

import torch
from megatron.core import parallel_state

from megatron.dpp.compat import core_internals


class WeightGradError(RuntimeError):
    """A B / W ordering the split cannot honour (W before B, twice, or never)."""


@dataclasses.dataclass
class _Accumulation:
    """One deferred `main_grad += grad_output^T @ total_input`."""

    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    total_input: torch.Tensor
    grad_output: torch.Tensor
    main_grad: torch.Tensor

    def __call__(self) -> None:
        self.kernel(self.total_input, self.grad_output, self.main_grad)

    def into_buffer(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The GEMM into a zeroed buffer of main_grad's shape: (main_grad, buffer)."""
        buffer = torch.zeros_like(self.main_grad)
        self.kernel(self.total_input, self.grad_output, buffer)
        return self.main_grad, buffer

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.total_input, self.grad_output


class _RecordingKernels:
    """Stands in for fused_weight_gradient_mlp_cuda: hands each call to `collect`."""

    def __init__(self, kernels, collect: Callable[[_Accumulation], None]):
        self._kernels, self._collect = kernels, collect

    def wgrad_gemm_accum_fp32(self, total_input, grad_output, main_grad):
        self._collect(_Accumulation(self._kernels.wgrad_gemm_accum_fp32,
                                    _owned(total_input), grad_output, main_grad))

    def wgrad_gemm_accum_fp16(self, total_input, grad_output, main_grad):
        self._collect(_Accumulation(self._kernels.wgrad_gemm_accum_fp16,
                                    _owned(total_input), grad_output, main_grad))


def _owned(total_input: torch.Tensor) -> torch.Tensor:
    """The input itself, or a copy where it lives in megatron-core's shared gather buffer
    (sequence parallelism), which the next layer's backward overwrites."""
    try:
        shared = parallel_state.get_global_memory_buffer().buffer.values()
    except AssertionError:  # megatron-core's groups are not set up: nothing is shared
        return total_input
    storage = total_input.untyped_storage().data_ptr()
    if any(buffer.untyped_storage().data_ptr() == storage for buffer in shared):
        return total_input.clone()
    return total_input


@contextlib.contextmanager
def weight_grads_deferred(collect: Callable[[Callable[[], None]], None]) -> Iterator[None]:
    """While open, the linear layers' weight-gradient accumulations are not run but handed
    to `collect` as callables that run them. Needs the gradient-accumulation fusion path:
    `megatron.dpp.weight_grad_accumulation.weight_grad_accumulation_fusion()` (or apex)
    installed."""
    owner, name = core_internals.WGRAD_KERNELS.owner_and_name()
    kernels = getattr(owner, name, None)
    if kernels is None:
        raise WeightGradError(
            "deferring weight gradients needs the gradient-accumulation fusion path "
            "(megatron.dpp.weight_grad_accumulation.weight_grad_accumulation_fusion() or apex's "
            f"{name}); neither is installed")
    if isinstance(kernels, _RecordingKernels):
        raise WeightGradError("weight gradients are already being deferred (nested deferral)")
    with core_internals.WGRAD_KERNELS.swapped(_RecordingKernels(kernels, collect)):
        yield


@dataclasses.dataclass
class _Iteration:
    num_chunks: int
    num_microbatches: int
    no_sync: list[Callable] | None
    grad_sync: list[Callable] | None
    weight_grads_run: list[int]
    # any_weight_order: per chunk the keys whose sums are not all in, in B order, and the
    # (main_grad, buffer) pairs of each key waiting to be added
    unsummed: list[collections.deque] = dataclasses.field(default_factory=list)
    buffers: dict[Hashable, list[tuple[torch.Tensor, torch.Tensor]]] = dataclasses.field(
        default_factory=dict)


def _per_chunk(funcs, num_chunks: int, name: str) -> list[Callable] | None:
    if funcs is None:
        return None
    if not isinstance(funcs, (list, tuple)):
        return [funcs] * num_chunks
    if len(funcs) != num_chunks:
        raise ValueError(f"config.{name} has {len(funcs)} entries for {num_chunks} chunks")
    return list(funcs)


class WeightGradStore:
    """Deferred weight-gradient work of one schedule, by key (chunk, microbatch).

    Per iteration: `begin_iteration`; per microbatch a B (`with store.deferring(key):` around
    the backward) and later its W (`store.run(key)`, or in parts: `store.run(key, parts)`
    that many times); `end_iteration` before the gradient reduction is finished and the
    optimizer steps. `any_weight_order`: main_grad's sums follow the B order whatever order
    the W tasks run in (the module docstring).
    """

    def __init__(self, any_weight_order: bool = False):
        self.any_weight_order = any_weight_order
        self._work: dict[Hashable, list[Callable[[], None] | None]] = {}
        self._parts_run: dict[Hashable, int] = {}  # keys whose W ran in part
        self._done: set[Hashable] = set()
        self._active: Hashable | None = None
        self._iteration: _Iteration | None = None

    def begin_iteration(self, config, num_chunks: int, num_microbatches: int) -> None:
        """Start an iteration of `num_microbatches` per chunk with megatron-core's schedule
        hooks from `config` (a TransformerConfig): no_sync_func, grad_sync_func."""
        if self._work:
            raise WeightGradError(f"a new iteration began with the W of {self.pending()} "
                                  "not run")
        if not getattr(config, "gradient_accumulation_fusion", False):
            raise WeightGradError(
                "the model was built without gradient_accumulation_fusion: its linear layers "
                "compute weight gradients in B and there is nothing to defer (build it with "
                "the fusion on; --dpp-split-backward does that)")
        self._done.clear()
        self._iteration = _Iteration(
            num_chunks, num_microbatches,
            _per_chunk(config.no_sync_func, num_chunks, "no_sync_func"),
            _per_chunk(config.grad_sync_func, num_chunks, "grad_sync_func"),
            [0] * num_chunks, [collections.deque() for _ in range(num_chunks)])

    @contextlib.contextmanager
    def deferring(self, key: tuple[int, int]) -> Iterator[None]:
        """Around the backward (B) of `key` = (chunk, microbatch): weight gradients are
        recorded for `run(key)`, DDP's reduction stays off for the chunk."""
        iteration = self._iteration
        if iteration is None:
            raise WeightGradError(f"B of {key}: begin_iteration() was not called")
        chunk, microbatch = key
        if not (0 <= chunk < iteration.num_chunks
                and 0 <= microbatch < iteration.num_microbatches):
            raise WeightGradError(f"B of {key}: outside {iteration.num_chunks} chunk(s) x "
                                  f"{iteration.num_microbatches} microbatches")
        if self._active is not None:
            raise WeightGradError(f"B of {key} began inside the B of {self._active}")
        if key in self._work or key in self._done:
            raise WeightGradError(f"B of {key} ran twice in one iteration")
        work: list[Callable[[], None]] = []
        self._work[key] = work
        self._active = key
        if self.any_weight_order:
            iteration.unsummed[chunk].append(key)
            iteration.buffers[key] = []
        no_sync = iteration.no_sync[chunk]() if iteration.no_sync else contextlib.nullcontext()
        try:
            with no_sync, weight_grads_deferred(work.append):
                yield
        finally:
            self._active = None

    def allow_any_weight_order(self) -> None:
        """From the next iteration on, sum main_grad in B order whatever order the W tasks
        run in (the module docstring)."""
        if self._iteration is not None:
            raise WeightGradError("the order of the weight-gradient sums changes between "
                                  "iterations only")
        self.any_weight_order = True

    @property
    def is_deferring(self) -> bool:
        return self._active is not None

    def defer(self, work: Callable[[], None]) -> None:
        """Add W work to the B being deferred (the CUDA-graph blocks' weight-gradient graph
        replay)."""
        if self._active is None:
            raise WeightGradError("defer() outside a deferring() backward")
        if self.any_weight_order:
            raise WeightGradError("a store that sums in B order whatever the W order takes the "
                                  "linear layers' GEMMs only, not graphed W work")
        self._work[self._active].append(work)

    def run(self, key: tuple[int, int], parts: int = 1) -> bool:
        """The W of `key`: its deferred weight-gradient work, in the order B recorded it;
        with `parts` = n, the next n-th of it (the k-th call runs items [k L / n, (k + 1) L
        / n) of the L recorded, and frees what they held). True when the W is complete.
        After the chunk's last W, its gradient reduction starts (config.grad_sync_func)."""
        if key == self._active:
            raise WeightGradError(f"W of {key} inside its own B")
        work = self._work.get(key)
        if work is None:
            if key in self._done:
                raise WeightGradError(f"W of {key} ran twice")
            raise WeightGradError(f"W of {key} before its B")
        if parts < 1:
            raise WeightGradError(f"W of {key} in {parts} parts")
        part = self._parts_run.get(key, 0)
        first, end = len(work) * part // parts, len(work) * (part + 1) // parts
        iteration = self._iteration
        chunk = key[0]
        with torch.no_grad():  # as inside backward: the saved inputs may require grad
            for index in range(first, end):
                if self.any_weight_order:
                    iteration.buffers[key].append(work[index].into_buffer())
                else:
                    work[index]()
                work[index] = None
        complete = part + 1 == parts
        if complete:
            self._parts_run.pop(key, None)
            del self._work[key]
            self._done.add(key)
        else:
            self._parts_run[key] = part + 1
        if self.any_weight_order:
            self._add_buffers(iteration.unsummed[chunk], iteration.buffers)
        if not complete:
            return False
        iteration.weight_grads_run[chunk] += 1
        if (iteration.weight_grads_run[chunk] == iteration.num_microbatches
                and iteration.grad_sync is not None):
            iteration.grad_sync[chunk]()
        return True

    def _add_buffers(self, unsummed: collections.deque, buffers: dict) -> None:
        """Adds the waiting buffers to main_grad in B order: the first key's as they come,
        a later key's once every earlier key's W is complete."""
        while unsummed:
            first = unsummed[0]
            with torch.no_grad():
                for main_grad, buffer in buffers[first]:
                    main_grad.add_(buffer)
            buffers[first].clear()
            if first not in self._done:
                return
            unsummed.popleft()
            del buffers[first]

    def pending(self) -> list[tuple[int, int]]:
        """Keys whose B ran and whose W has not."""
        return sorted(self._work)

    def held_bytes(self, key: tuple[int, int] | None = None) -> int:
        """Bytes of the tensors the deferred linear layers keep for W (of `key`, or of all
        pending keys), and the buffers of W tasks that ran ahead of an earlier one
        (`any_weight_order`); each storage counted once. A CUDA-graph block's W holds its
        slot's memory pool instead, which is not counted here."""
        keys = [key] if key is not None else list(self._work)
        storages = {}
        for item in itertools.chain.from_iterable(self._work.get(k, ()) for k in keys):
            if isinstance(item, _Accumulation):
                for tensor in item.tensors():
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        waiting = {} if self._iteration is None else self._iteration.buffers
        for k in (waiting if key is None else [key]):  # W buffers not yet added
            for _, buffer in waiting.get(k, ()):
                storage = buffer.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def end_iteration(self) -> None:
        """Every W ran (call before the gradient reduction is finished / the optimizer
        steps); raises naming the keys still pending."""
        if self._active is not None:
            raise WeightGradError(f"end_iteration() inside the B of {self._active}")
        if self._work:
            raise WeightGradError(f"the W of {self.pending()} did not run before the "
                                  "gradient reduction")
        self._done.clear()
        self._iteration = None


class SplitBackwardNoPipelining:
    """megatron-core's schedule without pipelining, each backward split into its B and, right
    after it, its W. There is no bubble to fill at PP=1: this measures what the split
    itself costs (--dpp-split-backward at --pipeline-model-parallel-size 1)."""

    def __init__(self, store: WeightGradStore):
        self.store = store

    def __call__(self, *, model, num_microbatches: int, forward_only: bool = False, **kwargs):
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.utils import get_model_config

        chunks = model if isinstance(model, list) else [model]
        if forward_only:
            return schedules.forward_backward_no_pipelining(
                model=model, num_microbatches=num_microbatches, forward_only=True, **kwargs)
        self.store.begin_iteration(get_model_config(chunks[0]), len(chunks), num_microbatches)
        backward_step = schedules.backward_step
        microbatches = itertools.count()

        @functools.wraps(backward_step)
        def split_backward_step(*args, **step_kwargs):
            key = (0, next(microbatches))
            with self.store.deferring(key):
                input_grad = backward_step(*args, **step_kwargs)
            self.store.run(key)
            return input_grad

        # the schedule calls its module's backward_step for each microbatch
        with core_internals.BACKWARD_STEP.swapped(split_backward_step):
            losses = schedules.forward_backward_no_pipelining(
                model=model, num_microbatches=num_microbatches, forward_only=False, **kwargs)
        self.store.end_iteration()
        return losses
