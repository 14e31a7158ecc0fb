"""DppSchedule: the dynamic pipeline schedule, a drop-in for the function megatron.core's
get_forward_backward_func() returns.

Each stage asks the policy (megatron/dpp/policy.py) for its next action among those whose
inputs have arrived, runs it with megatron.core's own forward_step / backward_step, and
sends the result to the rank the topology (megatron/dpp/topology.py) names, through the
mailbox transport. Nothing ready: it blocks on the inbox. The order it ran is kept as
data (`executed`) and, under --trace, written beside the trace.

With a WeightGradStore (--dpp-split-backward) every backward is a B, run with the linear
layers' weight-gradient GEMMs deferred, and a W task that runs them
(megatron/dpp/weight_grad.py); the policy places the W tasks. Where no GPU runs the tasks
later (CPU) the host times each B and the rule runs the pending W whose B was shortest; the
store then sums the weight gradients in B order, so that order leaves no trace in them.

With `DppOptions.adaptive` the first training calls run at slack 0 and measure the task
times, the message times and the activations (megatron/dpp/slack_measurement.py); every
later call runs the slack chosen from them.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor, forward_step
from megatron.core.utils import get_model_config

from megatron.dpp.actions import BACKWARD, FORWARD, KINDS, WEIGHT, Task
from megatron.dpp.compat import core_internals
from megatron.dpp.config import DppOptions
from megatron.dpp.gpu_queue import (
    QUEUE_AHEAD,
    SIMULATED_TASK_ENV,
    GpuQueue,
    SimulatedDevice,
    cuda_marker,
)
from megatron.dpp.output_weight_grad import DeferredOutputWeightGrads
from megatron.dpp.plan import StageConfig
from megatron.dpp.policy import GreedyPolicy, microbatch_order_for
from megatron.dpp.slack_measurement import IterationRecord, PipelineShape, SlackAdapter
from megatron.dpp.topology import PipelineTopology
from megatron.dpp.tracing import NullTracer
from megatron.dpp.transport.channel import MessageKey, MessageKind
from megatron.dpp.transport.emulation import StragglingTasks
from megatron.dpp.transport.pipeline import PipelineTransport
from megatron.dpp.variability import Emulation
from megatron.dpp.weight_grad import WeightGradStore


class _TaskCoordinator:
    """Tensor-parallel ranks of one stage must run the same task sequence: rank 0 of the
    tensor-parallel group decides, the others follow through a tiny broadcast."""

    def __init__(self):
        self.group = None
        self.leader = None
        tp_ranks = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
        if len(tp_ranks) == 1:
            return
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, tuple(tp_ranks))
        for ranks in sorted(set(gathered)):
            group = dist.new_group(list(ranks), backend="gloo")
            if dist.get_rank() in ranks:
                self.group, self.leader = group, ranks[0]

    @property
    def deciding(self) -> bool:
        return self.group is None or dist.get_rank() == self.leader

    def share(self, task: Task | None) -> Task:
        if self.group is None:
            return task
        message = torch.zeros(3, dtype=torch.int64)
        if task is not None:
            message[:] = torch.tensor([KINDS.index(task.kind), task.chunk, task.microbatch])
        dist.broadcast(message, self.leader, group=self.group)
        kind, chunk, microbatch = message.tolist()
        return Task(KINDS[kind], chunk, microbatch)


class DppSchedule:
    """Callable with exactly the keyword arguments of megatron.core's schedule functions;
    keeps its channels open across iterations (`close()` at the end of training).
    `weight_grads`: split every backward into B and W tasks through this store (the one the
    CUDA-graph blocks were given, if any)."""

    def __init__(self, options: DppOptions | None = None,
                 weight_grads: WeightGradStore | None = None, pod: str | None = None,
                 emulation: Emulation | None = None):
        self.options = options or DppOptions()
        self.weight_grads = weight_grads
        self.pod = pod  # this rank's pod (transport/pipeline.py); None: its host
        self.emulation = emulation
        self._transport: PipelineTransport | None = None
        self._stragglers: StragglingTasks | None = None  # W tasks under --emulate-straggler
        self._coordinator: _TaskCoordinator | None = None
        self._gpu_queue: GpuQueue | None = None
        self.tracer = NullTracer()  # the trainer installs a Tracer under --trace
        self._microbatch_costs: list[float] | None = None
        self._cost_order = True
        self._iteration = 0
        self._adapter = (SlackAdapter(self.options.slack, self.options.static,
                                      self.options.budget)
                         if self.options.adaptive else None)

    @property
    def slack(self) -> int | None:
        """The slack the next training call runs: forced, or chosen once measured (None
        while measuring)."""
        if self._adapter is None:
            return self.options.slack
        return None if self._adapter.choice is None else self._adapter.choice.slack

    @property
    def runs_static(self) -> bool:
        """Whether the next call runs the plan in order: given, or chosen once measured."""
        if self._adapter is None:
            return bool(self.options.static)
        return self._adapter.runs_static

    def set_microbatch_costs(self, costs: list[float] | None, reorder: bool = True) -> None:
        """What each microbatch of the next call will cost (its token count), the same list
        on every rank: the policy caps the tokens a stage holds by them and, with
        `reorder`, runs cheap microbatches first and last (policy.choose_cost_order). Used
        by the next call only."""
        self._microbatch_costs = None if costs is None else list(costs)
        self._cost_order = reorder

    def set_iteration(self, iteration: int) -> None:
        """The training iteration of the next calls: each emulated message's delay is drawn
        by it (variability.py), as the simulator draws that iteration's."""
        self._iteration = iteration

    def close(self) -> None:
        if self._gpu_queue is not None:
            self._gpu_queue.close(self.options.timeout)
            self._gpu_queue = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def _open(self, device: torch.device, num_chunks: int) -> None:
        if self._transport is not None:
            return
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        self._pipeline = dist.get_process_group_ranks(pp_group)
        self._transport = PipelineTransport(
            self._pipeline, num_chunks=num_chunks, device=device,
            transport=self.options.transport, timeout=self.options.timeout,
            pod=self.pod, emulation=self.emulation,
        )
        self._coordinator = _TaskCoordinator()
        if self.emulation is not None and self.emulation.straggler is not None:
            self._stragglers = StragglingTasks(
                self.emulation, parallel_state.get_pipeline_model_parallel_rank(), device)
        simulated_ms = float(os.environ.get(SIMULATED_TASK_ENV, "0"))
        if device.type == "cuda":
            self._gpu_queue = GpuQueue(cuda_marker, self._transport.inbox.notify)
        elif simulated_ms > 0:
            self._gpu_queue = GpuQueue(SimulatedDevice(simulated_ms / 1000.0).marker,
                                       self._transport.inbox.notify)
        if self._gpu_queue is None and self.weight_grads is not None:
            # the host times each B: the rule runs the pending W whose B was shortest, and
            # the store keeps the gradient sums in B order whatever order that gives
            self.weight_grads.allow_any_weight_order()

    def __call__(
        self,
        *,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches: int,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn=None,
        p2p_communicator=None,
        pg_collection=None,
        force_all_reduce: bool | None = False,
    ):
        # seq_length, micro_batch_size, decoder_seq_length and adjust_tensor_shapes_fn size
        # megatron's receive buffers; DPP messages carry their own shape and dtype.
        model = model if isinstance(model, list) else [model]
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        if len(iterators) != len(model):
            raise ValueError(f"DppSchedule: {len(model)} model chunks but "
                             f"{len(iterators)} data iterators")
        config = get_model_config(model[0])
        device = next(model[0].parameters()).device
        self._open(device, len(model))
        self._transport.set_iteration(self._iteration)
        if self._stragglers is not None:
            self._stragglers.iteration = self._iteration
        self._transport.barrier()
        costs, self._microbatch_costs = self._microbatch_costs, None
        if costs is not None and len(costs) != num_microbatches:
            raise ValueError(f"DppSchedule: {len(costs)} microbatch costs for "
                             f"{num_microbatches} microbatches")
        slack, record = ((self.options.slack, None) if self._adapter is None
                         else self._adapter.next_call(forward_only))
        if not forward_only:
            self.tracer.note_schedule(slack, self.runs_static)
        run = _Iteration(self, model, iterators, forward_step_func, num_microbatches,
                         config, forward_only, collect_non_loss_data, costs, self._cost_order,
                         slack, record)
        result = run.execute(pg_collection, force_all_reduce)
        if record is not None:
            self._adapter.finished(record, run.shape())
        return result


class _Iteration:
    """One call of the schedule: the task loop and the state it needs."""

    def __init__(self, schedule: DppSchedule, model, iterators, forward_step_func,
                 num_microbatches, config, forward_only, collect_non_loss_data, costs,
                 cost_order=True, slack: int = 0, record: IterationRecord | None = None):
        self.model, self.iterators = model, iterators
        self.forward_step_func = forward_step_func
        self.config, self.forward_only = config, forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.num_microbatches = num_microbatches
        self.transport = schedule._transport
        self.coordinator = schedule._coordinator
        # the tasks queued on this stage's GPU (None: no device to pace, decide at once)
        self.gpu_queue = schedule._gpu_queue
        self.stragglers = schedule._stragglers
        self.tracer = schedule.tracer
        self.pipeline = schedule._pipeline
        self.pp_size = len(self.pipeline)
        self.rank = parallel_state.get_pipeline_model_parallel_rank()
        self.num_chunks = len(model)
        self.topology = PipelineTopology(self.pp_size, self.num_chunks)
        # the B/W split (training only): the store runs each W and starts a chunk's
        # gradient reduction after its last W
        self.weight_grads = None if forward_only else schedule.weight_grads
        self.stage = StageConfig(
            rank=self.rank, pp_size=self.pp_size, num_chunks=self.num_chunks,
            num_microbatches=num_microbatches, slack=slack,
            forward_only=forward_only, split_backward=self.weight_grads is not None,
            defer_weights=schedule.options.defer_weights,
            weight_slices=schedule.options.weight_slices,
            weights_by_backward=(self.weight_grads is not None and self.gpu_queue is None
                                 and self.weight_grads.any_weight_order),
        )
        order = microbatch_order_for(self.stage, costs) if cost_order else None
        self.policy = GreedyPolicy(self.stage, microbatch_order=order, costs=costs,
                                   static=schedule.runs_static)
        self.executed: list[Task] = []  # the actions in the order they ran
        # while the slack is being chosen: this call's measurements
        self.record = record
        self.device = _device(model)
        # inputs the policy found missing at its last look (a timeout names them)
        self._missing: list[MessageKey] = []
        order = self.policy.microbatch_order
        if order != sorted(order):
            # the plan runs microbatch i out of turn: each forward reads batch i
            self.iterators = [None if it is None else _Batches(it, num_microbatches)
                              for it in iterators]
        self.forwards_run = [0] * self.num_chunks
        self.backwards_run = [0] * self.num_chunks
        self.saved: dict[tuple[int, int], tuple] = {}
        self.forward_data_store: list = []
        self.stored_microbatch: list[int] = []  # forward_data_store's entries, by microbatch
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=_device(model))
        self.no_sync = _NoSyncPerChunk(config, self.num_chunks, forward_only)
        self.grad_syncs = (None if forward_only or config.grad_sync_func is None
                           else _per_chunk(config.grad_sync_func, self.num_chunks))
        # --defer-embedding-wgrad-compute: the output layer's weight gradients, by microbatch
        self.output_weight_grads = DeferredOutputWeightGrads.for_stage(
            model, config, self.topology.is_last(self.rank, self.num_chunks - 1))
        if self.output_weight_grads is not None and self.weight_grads is not None:
            raise ValueError("DppSchedule: defer_embedding_wgrad_compute and the B/W split "
                             "both defer the output layer's weight gradient; use one")

    def shape(self) -> PipelineShape:
        return PipelineShape(tuple(self.pipeline), self.rank, self.num_chunks,
                             self.num_microbatches, self.stage.split_backward,
                             self.stage.defer_weights, self.stage.weight_slices,
                             self.device.type == "cpu", self.stage.weights_by_backward)

    def _run(self, task: Task, run) -> bool:
        """Runs the task (timed while measuring); False for a W part that was not its last."""
        with (contextlib.nullcontext() if self.record is None
              else self.record.timed(task, self.device)):
            if task.kind != WEIGHT:
                run[task.kind](task)
                return True
            return self._weight(task)

    def execute(self, pg_collection, force_all_reduce):
        run = {FORWARD: self._forward, BACKWARD: self._backward}
        if self.weight_grads is not None:
            self.weight_grads.begin_iteration(self.config, self.num_chunks,
                                              self.num_microbatches)
        if self.output_weight_grads is not None:
            self.output_weight_grads.begin()
        with self.no_sync:
            for _ in range(self.policy.num_decisions):
                task = self._next()
                started = time.perf_counter()
                if self._run(task, run):  # a W in parts is recorded once, at its last
                    self.executed.append(task)
                # a B's host time orders the pending W tasks where no GPU runs it later
                duration = (time.perf_counter() - started
                            if task.kind == BACKWARD and self.stage.weights_by_backward
                            else None)
                if self.gpu_queue is not None:
                    self.gpu_queue.launched(1.0 / self.stage.weight_slices
                                            if task.kind == WEIGHT else 1.0)
                if self.coordinator.deciding:
                    self.policy.complete(task, duration)
        self.tracer.record_actions(self.rank, self.executed)
        with self.tracer.span("send"):
            self.transport.flush()
        if not self.forward_only:
            if self.weight_grads is not None:
                # every W ran (they are in the plan); the store started each chunk's
                # reduction after its last W
                self.weight_grads.end_iteration()
            if self.output_weight_grads is not None:
                self.output_weight_grads.drain()
            if self.config.finalize_model_grads_func is not None:
                kwargs = {"pg_collection": pg_collection} if pg_collection is not None else {}
                self.config.finalize_model_grads_func(
                    self.model,
                    self.total_num_tokens if self.config.calculate_per_token_loss else None,
                    **kwargs,
                )
        # megatron's schedules return the entries in microbatch order
        order = sorted(range(len(self.stored_microbatch)), key=self.stored_microbatch.__getitem__)
        return [self.forward_data_store[k] for k in order]

    def _next(self) -> Task:
        """The next task, decided at GPU time (megatron/dpp/gpu_queue.py): with the GPU
        still busy only the plan's next task runs, as soon as its input is announced; a
        deviation from the plan waits until the GPU has run dry. Blocks on the inbox (which
        also wakes when a queued task ends) while nothing may run."""
        if not self.coordinator.deciding:
            with self.tracer.span("recv_wait"):
                return self.coordinator.share(None)
        gpu = self.gpu_queue
        if gpu is not None:
            gpu.wait_until(QUEUE_AHEAD)
        inbox = self.transport.inbox
        version = inbox.version
        task = self._ready_task(gpu)
        if task is None:
            if self.record is not None:
                self.record.waiting = True
            with self.tracer.span("recv_wait"):
                while task is None:
                    # a timeout names the inputs the policy looked for, and their peers
                    self.transport.wait(version, self._missing)
                    version = inbox.version
                    task = self._ready_task(gpu)
            if self.record is not None:
                self.record.waiting = False
        return self.coordinator.share(task)

    def _ready_task(self, gpu: GpuQueue | None) -> Task | None:
        self._missing = []
        if gpu is None:  # no device to pace: decide on what has arrived
            return self.policy.next_task(self._arrived)
        # what can start at once on data that has landed (deviating from the plan only once
        # the GPU ran dry, and only by a W part while the planned input is on its way), else
        # the plan's next task queued behind its announced data
        task = self.policy.next_task(self._landed, deviate=gpu.busy() == 0,
                                     arriving=self._announced)
        return task if task is not None else self.policy.next_task(self._arrived,
                                                                    deviate=False)

    def _landed(self, task: Task) -> bool:
        return self._looked_at(task, self.transport.inbox.landed(_input_key(task)))

    def _announced(self, task: Task) -> bool:
        return self.transport.inbox.has(_input_key(task))

    def _arrived(self, task: Task) -> bool:
        key = _input_key(task)
        if self.transport.inbox.has(key):
            return self._looked_at(task, True)
        self._missing.append(key)
        return self._looked_at(task, False)

    def _looked_at(self, task: Task, here: bool) -> bool:
        """`here`, noted for the message-time measurement while measuring."""
        if self.record is not None:
            self.record.input_looked_at(self.topology.source(self.rank, task)[0], task, here)
        return here

    def _send_output(self, task: Task, tensor) -> None:
        """To the rank of the task that consumes `task`'s output (none: nothing to send)."""
        destination = self.topology.destination(self.rank, task)
        if destination is None:
            return
        rank, consumer = destination
        if self.record is not None:
            self.record.message_sent(rank, consumer)
        with self.tracer.span("send", task.microbatch, task.chunk):
            self.transport.send(self.pipeline[rank], _input_key(consumer), tensor)

    def _take(self, task: Task):
        """`task`'s input. An announced message whose data is still on its way makes this
        stage's stream wait for it on the device: on a GPU the span is that wait."""
        with self.tracer.span("recv_wait", task.microbatch, task.chunk):
            return self.transport.take(_input_key(task))

    def _forward(self, task: Task) -> None:
        chunk, microbatch = task.chunk, task.microbatch
        last = self.topology.is_last(self.rank, chunk)
        input_tensor = None
        if not self.topology.input_is_local(self.rank, task):
            input_tensor = self._take(task)
            if not self.forward_only:
                input_tensor.requires_grad_(True)
        span = self.tracer.start("forward", microbatch, chunk)
        data = self.iterators[chunk]
        if isinstance(data, _Batches):
            data = data.of(microbatch)
        stored = len(self.forward_data_store)
        with (contextlib.nullcontext() if self.record is None or self.forward_only
              else self.record.saving(self.model[chunk].parameters(), self.device)) as saving:
            output, num_tokens = self._forward_step(data, chunk, microbatch, input_tensor, last)
            if saving is not None:
                saving.keep(output)
        self.tracer.stop(span)
        if last and self.output_weight_grads is not None:
            self.output_weight_grads.after_forward(microbatch, training=not self.forward_only)
        self.forwards_run[chunk] += 1
        self.stored_microbatch += [microbatch] * (len(self.forward_data_store) - stored)
        self.total_num_tokens += num_tokens
        self._send_output(task, output)
        if not self.forward_only:
            self.saved[(chunk, microbatch)] = (input_tensor, output)
            if not last:
                deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)

    def _forward_step(self, data, chunk: int, microbatch: int, input_tensor, last: bool):
        return forward_step(
            self.forward_step_func,
            data,
            self.model[chunk],
            self.num_microbatches,
            input_tensor,
            self.forward_data_store,
            self.config,
            cp_group_size=1,
            collect_non_loss_data=self.collect_non_loss_data,
            is_first_microbatch=self.forwards_run[chunk] == 0,
            current_microbatch=microbatch,
            vp_stage=chunk if self.num_chunks > 1 else None,
            is_last_stage=last,
        )

    def _backward(self, task: Task) -> None:
        chunk, microbatch = task.chunk, task.microbatch
        input_tensor, output = self.saved.pop((chunk, microbatch))
        output_grad = (None if self.topology.input_is_local(self.rank, task)
                       else self._take(task))
        span = self.tracer.start("backward", microbatch, chunk)
        self.backwards_run[chunk] += 1
        last = self.backwards_run[chunk] == self.num_microbatches
        # megatron-core's convention for the chunk's last backward: without a
        # grad_sync_func DDP's hooks start the reduction during it; with one (and with the
        # split, whose store calls it after the chunk's last W) it is started once, after
        hooks_start = last and self.grad_syncs is None
        if hooks_start:
            self.no_sync.enable(chunk)
        with (contextlib.nullcontext() if self.weight_grads is None
              else self.weight_grads.deferring((chunk, microbatch))):
            input_grad = core_internals.backward_step(
                input_tensor, output, output_grad, self.config)
        if self.output_weight_grads is not None and self.topology.is_last(self.rank, chunk):
            self.output_weight_grads.after_backward(microbatch)
        self.tracer.stop(span)
        self._send_output(task, input_grad)
        if last and not hooks_start:
            self.no_sync.enable(chunk)
            if self.weight_grads is None:
                self.grad_syncs[chunk](self.model[chunk].parameters())

    def _weight(self, task: Task) -> bool:
        """W: the weight-gradient GEMMs the B of this chunk and microbatch deferred, one of
        the policy's `weight_slices` parts of them; True when that was the last part."""
        span = self.tracer.start("weight", task.microbatch, task.chunk)

        def run() -> bool:
            return self.weight_grads.run((task.chunk, task.microbatch), self.stage.weight_slices)

        stragglers = self.stragglers
        complete = (run() if stragglers is None
                    else stragglers.run(WEIGHT, task.chunk, task.microbatch, run))
        self.tracer.stop(span)
        return complete


class _Batches:
    """A stage's data for one call, read ahead on first use so that each forward gets its
    own microbatch's batch whatever order the plan runs the microbatches in."""

    def __init__(self, iterator, count: int):
        self._iterator, self._count = iterator, count
        self._batches: list | None = None

    def of(self, microbatch: int):
        if self._batches is None:
            self._batches = [next(self._iterator) for _ in range(self._count)]
        return iter((self._batches[microbatch],))


def _input_key(task: Task) -> MessageKey:
    """The key of the message that carries `task`'s input: the activation of a forward,
    the output gradient of a backward."""
    kind = MessageKind.ACTIVATION if task.kind == FORWARD else MessageKind.GRADIENT
    return MessageKey(kind, task.chunk, task.microbatch)


def _device(model) -> torch.device:
    return next(model[0].parameters()).device


def _per_chunk(func_or_list, num_chunks: int) -> list:
    if isinstance(func_or_list, list):
        if len(func_or_list) != num_chunks:
            raise ValueError(f"{len(func_or_list)} per-chunk functions for {num_chunks} chunks")
        return func_or_list
    return [func_or_list] * num_chunks


class _NoSyncPerChunk:
    """Gradient reduction stays off for every chunk until that chunk's last backward
    (DDP then overlaps its reduction with the remaining work); all are re-enabled on exit."""

    def __init__(self, config, num_chunks: int, forward_only: bool):
        funcs = config.no_sync_func
        self._funcs = None if forward_only or funcs is None else _per_chunk(funcs, num_chunks)
        self._open: dict[int, contextlib.AbstractContextManager] = {}

    def __enter__(self):
        if self._funcs is not None:
            for chunk, func in enumerate(self._funcs):
                context = func()
                context.__enter__()
                self._open[chunk] = context
        return self

    def enable(self, chunk: int) -> None:
        context = self._open.pop(chunk, None)
        if context is not None:
            context.__exit__(None, None, None)

    def __exit__(self, *exc):
        for chunk in list(self._open):
            self.enable(chunk)
        return False
