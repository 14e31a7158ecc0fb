"""The training loop, top to bottom: set up, then train / evaluate / checkpoint / log.

`pretrain(task, argv)` is what pretrain_gpt.py and pretrain_bert.py call; a `ModelTask`
says what differs between models (stage builder, datasets, forward step).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads

from megatron.dpp import tracing
from megatron.dpp.config import DppOptions
from megatron.dpp.weight_grad import SplitBackwardNoPipelining, WeightGradStore
from megatron.dpp.weight_grad_accumulation import weight_grad_accumulation_fusion
from megatron.trainer.checkpoint import checkpointing
from megatron.trainer.checkpoint.save_directory import claim_save_directory
from megatron.trainer.config import fast_path
from megatron.trainer.config.arguments import ArgumentError, parse_args
from megatron.trainer.config.configs import LoggingConfig, TokenizerConfig, TrainerConfigs
from megatron.trainer.core_compat import core_overrides, no_apex
from megatron.trainer.core_compat.emulated_p2p import P2PLinks, log_edges
from megatron.trainer.core_compat.planned_p2p import PlannedShapes
from megatron.trainer.core_compat.reruns import (
    RerunConfig,
    ResultValidation,
    ResultValidationStop,
    stop_on_non_finite,
)
from megatron.trainer.data import index_cache
from megatron.trainer.data.batch_schedule import batch_size_schedule
from megatron.trainer.data.data import MicroBatchIterator, check_data_paths, microbatch_lengths
from megatron.trainer.data.data_splits import check_splits
from megatron.trainer.data.microbatches import (
    BatchLayout,
    DocumentMicrobatches,
    cost_ordered,
    lengths_per_sample,
    lengths_source,
    padded_length,
    plan_global_batch,
    reorder_data_iterators,
)
from megatron.trainer.kernels import triton_gelu
from megatron.trainer.model.cuda_graphs import install_block_graphs
from megatron.trainer.model.models import (
    build_model_chunks,
    transformer_config_from_args,
    use_transformer_engine,
)
from megatron.trainer.run import metrics, replica_check
from megatron.trainer.run.emulation import Stragglers, gather_pods, pod_of
from megatron.trainer.run.exit_signals import (
    ExitSignals,
    StoppedBySignal,
    follow_torchrun,
    launched_by_torchrun,
)
from megatron.trainer.run.failures import exit_on_known_failures
from megatron.trainer.run.initialize import initialize_distributed, setup_logging
from megatron.trainer.run.manual_gc import ManualGC
from megatron.trainer.run.memory_history import MemoryHistory, memory_history_refusal
from megatron.trainer.run.optimizer import build_optimizer, build_scheduler, wrap_model_chunks
from megatron.trainer.run.profiler import StepProfiler
from megatron.trainer.run.rng import ForwardRng
from megatron.trainer.run.stalls import StallWatch
from megatron.trainer.run.timers import Timers

log = logging.getLogger("megatron.trainer")


@dataclass
class ModelTask:
    """What a model family brings to the shared loop."""

    name: str
    build_stage: Callable  # (args, config, pre_process, post_process, vp_stage) -> module
    build_datasets: Callable  # (args, tokenizer) -> (train, valid, test)
    make_forward_step: Callable  # (args, device) -> forward_step_func(data_iterator, model)
    loss_names: tuple[str, ...]
    data_on_every_stage: bool = False  # BERT: every stage needs the padding mask
    masked_attention: bool = False  # BERT: its blocks take the padding mask (fast_path.py)
    documents: bool = False  # its datasets read --variable-seq-lengths' documents (GPT)
    splits_by_document: bool = False  # --split cuts documents (BERT), not sequences (GPT)


@dataclass
class Trainer:
    args: object
    task: ModelTask
    device: torch.device
    model: list
    optimizer: object
    scheduler: object
    config: object
    batch_calculator: object
    datasets: tuple
    state: checkpointing.TrainingState
    schedule: Callable
    rng: ForwardRng
    configs: TrainerConfigs  # the flags by topic; `args` stays for megatron-core's API
    timers: Timers
    tracer: object = field(default_factory=tracing.NullTracer)  # --trace: see start_tracing
    collector: ManualGC = field(default_factory=lambda: ManualGC(enabled=False))
    # --record-memory-history: the allocator's snapshot after chosen iterations
    memory_history: MemoryHistory = field(
        default_factory=lambda: MemoryHistory(False, "", 0, 1))
    checkpointer: checkpointing.Checkpointer | None = None  # None: no --save / --load
    # --rerun-mode: megatron-core's rerun state machine (installed by setup)
    reruns: ResultValidation = field(default_factory=lambda: ResultValidation(RerunConfig()))
    # --cuda-graph-impl block: each transformer block's graphs (model/cuda_graphs.py), and
    # whether the ranks have met after the first step's recordings (record_warm_shapes)
    block_graphs: list = field(default_factory=list)
    graphs_settled: bool = False
    # megatron-core's schedule told each microbatch's shape by the plan, or given emulated
    # links (None: megatron-core's own p2p)
    planned_shapes: PlannedShapes | None = None
    stragglers: Stragglers | None = None  # --emulate-straggler
    exit_signals: ExitSignals | None = None  # --exit-signal-handler

    @property
    def reporting(self) -> bool:
        """The last rank reports losses (it is on the last pipeline stage)."""
        return dist.get_rank() == dist.get_world_size() - 1

    def forward_step_func(self, iteration: int) -> Callable:
        """The model's forward step for one schedule call of `iteration`, its random draws
        keyed by (seed, iteration, microbatch, virtual stage)."""
        step = self.rng.keyed(self.task.make_forward_step(self.args, self.device), iteration)
        return step if self.stragglers is None else self.stragglers.wrap(step)


def pretrain(task: ModelTask, argv=None, extra_args_provider=None) -> checkpointing.TrainingState:
    """The entry points' body. A known failure (flag, data, transport, checkpoint I/O,
    Ctrl-C) ends the rank with one line naming the cause (megatron.trainer.run.failures)."""
    setup_logging(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    with exit_on_known_failures(sys.argv[0]):
        if launched_by_torchrun():
            follow_torchrun()
        args = parse_args(argv, extra_args_provider, model=task.name.lower())
        with contextlib.ExitStack() as stack:
            trainer = setup(task, args, stack)
            train(trainer)
            return trainer.state


def setup(task: ModelTask, args, stack: contextlib.ExitStack) -> Trainer:
    core_overrides.verify()  # megatron-core has what the trainer patches and relies on
    if lengths_per_sample(args) and not task.documents:
        raise ArgumentError(f"{lengths_source(args)} is for GPT; {task.name}'s samples are "
                            "not single sequences of their own lengths")
    check_data_paths(args)  # before the job starts: every rank reads its own files
    if args.data_path and not args.mock_data:
        index_cache.check_cache(args.data_cache_path, args.data_blend[0])
    check_splits(args, by_document=task.splits_by_document)
    try:
        model_fallbacks = fast_path.resolve_for_model(args, task.masked_attention)
    except fast_path.GraphsRefused as refusal:
        raise ArgumentError(str(refusal)) from None
    configs = TrainerConfigs.from_args(args)  # the flags are settled from here on
    refused = memory_history_refusal(args.record_memory_history, torch.cuda.is_available())
    if refused:
        raise ArgumentError(refused)
    metrics.require_wandb(configs.logging)
    _require_optimizer_instance_support(args)
    # before the job starts too: a missing or wrong tokenizer file is one line per rank
    tokenizer = TokenizerConfig.from_args(args).build()
    with StallWatch("joining the job", f"waiting for all {configs.parallel.world_size} ranks at "
                    f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
                    " (a rank that has not started or has failed?)"):
        device = initialize_distributed(args, stack)
    setup_logging(dist.get_rank(), dist.get_world_size())
    checkpoint = configs.checkpoint
    if checkpoint.save:  # checked and locked before anything is built
        claim_save_directory(checkpoint.save, checkpoint.load is not None, stack)
    if dist.get_rank() == 0:  # the same on every rank
        fast_path.log_fallbacks(args.fast_path_fallbacks + model_fallbacks)
    args.padded_vocab_size = _padded_vocab_size(tokenizer.vocab_size, args)
    # from before the model is built, so that the snapshot accounts for every allocation
    history = stack.enter_context(MemoryHistory(
        args.record_memory_history and dist.get_rank() in args.profile_ranks,
        args.memory_snapshot_path, dist.get_rank(), configs.logging.log_interval))
    config = transformer_config_from_args(args)
    if config.gradient_accumulation_fusion:
        stack.enter_context(weight_grad_accumulation_fusion())
    if configs.fast_path.triton_fusions and config.bias_activation_fusion:
        stack.enter_context(triton_gelu.installed())
    chunks = build_model_chunks(args, config, task.build_stage)
    model = wrap_model_chunks(chunks, args, config, device)
    # --dpp-split-backward: the schedule's B/W split, which the CUDA-graph blocks follow
    weight_grads = WeightGradStore() if configs.schedule.dpp_split_backward else None
    block_graphs = []
    if configs.fast_path.cuda_graph_impl == "block":
        # a graph per part of W, so the schedule decides between the parts
        block_graphs = install_block_graphs(model, args, device, weight_grads,
                                            DppOptions.from_args(args).weight_slices)
    if not configs.fast_path.megatron_optimizer_fallbacks:
        stack.enter_context(no_apex.foreach_multi_tensor_ops())
    timers = Timers(configs.logging.timing_log_level, synchronize=device.type == "cuda")
    optimizer = build_optimizer(model, args, timers if timers.level >= 1 else None)
    scheduler = build_scheduler(optimizer, args)
    _install_schedule_hooks(config, model, optimizer, configs)
    state = checkpointing.TrainingState()
    checkpointer = None
    if checkpoint.save or checkpoint.load:
        checkpointer = checkpointing.Checkpointer(checkpoint, use_gpu=device.type == "cuda")
        # after an error an asynchronous save in flight is stopped, never published
        stack.push(lambda exc_type, exc, traceback: checkpointer.close(failed=exc_type is not None))
    if checkpoint.load:
        with StallWatch("loading the checkpoint", f"reading --load {checkpoint.load} (every rank "
                        "reads its shards, then they agree on the iteration)"):
            state = checkpointer.load(model, optimizer, scheduler)
    if not configs.fast_path.megatron_optimizer_fallbacks:
        no_apex.use_fused_adam(optimizer)
    with _dataset_watch(args), index_cache.write_errors_named(args.data_cache_path):
        datasets = task.build_datasets(args, tokenizer)
    log.info("%s: %d parameters on this rank, %d model chunk(s), schedule %s, layers %s",
             task.name, sum(p.numel() for c in model for p in c.parameters()), len(model),
             ("DPP" if configs.schedule.use_dpp else "megatron-core") + (
                 ", each backward split into B and W" if weight_grads is not None else ""),
             "Transformer Engine" if use_transformer_engine(args) else "megatron.core + SDPA")
    emulation = configs.emulation.emulation()
    if emulation.active and dist.get_rank() == 0:
        log.info("%s", emulation.describe())
    pod = pod_of(args)
    schedule = forward_backward_func(args, weight_grads, pod, emulation)
    links = _core_p2p_links(configs, emulation, pod, device, stack)
    planned_shapes = _planned_shapes(configs, config, len(model), links)
    if planned_shapes is not None and planned_shapes.planned:
        log.info("megatron-core's schedule with variable lengths: each microbatch's shape "
                 "comes from the plan (no shape exchange and device sync per message)")
    if hasattr(schedule, "close"):
        stack.callback(schedule.close)
    reruns = ResultValidation(RerunConfig.from_args(args))
    reruns.start(stack, state.iteration)
    collector = stack.enter_context(
        ManualGC(args.manual_gc, args.manual_gc_interval, args.manual_gc_eval))
    rng = ForwardRng(args.seed, device)
    stragglers = Stragglers(emulation, rng, device) if emulation.straggler else None
    # last: a signal during set-up ends the rank at once, one during training at a step's end
    exit_signals = (stack.enter_context(ExitSignals(device)) if args.exit_signal_handler
                    else None)
    return Trainer(args, task, device, model, optimizer, scheduler, config,
                   _batch_calculator(configs), datasets, state, schedule, rng, configs, timers,
                   collector=collector, checkpointer=checkpointer, reruns=reruns,
                   block_graphs=block_graphs, planned_shapes=planned_shapes,
                   stragglers=stragglers, memory_history=history, exit_signals=exit_signals)


def _core_p2p_links(configs: TrainerConfigs, emulation, pod: str | None, device,
                    stack: contextlib.ExitStack) -> P2PLinks | None:
    """Under megatron-core's pipeline schedules: log each edge's transport, and the emulated
    links (--emulate-link-ms) their messages take (None: no link emulated)."""
    if configs.schedule.use_dpp or configs.parallel.pipeline_model_parallel_size == 1:
        return None
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pods = gather_pods(pod)
    ring = (configs.parallel.virtual_pipeline_model_parallel_size or 1) > 1
    if emulation.link is None:
        log_edges(pp_group, pods, ring)
        return None
    links = P2PLinks(emulation, pp_group, pods, device, ring, configs.schedule.dpp_timeout)
    # after an error a peer may be gone: drop what is still to be delivered
    stack.push(lambda exc_type, exc, traceback: links.close(abort=exc_type is not None))
    return links


def _planned_shapes(configs: TrainerConfigs, config, num_chunks: int,
                    links: P2PLinks | None = None) -> PlannedShapes | None:
    """Where megatron-core's schedule (1F1B or interleaved) takes the trainer's p2p, in
    training and evaluation: across stages with variable lengths (receive shapes from the
    plan) or with emulated links."""
    parallel = configs.parallel
    if configs.schedule.use_dpp or parallel.pipeline_model_parallel_size == 1 or (
            not config.variable_seq_lengths and links is None):
        return None
    split = parallel.context_parallel_size * (
        parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1)
    return PlannedShapes(parallel_state.get_pipeline_model_parallel_group(),
                         parallel_state.get_pipeline_model_parallel_rank(), config, num_chunks,
                         split, planned=config.variable_seq_lengths, links=links)


def _dataset_watch(args) -> StallWatch:
    """megatron.core writes the dataset index files on rank 0 while the others wait in a
    barrier; each says which side it is on when that takes long."""
    cache = args.data_cache_path or "next to the --data-path files"
    if dist.get_rank() == 0:
        return StallWatch("building the datasets", f"writing the dataset index files ({cache}) "
                          "for the samples --train-iters and --eval-iters ask for; the other "
                          "ranks wait for this rank")
    return StallWatch("building the datasets", "waiting in a barrier for rank 0 to write the "
                      f"dataset index files ({cache}); rank 0's log says what it does")


def _require_optimizer_instance_support(args) -> None:
    """megatron-core builds the groups of several optimizer instances with einops and
    reduces between them on a CUDA stream."""
    instances = args.num_distributed_optimizer_instances
    if instances > 1 and importlib.util.find_spec("einops") is None:
        raise ArgumentError(f"--num-distributed-optimizer-instances {instances}: the einops "
                            "package is not importable here (pip install einops)")
    if instances > 1 and not fast_path.on_gpu(args, fast_path.Machine.detect()):
        raise ArgumentError(f"--num-distributed-optimizer-instances {instances} needs GPUs "
                            "(megatron-core reduces between the instances on a CUDA stream)")


def _padded_vocab_size(vocab_size: int, args) -> int:
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def _batch_calculator(configs: TrainerConfigs):
    schedule = configs.schedule
    return batch_size_schedule(schedule.global_batch_size, schedule.micro_batch_size,
                               configs.parallel.data_parallel_size, schedule.rampup_batch_size,
                               schedule.step_batch_size_schedule, configs.model.seq_length)


def _install_schedule_hooks(config, model, optimizer, configs: TrainerConfigs) -> None:
    """The callbacks megatron.core's schedules (and DPP's) expect on the config."""
    no_sync = [chunk.no_sync for chunk in model]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    # Without a grad_sync_func DPP lets DDP's hooks start each chunk's reduction during its
    # last backward. With the B/W split the hooks run during B, before W completes the
    # gradients: the WeightGradStore starts each chunk's reduction with it after the
    # chunk's last W
    schedule = configs.schedule
    if configs.parallel.overlap_grad_reduce and (not schedule.use_dpp
                                                 or schedule.dpp_split_backward):
        sync = [chunk.start_grad_sync for chunk in model]
        config.grad_sync_func = sync[0] if len(sync) == 1 else sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.timers = None


def forward_backward_func(args, weight_grads: WeightGradStore | None = None,
                          pod: str | None = None, emulation=None):
    if args.use_dpp:
        from megatron.dpp import get_forward_backward_func

        return get_forward_backward_func(args, weight_grads, pod, emulation)
    if weight_grads is not None:
        return SplitBackwardNoPipelining(weight_grads)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()


def data_iterators(trainer: Trainer, dataset, consumed_samples: int):
    """One iterator per local model chunk; None where the chunk needs no data (neither the
    first nor the last virtual stage reads the batch)."""
    args, configs = trainer.args, trainer.configs
    iterators = []
    for vp_stage in range(len(trainer.model)):
        vp = vp_stage if len(trainer.model) > 1 else None
        needs_data = trainer.task.data_on_every_stage or parallel_state.is_pipeline_first_stage(
            ignore_virtual=False, vp_stage=vp
        ) or parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        if not needs_data:
            iterators.append(None)
        elif configs.data.lengths_per_sample:
            iterators.append(DocumentMicrobatches(
                dataset, batch_layout(configs), parallel_state.get_data_parallel_rank(),
                consumed_samples))
        else:
            data = configs.data
            iterators.append(MicroBatchIterator(
                dataset, configs.schedule.micro_batch_size, consumed_samples,
                seq_length_cv=data.seq_length_cv, seed=args.seed, num_workers=data.num_workers,
                pad_to_multiple=data.pad_to_multiple, vocab_size=args.padded_vocab_size))
    return iterators if len(iterators) > 1 else iterators[0]


def batch_layout(configs: TrainerConfigs) -> BatchLayout:
    """How a global batch of samples of their own lengths (--variable-seq-lengths, or
    --seq-length-cv under --microbatch-tokens) becomes microbatches (microbatches.py)."""
    schedule, data = configs.schedule, configs.data
    return BatchLayout(schedule.micro_batch_size, schedule.global_batch_size,
                       configs.parallel.data_parallel_size, data.group_by_length,
                       data.pad_to_multiple, data.microbatch_tokens)


def iteration_lengths(trainer: Trainer, consumed_samples: int, global_batch: int,
                      dataset=None):
    """(costs, sequences, microbatches) of the global batch at `consumed_samples` of
    `dataset` (default the training set): costs,
    the token count (padding included) of each of this pipeline's microbatches (None when
    all are alike), which the cost order and DPP's memory cap use, and whose number is the
    iteration's microbatch count under --microbatch-tokens; sequences, (padded length, rows,
    real tokens) of every microbatch of every data-parallel rank, for the throughput line;
    microbatches, (padded length, rows) of this pipeline's, in the plan's order."""
    configs, data = trainer.configs, trainer.configs.data
    if data.lengths_per_sample:
        plan = plan_global_batch(trainer.datasets[0] if dataset is None else dataset,
                                 consumed_samples, batch_layout(configs))
        sequences = [(length, len(samples), real) for samples_of_rank, lengths_of_rank,
                     real_of_rank in zip(plan.samples, plan.lengths, plan.real_tokens,
                                         strict=True)
                     for samples, length, real in zip(samples_of_rank, lengths_of_rank,
                                                      real_of_rank, strict=True)]
        dp_rank = parallel_state.get_data_parallel_rank()
        microbatches = [(length, len(samples)) for samples, length
                        in zip(plan.samples[dp_rank], plan.lengths[dp_rank], strict=True)]
        return plan.token_counts(dp_rank), sequences, microbatches
    lengths = microbatch_lengths(trainer.args, consumed_samples, global_batch)
    padded = [padded_length(length, data.pad_to_multiple, configs.model.seq_length)
              for length in lengths]
    rows = configs.schedule.micro_batch_size * configs.parallel.data_parallel_size
    costs = padded if data.seq_length_cv > 0 else None
    sequences = [(width, rows, length * rows) for width, length in zip(padded, lengths,
                                                                       strict=True)]
    return costs, sequences, [(width, configs.schedule.micro_batch_size) for width in padded]


def microbatch_count(trainer: Trainer, costs) -> int:
    """This iteration's number of microbatches: the token budget's cut (one cost per
    microbatch) under --microbatch-tokens, else the batch-size schedule's."""
    if trainer.configs.data.microbatch_tokens is not None:
        return len(costs)
    return trainer.batch_calculator.get()


def start_tracing(trainer: Trainer) -> None:
    """--trace: a Tracer for this rank, fed by the DPP schedule itself or, for megatron.core's
    schedules, through config.timers (which also reports the grad sync under DPP)."""
    trainer.tracer = tracing.open_tracer(trainer.args, trainer.device, len(trainer.model))
    traced = trainer.tracer.megatron_timers(label_compute=not trainer.configs.schedule.use_dpp)
    # megatron-core's timers go to --timing-log-level's Timers, which pass them on to the
    # tracer's
    trainer.timers.inner = traced
    if traced is not None or trainer.timers.level >= 1:
        trainer.config.timers = trainer.timers
    if hasattr(trainer.schedule, "tracer"):
        trainer.schedule.tracer = trainer.tracer


def train_step(trainer: Trainer, iterator,
               readers: Sequence[DocumentMicrobatches] = ()) -> dict:
    """One iteration. `readers`: the data iterators under `iterator` that read the next
    global batch ahead, which they do once this step's schedule has launched its work."""
    schedule = trainer.configs.schedule
    iteration = trainer.state.iteration + 1
    batch = trainer.batch_calculator.get_current_global_batch_size()
    costs, sequences, microbatches = iteration_lengths(trainer, trainer.state.consumed_samples,
                                                       batch)
    num_microbatches = microbatch_count(trainer, costs)
    order = None  # megatron-core's schedule reads the microbatches in this order
    if costs is not None and not schedule.use_dpp and schedule.microbatch_order == "cost":
        order = cost_ordered(costs, trainer.configs.parallel.pipeline_model_parallel_size)
    trainer.tracer.begin_iteration(iteration, num_microbatches)
    forward_backward = trainer.timers("forward-backward", log_level=1)
    forward_backward.start()
    # once, or again where --rerun-mode's state machine re-runs the iteration (the
    # iterator then replays the same microbatches)
    for _ in trainer.reruns.runs(iterator, iteration):
        for chunk in trainer.model:
            chunk.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        # the microbatches' token counts are known before the step: DPP orders by them (and
        # caps the tokens a stage holds); megatron-core's schedule gets the same order by
        # reading the microbatches in it
        schedule_iterator = iterator
        if costs is not None and schedule.use_dpp:
            trainer.schedule.set_microbatch_costs(costs,
                                                  reorder=schedule.microbatch_order == "cost")
        elif order is not None:
            schedule_iterator = reorder_data_iterators(iterator, order)
        p2p = {}
        if trainer.planned_shapes is not None:
            p2p = trainer.planned_shapes.arguments(
                microbatches if order is None else [microbatches[i] for i in order], iteration)
        if schedule.use_dpp:
            trainer.schedule.set_iteration(iteration)
        losses = _run_schedule(
            trainer, trainer.reruns.checked(trainer.forward_step_func(iteration)),
            schedule_iterator, num_microbatches, forward_only=False, **p2p)
    if iteration < schedule.train_iters:
        # the host reads the next step's microbatches while the GPU still runs this one's
        # last backwards, not at the next step's first forward with the GPU idle
        for reader in readers:
            reader.read_next_global_batch()
    forward_backward.stop()
    verdict = trainer.reruns.verdict(iteration)
    if verdict is not None:
        _stop_on_verdict(trainer, verdict)
    optimizer = trainer.timers("optimizer", log_level=1)
    optimizer.start()
    with trainer.tracer.span("optimizer"):
        updated, grad_norm, num_zeros = trainer.optimizer.step()
    optimizer.stop()
    trainer.tracer.end_iteration()
    if trainer.block_graphs:
        record_warm_shapes(trainer)
    if updated:
        trainer.scheduler.step(increment=batch)
    else:
        trainer.state.skipped_iterations += 1
    reduced = reduce_losses(losses, trainer.task.loss_names)
    if trainer.reruns.config.check_for_nan:
        # a step the loss scaler skipped (fp16 overflow) changed nothing: its norm is no news
        stop_on_non_finite(iteration, reduced, grad_norm if updated else None)
    return {
        "losses": reduced,
        "grad_norm": grad_norm,
        "num_zeros": num_zeros,
        "updated": updated,
        "batch": batch,
        "sequences": sequences,
    }


def record_warm_shapes(trainer: Trainer) -> None:
    """Between steps, with no microbatch in flight: record the length buckets that lanes
    made in this step still miss (all of them after the first step, so no later step
    records). After the first step the ranks then meet at a barrier: a first stage records
    more lanes than the last, and a peer waiting for its next step's first message would
    otherwise count those seconds against --dpp-timeout."""
    recorded = sum(graphs.record_warm() for graphs in trainer.block_graphs)
    if not trainer.graphs_settled:
        log.info("CUDA graphs: %d bucket slots recorded after the first step; waiting for "
                 "every rank's", recorded)
        dist.barrier()
        trainer.graphs_settled = True


def _stop_on_signal(trainer: Trainer, signum: int) -> None:
    """--exit-signal-handler, at a step boundary: end the run where a rank received SIGTERM
    or SIGINT (`signum`, 0: none did), after saving this iteration unless it was just saved."""
    if not signum:
        return
    checkpoint, iteration = trainer.configs.checkpoint, trainer.state.iteration
    saved = "no checkpoint saved (no --save)"
    if checkpoint.save:
        if not (checkpoint.save_interval and iteration % checkpoint.save_interval == 0):
            trainer.checkpointer.save(trainer.model, trainer.optimizer, trainer.scheduler,
                                      trainer.state)
        trainer.checkpointer.wait()
        saved = f"saved iteration {iteration} to {checkpoint.save}"
    raise StoppedBySignal(signum, f"stopped by {signal.Signals(signum).name} after iteration "
                          f"{iteration} of {trainer.configs.schedule.train_iters}; {saved}")


def _stop_on_verdict(trainer: Trainer, verdict) -> None:
    """End the run as the rerun state machine decided, with the checkpoint it asks for (of
    the last completed iteration: this one's optimizer step has not run)."""
    saved = ""
    if verdict.checkpoint and trainer.checkpointer is not None and trainer.configs.checkpoint.save:
        path = trainer.checkpointer.save(trainer.model, trainer.optimizer, trainer.scheduler,
                                         trainer.state)
        trainer.checkpointer.wait()
        saved = f"; saved {path}"
    elif verdict.checkpoint:
        saved = "; no checkpoint saved (no --save)"
    raise ResultValidationStop(verdict.message + saved, verdict.status)


def reduce_losses(losses: list[dict], names) -> dict[str, float]:
    """Token-weighted mean of each loss over the micro-batches and data-parallel ranks.
    Non-reporting stages hold no losses and return an empty dict."""
    if not losses:
        return {}
    totals = {}
    for name in names:
        pair = torch.stack([entry[name].float() for entry in losses]).sum(dim=0)
        dist.all_reduce(pair, group=parallel_state.get_data_parallel_group())
        totals[name] = (pair[0] / pair[1].clamp(min=1)).item()
    return totals


def evaluate(trainer: Trainer, dataset, consumed: int) -> dict[str, float]:
    schedule = trainer.configs.schedule
    for chunk in trainer.model:
        chunk.eval()
    iterator = data_iterators(trainer, dataset, consumed)
    # --eval-global-batch-size: its own number of microbatches; else the training step's
    rows = schedule.micro_batch_size * trainer.configs.parallel.data_parallel_size
    num_microbatches = (schedule.eval_global_batch_size // rows
                        if schedule.eval_global_batch_size else trainer.batch_calculator.get())
    gathered: list[dict] = []
    with torch.no_grad():
        for step in range(schedule.eval_iters):
            p2p = {}
            if trainer.configs.data.lengths_per_sample or trainer.planned_shapes is not None:
                # a plan's global batch per step, else the microbatches read so far
                start = consumed + step * (schedule.global_batch_size
                                           if trainer.configs.data.lengths_per_sample
                                           else num_microbatches * rows)
                costs, _, microbatches = iteration_lengths(trainer, start,
                                                           num_microbatches * rows, dataset)
                if trainer.configs.data.microbatch_tokens is not None:  # the budget's cut
                    num_microbatches = len(costs)
                if trainer.planned_shapes is not None:
                    p2p = trainer.planned_shapes.arguments(microbatches,
                                                           trainer.state.iteration)
            if schedule.use_dpp:
                trainer.schedule.set_iteration(trainer.state.iteration)
            gathered += _run_schedule(
                trainer, trainer.forward_step_func(trainer.state.iteration), iterator,
                num_microbatches, forward_only=True, **p2p)
    for chunk in trainer.model:
        chunk.train()
    return reduce_losses(gathered, trainer.task.loss_names)


def train(trainer: Trainer) -> None:
    args, state = trainer.args, trainer.state
    schedule, logging_config = trainer.configs.schedule, trainer.configs.logging
    train_set, valid_set, _ = trainer.datasets
    sources = data_iterators(trainer, train_set, state.consumed_samples)
    readers = [source for source in (sources if isinstance(sources, list) else [sources])
               if isinstance(source, DocumentMicrobatches)]
    iterator = trainer.reruns.data_iterators(sources)
    board = metrics.ScalarLog(logging_config, trainer.reporting, _run_config(args))
    peak = metrics.peak_tflops(torch.cuda.get_device_name() if torch.cuda.is_available() else "")
    for chunk in trainer.model:
        chunk.train()
    start_tracing(trainer)
    profiler = StepProfiler(args, dist.get_rank())
    nan_iterations = 0
    interval_start, interval_tokens, interval_flops, interval_iters = time.perf_counter(), 0, 0.0, 0
    interval_real_tokens = 0
    while state.iteration < schedule.train_iters:
        trainer.batch_calculator.update(state.consumed_samples, True)
        profiler.step_begin(state.iteration + 1)
        result = train_step(trainer, iterator, readers)
        profiler.step_end(state.iteration + 1)
        for length, rows, real in result["sequences"]:
            interval_tokens += length * rows
            interval_real_tokens += real
            flops = length * rows * metrics.flops_per_token(args, length)
            interval_flops += flops
            state.floating_point_operations += flops
        state.iteration += 1
        trainer.collector.after_step(state.iteration)
        trainer.memory_history.after_step(state.iteration)
        state.consumed_samples += result["batch"]
        interval_iters += 1
        losses = result["losses"]
        if any(not math.isfinite(v) for v in losses.values()):
            nan_iterations += 1
        if (state.iteration % logging_config.log_interval == 0
                or state.iteration == schedule.train_iters):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            elapsed = (time.perf_counter() - interval_start) / interval_iters
            # per-rank memory: one tiny all-gather per log interval, only when asked for
            peaks = (tracing.gather_peak_memory(trainer.device)
                     if logging_config.log_throughput else None)
            # collectives of the model-parallel group: every rank takes part
            norm = (metrics.params_norm(trainer.model, trainer.device)
                    if logging_config.log_params_norm else None)
            timed = {name: 1000.0 * seconds / interval_iters
                     for name, seconds in trainer.timers.take().items()}
            if trainer.reporting:
                stats = metrics.IterationStats(
                    iteration=state.iteration, train_iters=schedule.train_iters,
                    consumed_samples=state.consumed_samples, elapsed_ms=elapsed * 1000.0,
                    lr=trainer.scheduler.get_lr(trainer.optimizer.param_groups[0]),
                    global_batch_size=result["batch"], losses=losses,
                    loss_scale=float(trainer.optimizer.get_loss_scale().item()),
                    grad_norm=result["grad_norm"], skipped=state.skipped_iterations,
                    nan=nan_iterations, tokens=interval_tokens // interval_iters,
                    world_size=dist.get_world_size(),
                    real_tokens=interval_real_tokens // interval_iters,
                    flops=interval_flops / interval_iters, peak_tflops=peak,
                    num_zeros=None if result["num_zeros"] is None else int(result["num_zeros"]),
                    params_norm=norm,
                )
                log.info(stats.line(logging_config.log_throughput))
                if peaks is not None:
                    log.info(tracing.memory_line(peaks, trainer.device))
                if timed:
                    log.info("timers (ms per iteration) | %s |", " | ".join(
                        f"{name}: {ms:.2f}" for name, ms in timed.items()))
                board.scalars(state.iteration, _interval_scalars(logging_config, stats, timed,
                                                                 trainer.device))
            interval_start, interval_tokens, interval_flops, interval_iters = (
                time.perf_counter(), 0, 0.0, 0)
            interval_real_tokens = 0
        if schedule.eval_interval and schedule.eval_iters and valid_set is not None and (
            state.iteration % schedule.eval_interval == 0
        ):
            consumed = (state.iteration // schedule.eval_interval - 1) * schedule.eval_iters * (
                schedule.eval_global_batch_size or schedule.global_batch_size)
            with trainer.collector.evaluation():
                results = evaluate(trainer, valid_set, consumed)
            if trainer.reporting and results:
                log.info("validation at iteration %d | %s", state.iteration,
                         " | ".join(f"{k} value: {v:.6E} | {k} PPL: {math.exp(min(v, 20)):.6E}"
                                    for k, v in results.items()))
                board.scalars(state.iteration, _validation_scalars(logging_config, results))
        interval = args.check_weight_hash_across_dp_replicas_interval
        if interval and state.iteration % interval == 0:
            parallel = trainer.configs.parallel
            replica_check.check_replicas_agree(
                trainer.model, state.iteration,
                parallel.use_distributed_optimizer and parallel.overlap_param_gather)
        _checkpoint(trainer)
        if trainer.exit_signals is not None and state.iteration < schedule.train_iters:
            _stop_on_signal(trainer, trainer.exit_signals.agreed())
        if schedule.exit_interval and state.iteration % schedule.exit_interval == 0:
            break
    checkpoint = trainer.configs.checkpoint
    if checkpoint.save and (not checkpoint.save_interval
                            or state.iteration % checkpoint.save_interval != 0):
        trainer.checkpointer.save(trainer.model, trainer.optimizer, trainer.scheduler, state)
    if trainer.checkpointer is not None:
        trainer.checkpointer.wait()
    trainer.tracer.close()
    board.close()
    # the ranks end together: one whose peers failed after their last collective fails here
    # too, rather than end well and leave its node's torchrun waiting (300 s) for theirs
    dist.barrier()


def _checkpoint(trainer: Trainer) -> None:
    """After an iteration: publish a finished asynchronous save; save at --save-interval,
    else at --non-persistent-save-interval (Megatron-LM's order)."""
    checkpointer, iteration = trainer.checkpointer, trainer.state.iteration
    if checkpointer is None:
        return
    checkpointer.poll()
    config = checkpointer.config
    persistent = config.save and config.save_interval and iteration % config.save_interval == 0
    non_persistent = (config.non_persistent_interval
                      and iteration % config.non_persistent_interval == 0)
    if persistent or non_persistent:
        checkpointer.save(trainer.model, trainer.optimizer, trainer.scheduler, trainer.state,
                          non_persistent=not persistent)


def _run_config(args) -> dict:
    """The flags as W&B's run configuration (plain values only)."""
    plain = (bool, int, float, str, type(None))
    return {name: value if isinstance(value, plain) else str(value)
            for name, value in vars(args).items()}


def _interval_scalars(config: LoggingConfig, stats: metrics.IterationStats,
                      timed: dict[str, float], device: torch.device) -> dict[str, float]:
    """A log interval's scalars for TensorBoard / W&B, with Megatron-LM's names for the
    ones its --log-* flags add."""
    values = {**{f"train/{k}": v for k, v in stats.losses.items()}, "train/lr": stats.lr,
              "train/ms_per_iter": stats.elapsed_ms}
    if config.log_timers_to_tensorboard:
        values["iteration-time"] = stats.elapsed_ms
        values.update({f"{name}-time": ms for name, ms in timed.items()})
    if config.log_memory_to_tensorboard:
        values.update(metrics.memory_scalars(device))
    if stats.num_zeros is not None:
        values["num-zeros"] = stats.num_zeros
    if stats.params_norm is not None:
        values["params-norm"] = stats.params_norm
    return values


def _validation_scalars(config: LoggingConfig, results: dict[str, float]) -> dict[str, float]:
    values = {f"valid/{k}": v for k, v in results.items()}
    if config.log_validation_ppl_to_tensorboard:
        # as the log line: exp of the loss, capped at exp(20)
        values.update({f"valid/{k} ppl": math.exp(min(v, 20.0)) for k, v in results.items()})
    return values


def _run_schedule(trainer, forward_step_func, data_iterator, num_microbatches: int,
                  forward_only: bool, **p2p) -> list[dict]:
    """One pass of the pipeline schedule (megatron-core's or DPP's) over the microbatches;
    `p2p`: megatron-core's communicator and process groups where the step brings its own."""
    seq_length = trainer.configs.model.seq_length
    return trainer.schedule(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=trainer.model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=trainer.configs.schedule.micro_batch_size,
        decoder_seq_length=seq_length,
        forward_only=forward_only,
        **p2p,
    )
