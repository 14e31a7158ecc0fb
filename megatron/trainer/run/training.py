"""The training loop, top to bottom: set up (trainer_setup.py), then train / evaluate /
checkpoint / log.

`pretrain(task, argv)` is what pretrain_gpt.py and pretrain_bert.py call; a `ModelTask`
says what differs between models (stage builder, datasets, forward step).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.dpp import tracing
from megatron.dpp.tracing import NullTracer, Tracer
from megatron.trainer.checkpoint import checkpointing
from megatron.trainer.config.arguments import parse_args
from megatron.trainer.config.configs import TrainerConfigs
from megatron.trainer.core_compat.reruns import ResultValidationStop, stop_on_non_finite
from megatron.trainer.data.data import MicroBatchIterator, microbatch_lengths
from megatron.trainer.data.microbatches import (
    BatchLayout,
    DocumentMicrobatches,
    cost_ordered,
    padded_length,
    plan_global_batch,
    reorder_data_iterators,
)
from megatron.trainer.run import metrics, replica_check
from megatron.trainer.run.exit_signals import (
    StoppedBySignal,
    follow_torchrun,
    launched_by_torchrun,
)
from megatron.trainer.run.failures import exit_on_known_failures
from megatron.trainer.run.initialize import setup_logging
from megatron.trainer.run.intervals import IntervalCounters, report_interval, report_validation
from megatron.trainer.run.profiler import StepProfiler
from megatron.trainer.run.trainer import ModelTask, Trainer
from megatron.trainer.run.trainer_setup import setup

__all__ = ["ModelTask", "Trainer", "pretrain", "setup", "train"]

log = logging.getLogger("megatron.trainer")


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


def train(trainer: Trainer) -> None:
    """Iterations until --train-iters (or --exit-interval): a step, its counts, then what
    is due after it (the log line, evaluation, the replica check, a checkpoint, a stop on a
    signal); a last save at the end."""
    state, configs = trainer.state, trainer.configs
    schedule = configs.schedule
    train_set, valid_set, _ = trainer.datasets
    sources = data_iterators(trainer, train_set, state.consumed_samples)
    readers = [source for source in (sources if isinstance(sources, list) else [sources])
               if isinstance(source, DocumentMicrobatches)]
    iterator = trainer.reruns.data_iterators(sources)
    board = metrics.ScalarLog(configs.logging, trainer.reporting, _run_config(trainer))
    peak = metrics.peak_tflops(torch.cuda.get_device_name() if torch.cuda.is_available() else "")
    for chunk in trainer.model:
        chunk.train()
    start_tracing(trainer)
    profiler = StepProfiler(configs.profiling, dist.get_rank(), configs.logging.tensorboard_dir)
    nan_iterations = 0
    interval = IntervalCounters()
    while state.iteration < schedule.train_iters:
        trainer.batch_calculator.update(state.consumed_samples, True)
        profiler.step_begin(state.iteration + 1)
        result = train_step(trainer, iterator, readers)
        profiler.step_end(state.iteration + 1)
        _count_step(trainer, interval, result)
        if any(not math.isfinite(v) for v in result["losses"].values()):
            nan_iterations += 1
        if (state.iteration % configs.logging.log_interval == 0
                or state.iteration == schedule.train_iters):
            report_interval(trainer, interval, result, nan_iterations, board, peak)
            interval = IntervalCounters()
        if schedule.eval_interval and schedule.eval_iters and valid_set is not None and (
            state.iteration % schedule.eval_interval == 0
        ):
            _validate(trainer, valid_set, board)
        replica_interval = configs.process.check_weight_hash_across_dp_replicas_interval
        if replica_interval and state.iteration % replica_interval == 0:
            parallel = configs.parallel
            replica_check.check_replicas_agree(
                trainer.model, state.iteration,
                parallel.use_distributed_optimizer and parallel.overlap_param_gather)
        _checkpoint(trainer)
        if trainer.exit_signals is not None and state.iteration < schedule.train_iters:
            _stop_on_signal(trainer, trainer.exit_signals.agreed())
        if schedule.exit_interval and state.iteration % schedule.exit_interval == 0:
            break
    _finish(trainer, board)


def _count_step(trainer: Trainer, interval: IntervalCounters, result: dict) -> None:
    """The step's tokens and FLOPs into the interval's counters and the run's total, and
    the loop's position past the step."""
    state = trainer.state
    for length, rows, real in result["sequences"]:
        flops = length * rows * metrics.flops_per_token(trainer.configs, length)
        interval.add_microbatch(length * rows, real, flops)
        state.floating_point_operations += flops
    state.iteration += 1
    trainer.collector.after_step(state.iteration)
    trainer.memory_history.after_step(state.iteration)
    state.consumed_samples += result["batch"]
    interval.iterations += 1


def _validate(trainer: Trainer, valid_set, board: metrics.ScalarLog) -> None:
    """--eval-interval: --eval-iters batches of the validation set, each evaluation reading
    on from where the previous one stopped."""
    schedule, iteration = trainer.configs.schedule, trainer.state.iteration
    consumed = (iteration // schedule.eval_interval - 1) * schedule.eval_iters * (
        schedule.eval_global_batch_size or schedule.global_batch_size)
    with trainer.collector.evaluation():
        results = evaluate(trainer, valid_set, consumed)
    report_validation(trainer, results, board)


def _finish(trainer: Trainer, board: metrics.ScalarLog) -> None:
    """After the last iteration: save it unless just saved, publish every save, close the
    trace and the scalar writers, and meet the other ranks."""
    checkpoint, state = trainer.configs.checkpoint, trainer.state
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


def data_iterators(trainer: Trainer, dataset, consumed_samples: int):
    """One iterator per local model chunk; None where the chunk needs no data (neither the
    first nor the last virtual stage reads the batch)."""
    configs = trainer.configs
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
                seq_length_cv=data.seq_length_cv, seed=configs.process.seed,
                num_workers=data.num_workers, pad_to_multiple=data.pad_to_multiple,
                vocab_size=configs.model.padded_vocab_size))
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
    rows = configs.schedule.micro_batch_size * configs.parallel.data_parallel_size
    lengths = microbatch_lengths(consumed_samples, global_batch, rows, configs.model.seq_length,
                                 data.seq_length_cv, configs.process.seed)
    padded = [padded_length(length, data.pad_to_multiple, configs.model.seq_length)
              for length in lengths]
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
    trainer.tracer = _open_tracer(trainer)
    traced = trainer.tracer.megatron_timers(label_compute=not trainer.configs.schedule.use_dpp)
    # megatron-core's timers go to --timing-log-level's Timers, which pass them on to the
    # tracer's
    trainer.timers.inner = traced
    if traced is not None or trainer.timers.level >= 1:
        trainer.config.timers = trainer.timers
    if hasattr(trainer.schedule, "tracer"):
        trainer.schedule.tracer = trainer.tracer


def _open_tracer(trainer: Trainer) -> Tracer | NullTracer:
    settings, schedule = trainer.configs.profiling, trainer.configs.schedule
    if not settings.trace:
        return NullTracer()
    chunks = len(trainer.model)
    if schedule.use_dpp:
        name = "dpp"
    else:
        pipelined = trainer.configs.parallel.pipeline_model_parallel_size > 1
        name = "interleaved" if chunks > 1 else "1f1b" if pipelined else "none"
    slack = trainer.configs.dpp.slack if schedule.use_dpp else None
    return tracing.open_tracer(trainer.device, chunks, name, slack, settings.trace_dir,
                               settings.trace_iters)


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


def _run_config(trainer: Trainer) -> dict:
    """The flags as W&B's run configuration (plain values only), with the rank and the
    padded vocabulary the run settled."""
    return {**trainer.configs.flags, "rank": dist.get_rank(),
            "padded_vocab_size": trainer.configs.model.padded_vocab_size}


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
