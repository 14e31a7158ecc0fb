"""CUDA graphs of each model chunk's transformer block, one graph pair per microbatch slot.

The step of a GPT on our GPUs is launch-bound: the host needs longer to issue a layer's
kernels through megatron-core's Python modules than the GPU needs to run them
(docs/benchmarks/gpu_mfu_h200_2026-11-22.md). Replaying a recorded graph issues a whole
block's kernels in one call.

megatron-core's own CUDA graphs (`--cuda-graph-impl local`) record one graph per
microbatch in the order of its static schedule; the DPP schedule runs microbatches in an
order known only at run time. Here each block keeps slots instead: a forward takes a free
slot (recording a new one when all are taken), the microbatch's backward replays that
slot's backward graph and frees it. Any schedule that runs each microbatch's backward after
its forward works, and the number of slots is the most microbatches it ever has in flight.

With variable lengths a slot holds one graph pair per shape (graph_slots.py: a lane per
microbatch in flight, every length bucket, and with a token budget every row count, recorded
by the end of the step that made the lane), within a memory budget past which a shape runs
eagerly.

Each lane records into its own memory pool, so a microbatch's saved activations are never
shared with another in flight; the shapes of one lane share its pool (one of them in flight). Its backward graph adds the weight gradients into megatron-core DDP's
`main_grad` buffers itself (what DDP's per-parameter hooks do eagerly; with the
gradient-accumulation fusion the linear layers' GEMMs do it), so parameters are not inputs
of the replay and no per-parameter hook runs for the block.

With --dpp-split-backward a slot records B (input, bias and layer-norm gradients) with the
linear layers' weight-gradient GEMMs deferred, and W, those GEMMs, as `weight_parts` graphs
of consecutive GEMMs: the schedule runs a W in that many parts and decides between them, so
an F or B that arrives while a filler W runs waits for one part, not the whole W. A backward
inside `WeightGradStore.deferring` replays B and leaves the W parts (the last one frees the
slot) to the store: the slot's saved inputs and recorded output gradients must stay until
W, so the slot is not free before it. Any other backward replays all of them. Graphing W
rather than running its GEMMs eagerly keeps each part one launch, as B is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_block import TransformerBlock

from megatron.dpp.weight_grad import WeightGradStore, weight_grads_deferred
from megatron.trainer.data.microbatches import shapes_by_length
from megatron.trainer.model.graph_slots import GraphMemoryBudget, ShapeSlots, SlotLeak

log = logging.getLogger(__name__)


class CudaGraphError(RuntimeError):
    pass


@dataclasses.dataclass
class _Slot:
    """One microbatch's recorded forward and backward of a block, and their buffers."""

    input: torch.Tensor
    output: torch.Tensor
    grad_output: torch.Tensor
    grad_input: torch.Tensor
    forward_graph: torch.cuda.CUDAGraph
    backward_graph: torch.cuda.CUDAGraph
    # the deferred weight gradients in parts (B/W split; empty without it)
    weight_graphs: list[torch.cuda.CUDAGraph]


class _ReplayBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graphs, slot, hidden_states):
        slot.input.copy_(hidden_states)
        slot.forward_graph.replay()
        ctx.graphs, ctx.slot = graphs, slot
        # a new tensor object: the schedules may replace its .data after sending it
        return slot.output.detach()

    @staticmethod
    def backward(ctx, grad_output):
        slot = ctx.slot
        slot.grad_output.copy_(grad_output)
        slot.backward_graph.replay()
        graphs = ctx.graphs
        if not slot.weight_graphs:
            graphs.release(slot)
        elif graphs.weight_grads.is_deferring:
            for part in range(len(slot.weight_graphs)):
                graphs.weight_grads.defer(functools.partial(graphs.weight_part, slot, part))
        else:
            for part in range(len(slot.weight_graphs)):
                graphs.weight_part(slot, part)
        # the slot's next forward may reuse this memory while the gradient is still in a send
        return None, None, slot.grad_input.clone()


class BlockGraphs:
    """Replaces one TransformerBlock's forward by slot replays where the call allows it."""

    def __init__(self, block: TransformerBlock, shape: tuple[int, ...], dtype: torch.dtype,
                 weight_grads: WeightGradStore | None = None, weight_parts: int = 1,
                 lengths_vary: bool = False, budget: GraphMemoryBudget | None = None,
                 warm_shapes: tuple[tuple[int, ...], ...] = ()):
        """`shape`: the block input [s, b, h] replayed; with `lengths_vary`, any sequence
        length up to s (and any micro-batch rows: a token budget varies them) is, a graph
        pair per shape and lane, all within `budget`; `warm_shapes` are recorded into each
        lane by the end of the step that made it (`record_warm`)."""
        if weight_parts < 1:
            raise CudaGraphError(f"weight_parts must be >= 1, got {weight_parts}")
        self.block = block
        self.weight_grads = weight_grads
        self.weight_parts = weight_parts
        self.shape, self.dtype = torch.Size(shape), dtype
        self.lengths_vary = lengths_vary
        self.eager_forward = block.forward
        # replays read the parameters' storage: updates must stay in place (megatron-core's
        # optimizers and checkpoint loading copy into it)
        self.named_params = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
        missing = [n for n, p in self.named_params if getattr(p, "main_grad", None) is None]
        if missing:
            raise CudaGraphError("--cuda-graph-impl block needs megatron-core DDP's main_grad "
                                 f"buffers; the block's {missing[0]} has none")
        self.slots = ShapeSlots(self._record, budget, torch.cuda.graph_pool_handle,
                                warm_shapes if lengths_vary else ())
        # every recording on one stream: the caching allocator reuses a pool's free blocks
        # only for the stream that freed them, so a capture on a fresh stream would not
        # reuse the memory that the lane's earlier recordings freed
        self._capture_stream: torch.cuda.Stream | None = None

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        block = self.block
        x = hidden_states if block.pre_process else block.input_tensor
        slot = None
        if self._replayable(x, attention_mask, args, kwargs):
            try:
                slot = self.slots.acquire(x)
            except SlotLeak as leak:
                raise CudaGraphError(str(leak)) from None
        if slot is None:  # not a graphed pass, or a shape beyond the memory limit
            return self.eager_forward(hidden_states, attention_mask, *args, **kwargs)
        return _ReplayBlock.apply(self, slot, x)

    def release(self, slot: _Slot) -> None:
        self.slots.release(slot.input.shape, slot)

    def record_warm(self) -> int:
        """Between steps: record the bucket shapes its lanes miss (graph_slots.py)."""
        return self.slots.record_warm()

    def weight_part(self, slot: _Slot, part: int) -> None:
        """Part `part` of the slot's W (its share of the weight-gradient GEMMs); after the
        last part the slot is free again."""
        slot.weight_graphs[part].replay()
        if part == len(slot.weight_graphs) - 1:
            self.release(slot)

    def _replayable(self, x, attention_mask, args, kwargs) -> bool:
        # training passes of the configured shape, with nothing but the hidden states
        return (
            torch.is_grad_enabled()
            and self.block.training
            and isinstance(x, torch.Tensor)  # not an inference WrappedTensor
            and self._shape_replayable(x.shape)
            and x.dtype == self.dtype
            and x.requires_grad
            and attention_mask is None
            and not args
            and all(value is None for value in kwargs.values())
        )

    def _shape_replayable(self, shape: torch.Size) -> bool:
        if not self.lengths_vary:
            return shape == self.shape
        return (len(shape) == 3 and shape[2] == self.shape[2]
                and 0 < shape[0] <= self.shape[0] and shape[1] > 0)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        block = self.block
        if block.pre_process:
            return self.eager_forward(x, None)
        saved = block.input_tensor
        block.set_input_tensor(x)
        try:
            return self.eager_forward(None, None)
        finally:
            block.set_input_tensor(saved)

    def _record(self, shape: tuple[int, ...], pool, lane: int) -> tuple[_Slot, int]:
        """A new slot for inputs of `shape` recorded into the lane's `pool`, and the bytes
        its recording added to the pool. The recording reads zeros: graphs hold no data."""
        device = torch.device("cuda", torch.cuda.current_device())
        sample = torch.zeros(shape, dtype=self.dtype, device=device)
        with _generators_restored(), _collector_paused():
            slot, added = self._record_slot(sample, pool)
        log.info("CUDA graphs: recorded lane %d's slot of a %d-layer block for shape %s "
                 "(%.0f MiB more)", lane, len(self.block.layers), shape, added / (1 << 20))
        return slot, added

    def _record_slot(self, sample: torch.Tensor, pool) -> tuple[_Slot, int]:
        """The slot and what the caching allocator reserved during its captures: the pool's
        growth (the eager warm-up pass before them reserves memory the eager steps reuse)."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream()
        side = self._capture_stream
        side.wait_stream(torch.cuda.current_stream())
        forward_graph, backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            # the autograd engine syncs with the stream each leaf was first used on; DDP's
            # parameters were first used on the default stream, which no capture may
            # touch, so the block records with fresh leaves sharing their storage
            static_input = sample.detach().clone().requires_grad_(True)
            aliases = {name: _alias(p) for name, p in self.named_params}
            with _parameters_replaced(self.block, aliases):
                # lazy initialisation (cuBLAS workspaces, torch.compile'd fusions) stays
                # out of the graphs; this pass's gradients are zero
                warm = self._run(static_input)
                torch.autograd.grad(warm, (static_input, *aliases.values()),
                                    torch.zeros_like(warm), allow_unused=True)
                del warm
                # weights whose linear layer adds its gradient to main_grad itself
                # (gradient-accumulation fusion) marked themselves; the rest are added here
                added_here = [(aliases[name], param) for name, param in self.named_params
                              if not aliases[name].grad_added_to_main_grad]
                inputs = (static_input, *(alias for alias, _ in added_here))
                before = torch.cuda.memory_reserved(sample.device)
                with _capture(forward_graph, pool):
                    output = self._run(static_input)
                grad_output = torch.empty_like(output)
                # B/W split: the weight-gradient GEMMs are recorded, not captured, in B
                deferred: list = []
                split = (contextlib.nullcontext() if self.weight_grads is None
                         else weight_grads_deferred(deferred.append))
                with _capture(backward_graph, pool), split:
                    grads = torch.autograd.grad(output, inputs, grad_output, allow_unused=True)
                    _accumulate_into_main_grads(
                        [(param.main_grad, grad) for (_, param), grad
                         in zip(added_here, grads[1:], strict=True) if grad is not None])
                weight_graphs = []
                if self.weight_grads is not None:
                    # in the slot's pool: the tensors W reads were kept alive through B's
                    # capture, so no allocation of B aliases them
                    for group in split_evenly(deferred, self.weight_parts):
                        graph = torch.cuda.CUDAGraph()
                        with _capture(graph, pool), torch.no_grad():
                            for work in group:
                                work()
                        weight_graphs.append(graph)
                del deferred, split
                added = max(0, torch.cuda.memory_reserved(sample.device) - before)
        torch.cuda.current_stream().wait_stream(side)
        slot = _Slot(static_input, output.detach(), grad_output, grads[0],
                     forward_graph, backward_graph, weight_graphs)
        del grads, output
        return slot, added


def split_evenly(items: list, parts: int) -> list[list]:
    """`items` in `parts` consecutive groups whose sizes differ by at most one, none empty
    (fewer groups when there are fewer items)."""
    parts = max(1, min(parts, len(items)))
    return [items[len(items) * k // parts:len(items) * (k + 1) // parts] for k in range(parts)]


def _accumulate_into_main_grads(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """main_grad += grad for every (main_grad, grad): the biases and norms of a block, a few
    thousand elements each. One add kernel per tensor cost ~6 us each (8 per GPT layer, 18 ms
    per iteration of the GPT of GPU.md); instead the gradients are gathered into one tensor,
    widened once, and added by a multi-tensor kernel. Each element's sum is the same fp32
    addition as the per-tensor add."""
    by_dtype: dict[torch.dtype, list] = {}
    for main, grad in pairs:
        by_dtype.setdefault(main.dtype, []).append((main, grad))
    for dtype, group in by_dtype.items():
        mains = [main for main, _ in group]
        flat = torch.cat([grad.reshape(-1) for _, grad in group]).to(dtype)
        parts = flat.split([main.numel() for main in mains])
        torch._foreach_add_(mains, [part.view_as(main) for part, main in zip(parts, mains,
                                                                             strict=True)])


@contextlib.contextmanager
def _generators_restored():
    """The warm-up pass of a recording draws dropout masks; afterwards the generators are
    where they were, so the first replay draws what the eager forward would (a replay reads
    the generator's seed and offset when it is launched; the capture itself draws none)."""
    state = torch.cuda.get_rng_state()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker_states = tracker.get_states()
    try:
        yield
    finally:
        torch.cuda.set_rng_state(state)
        tracker.set_states(tracker_states)


def _alias(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """A new leaf on the parameter's storage, with the attributes megatron-core's linear
    layers read in backward."""
    alias = torch.nn.Parameter(param.detach())
    alias.main_grad = param.main_grad
    alias.grad_added_to_main_grad = False
    return alias


@contextlib.contextmanager
def _parameters_replaced(module: torch.nn.Module, replacements: dict[str, torch.nn.Parameter]):
    saved = []
    for name, replacement in replacements.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        saved.append((owner, leaf, owner._parameters[leaf]))
        owner._parameters[leaf] = replacement
    try:
        yield
    finally:
        for owner, leaf, original in saved:
            owner._parameters[leaf] = original


@contextlib.contextmanager
def _collector_paused():
    """As torch.cuda.graph does, unreachable objects are collected first and the collector
    stays off while recording: a CUDA graph collected then frees its memory pool, and a
    cudaFree invalidates a capture. Once per slot, not per capture: a collection of a
    trainer's heap takes tens of milliseconds and a slot has 2 + W-part captures."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@contextlib.contextmanager
def _capture(graph: torch.cuda.CUDAGraph, pool):
    """Record the current (side) stream's work into `graph` (inside _collector_paused).
    Unlike torch.cuda.graph, no device-wide synchronize first: a stage may have receives
    pending that only its peer, itself possibly recording, can complete."""
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        yield
    finally:
        graph.capture_end()


def install_block_graphs(model_chunks, configs, device: torch.device,
                         weight_grads: WeightGradStore | None = None,
                         weight_parts: int = 1) -> list[BlockGraphs]:
    """Give every chunk's transformer block slot-recorded CUDA graphs (B and W apart when
    `weight_grads`, the schedule's store, is given, W in `weight_parts` graphs); with
    variable lengths one set of slots per shape, all the rank's within
    --cuda-graph-memory-limit."""
    if device.type != "cuda":
        raise CudaGraphError("--cuda-graph-impl block needs a CUDA device; this run is on "
                             f"{device.type}")
    model, precision, data = configs.model, configs.precision, configs.data
    shape = (model.seq_length, configs.schedule.micro_batch_size, model.hidden_size)
    dtype = (torch.bfloat16 if precision.bf16 else torch.float16 if precision.fp16
             else torch.float32)
    lengths_vary = data.variable_seq_lengths or data.seq_length_cv > 0
    warm_shapes = bucket_shapes(configs) if lengths_vary else ()
    limit = configs.fast_path.cuda_graph_memory_limit
    budget = GraphMemoryBudget(None if limit is None else int(limit * (1 << 30)))
    installed = []
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, TransformerBlock) and len(module.layers) > 0:
                graphs = BlockGraphs(module, shape, dtype, weight_grads, weight_parts,
                                     lengths_vary, budget, warm_shapes)
                module.forward = graphs.forward
                installed.append(graphs)
    return installed


def bucket_shapes(configs) -> tuple[tuple[int, ...], ...]:
    """The block input shapes [s, b, h] a run of variable lengths can meet, when they are
    known in advance (microbatches.shapes_by_length: every multiple of --pad-to-multiple up
    to --seq-length, at --micro-batch-size rows or at every row count a token budget
    allows); sequence parallelism splits s. Empty where they are more than MAX_WARM_SHAPES."""
    model, schedule, parallel = configs.model, configs.schedule, configs.parallel
    rows_by_length = shapes_by_length(
        model.seq_length, configs.data.pad_to_multiple or 1, schedule.micro_batch_size,
        configs.data.microbatch_tokens, schedule.global_batch_size // parallel.data_parallel_size)
    if rows_by_length is None:
        return ()
    split = parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1
    return tuple((length // split, rows, model.hidden_size)
                 for length, all_rows in rows_by_length.items() for rows in all_rows)
