"""setup: the parsed flags settled into the run's typed configurations once (TrainerConfigs),
then the job joined and the model, optimizer, checkpointer, datasets and pipeline schedule
built from those configurations into a `Trainer`."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads

from megatron.dpp.weight_grad import SplitBackwardNoPipelining, WeightGradStore
from megatron.dpp.weight_grad_accumulation import weight_grad_accumulation_fusion
from megatron.trainer.checkpoint import checkpointing
from megatron.trainer.checkpoint.save_directory import claim_save_directory
from megatron.trainer.config import fast_path
from megatron.trainer.config.arguments import ArgumentError
from megatron.trainer.config.configs import TokenizerConfig, TrainerConfigs
from megatron.trainer.core_compat import core_overrides, no_apex
from megatron.trainer.core_compat.emulated_p2p import P2PLinks, log_edges
from megatron.trainer.core_compat.planned_p2p import PlannedShapes
from megatron.trainer.core_compat.reruns import ResultValidation
from megatron.trainer.data import index_cache
from megatron.trainer.data.batch_schedule import batch_size_schedule
from megatron.trainer.data.data import check_data_paths
from megatron.trainer.data.data_splits import check_splits
from megatron.trainer.data.microbatches import lengths_per_sample, lengths_source
from megatron.trainer.kernels import triton_gelu
from megatron.trainer.model.cuda_graphs import install_block_graphs
from megatron.trainer.model.models import (
    build_model_chunks,
    transformer_config,
    use_transformer_engine,
)
from megatron.trainer.run import core_args, metrics
from megatron.trainer.run.emulation import Stragglers, gather_pods, pod_of
from megatron.trainer.run.exit_signals import ExitSignals
from megatron.trainer.run.initialize import initialize_distributed, setup_logging
from megatron.trainer.run.manual_gc import ManualGC
from megatron.trainer.run.memory_history import MemoryHistory, memory_history_refusal
from megatron.trainer.run.optimizer import build_optimizer, build_scheduler, wrap_model_chunks
from megatron.trainer.run.rng import ForwardRng
from megatron.trainer.run.stalls import StallWatch
from megatron.trainer.run.timers import Timers
from megatron.trainer.run.trainer import ModelTask, Trainer

log = logging.getLogger("megatron.trainer")


def settle_configs(task: ModelTask, args) -> tuple[TrainerConfigs, object]:
    """The checks of the flags against the model family and this machine, then the typed
    configurations, built once; returns them and the tokenizer (which sizes the vocabulary)."""
    core_overrides.verify()  # megatron-core has what the trainer patches and relies on
    if lengths_per_sample(args) and not task.documents:
        raise ArgumentError(f"{lengths_source(args)} is for GPT; {task.name}'s samples are "
                            "not single sequences of their own lengths")
    check_data_paths(args)  # before the job starts: every rank reads its own files
    check_splits(args, by_document=task.splits_by_document)
    try:
        for_model = fast_path.resolve_for_model(args, task.masked_attention)
    except fast_path.GraphsRefused as refusal:
        raise ArgumentError(str(refusal)) from None
    # before the job starts too: a missing or wrong tokenizer file is one line per rank
    tokenizer = TokenizerConfig.from_args(args).build()
    # the flags are settled from here on
    configs = TrainerConfigs.from_args(args, tokenizer.vocab_size, for_model)
    data = configs.data
    if data.data_path and not data.mock_data:
        index_cache.check_cache(data.data_cache_path, data.data_blend[0])
    refused = memory_history_refusal(configs.profiling.record_memory_history,
                                     torch.cuda.is_available())
    if refused:
        raise ArgumentError(refused)
    metrics.require_wandb(configs.logging)
    _require_optimizer_instance_support(configs)
    return configs, tokenizer


def setup(task: ModelTask, args, stack: contextlib.ExitStack) -> Trainer:
    configs, tokenizer = settle_configs(task, args)
    with StallWatch("joining the job", f"waiting for all {configs.parallel.world_size} ranks at "
                    f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
                    " (a rank that has not started or has failed?)"):
        device = initialize_distributed(configs, stack)
    setup_logging(dist.get_rank(), dist.get_world_size())
    checkpoint = configs.checkpoint
    if checkpoint.save:  # checked and locked before anything is built
        claim_save_directory(checkpoint.save, checkpoint.load is not None, stack)
    if dist.get_rank() == 0:  # the same on every rank
        fast_path.log_fallbacks(list(configs.fast_path.fast_path_fallbacks))
    profiling = configs.profiling
    # from before the model is built, so that the snapshot accounts for every allocation
    history = stack.enter_context(MemoryHistory(
        profiling.record_memory_history and dist.get_rank() in profiling.profile_ranks,
        profiling.memory_snapshot_path, dist.get_rank(), configs.logging.log_interval))
    model, config, weight_grads, block_graphs = _build_model(task, configs, device, stack)
    timers = Timers(configs.logging.timing_log_level, synchronize=device.type == "cuda")
    optimizer = build_optimizer(model, configs, timers if timers.level >= 1 else None)
    scheduler = build_scheduler(optimizer, configs)
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
    with _dataset_watch(configs), index_cache.write_errors_named(configs.data.data_cache_path):
        datasets = core_args.build_datasets(task, args, tokenizer)
    log.info("%s: %d parameters on this rank, %d model chunk(s), schedule %s, layers %s",
             task.name, sum(p.numel() for c in model for p in c.parameters()), len(model),
             ("DPP" if configs.schedule.use_dpp else "megatron-core") + (
                 ", each backward split into B and W" if weight_grads is not None else ""),
             "Transformer Engine" if use_transformer_engine(configs) else "megatron.core + SDPA")
    emulation = configs.emulation.emulation()
    if emulation.active and dist.get_rank() == 0:
        log.info("%s", emulation.describe())
    pod = pod_of(configs.process)
    schedule = forward_backward_func(configs, weight_grads, pod, emulation)
    links = _core_p2p_links(configs, emulation, pod, device, stack)
    planned_shapes = _planned_shapes(configs, config, len(model), links)
    if planned_shapes is not None and planned_shapes.planned:
        log.info("megatron-core's schedule with variable lengths: each microbatch's shape "
                 "comes from the plan (no shape exchange and device sync per message)")
    if hasattr(schedule, "close"):
        stack.callback(schedule.close)
    reruns = ResultValidation(configs.reruns)
    reruns.start(stack, state.iteration)
    process = configs.process
    collector = stack.enter_context(
        ManualGC(process.manual_gc, process.manual_gc_interval, process.manual_gc_eval))
    rng = ForwardRng(process.seed, device)
    stragglers = Stragglers(emulation, rng, device) if emulation.straggler else None
    # last: a signal during set-up ends the rank at once, one during training at a step's end
    exit_signals = (stack.enter_context(ExitSignals(device)) if process.exit_signal_handler
                    else None)
    return Trainer(args, task, device, model, optimizer, scheduler, config,
                   _batch_calculator(configs), datasets, state, schedule, rng, configs, timers,
                   collector=collector, checkpointer=checkpointer, reruns=reruns,
                   block_graphs=block_graphs, planned_shapes=planned_shapes,
                   stragglers=stragglers, memory_history=history, exit_signals=exit_signals)


def _build_model(task: ModelTask, configs: TrainerConfigs, device,
                 stack: contextlib.ExitStack) -> tuple[list, object, WeightGradStore | None, list]:
    """This rank's model chunks wrapped for training, their TransformerConfig, DPP's B/W
    split's store (None: no split) and the chunks' CUDA-graph blocks."""
    config = transformer_config(configs)
    if config.gradient_accumulation_fusion:
        stack.enter_context(weight_grad_accumulation_fusion())
    if configs.fast_path.triton_fusions and config.bias_activation_fusion:
        stack.enter_context(triton_gelu.installed())
    chunks = build_model_chunks(configs, config, task.build_stage)
    model = wrap_model_chunks(chunks, configs, config, device)
    # --dpp-split-backward: the schedule's B/W split, which the CUDA-graph blocks follow
    weight_grads = WeightGradStore() if configs.schedule.dpp_split_backward else None
    block_graphs = []
    if configs.fast_path.cuda_graph_impl == "block":
        # a graph per part of W, so the schedule decides between the parts
        block_graphs = install_block_graphs(model, configs, device, weight_grads,
                                            configs.dpp.weight_slices)
    if not configs.fast_path.megatron_optimizer_fallbacks:
        stack.enter_context(no_apex.foreach_multi_tensor_ops())
    return model, config, weight_grads, block_graphs


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


def _dataset_watch(configs: TrainerConfigs) -> StallWatch:
    """megatron.core writes the dataset index files on rank 0 while the others wait in a
    barrier; each says which side it is on when that takes long."""
    cache = configs.data.data_cache_path or "next to the --data-path files"
    if dist.get_rank() == 0:
        return StallWatch("building the datasets", f"writing the dataset index files ({cache}) "
                          "for the samples --train-iters and --eval-iters ask for; the other "
                          "ranks wait for this rank")
    return StallWatch("building the datasets", "waiting in a barrier for rank 0 to write the "
                      f"dataset index files ({cache}); rank 0's log says what it does")


def _require_optimizer_instance_support(configs: TrainerConfigs) -> None:
    """megatron-core builds the groups of several optimizer instances with einops and
    reduces between them on a CUDA stream."""
    instances = configs.parallel.num_distributed_optimizer_instances
    if instances > 1 and importlib.util.find_spec("einops") is None:
        raise ArgumentError(f"--num-distributed-optimizer-instances {instances}: the einops "
                            "package is not importable here (pip install einops)")
    if instances > 1 and not fast_path.on_gpu(configs.parallel, fast_path.Machine.detect()):
        raise ArgumentError(f"--num-distributed-optimizer-instances {instances} needs GPUs "
                            "(megatron-core reduces between the instances on a CUDA stream)")


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


def forward_backward_func(configs: TrainerConfigs, weight_grads: WeightGradStore | None = None,
                          pod: str | None = None, emulation=None):
    """The pipeline schedule: DPP's with --use-dpp (its options resolved once, in
    TrainerConfigs), else megatron-core's."""
    if configs.schedule.use_dpp:
        from megatron.dpp.schedule import DppSchedule

        return DppSchedule(configs.dpp, weight_grads, pod, emulation)
    if weight_grads is not None:
        return SplitBackwardNoPipelining(weight_grads)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()
