"""Rank functions shared by the pipeline tests: run one training step's forward/backward
with a given schedule and report losses and gradients by layout-independent name."""

from __future__ import annotations

import contextlib

from megatron.dpp.weight_grad import WeightGradStore

TINY_GPT = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
    "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "128", "--make-vocab-size-divisible-by", "64", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--eval-iters", "0", "--log-interval", "1",
]


def unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def named_grads(trainer) -> dict:
    """Canonical parameter name -> (gradient, tensor-parallel split dim or -1)."""
    from megatron.trainer.model.models import _canonical_names

    tied = not trainer.args.untie_embeddings_and_output_weights
    grads = {}
    for chunk in trainer.model:
        for name, param in _canonical_names(unwrap(chunk), tied).items():
            grad = param.main_grad if getattr(param, "main_grad", None) is not None else param.grad
            split = getattr(param, "partition_dim", -1)
            split = split if getattr(param, "tensor_model_parallel", False) else -1
            grads[name] = (grad.detach().clone().float(), split)
    return grads


def one_step(trainer, schedule, num_microbatches: int, forward_only: bool = False,
             forward_step_func=None):
    """Losses (per microbatch on the last stage, [loss sum, tokens] of each loss) and
    gradients of one forward/backward over the first global batch (as iteration 1)."""
    import torch

    from megatron.trainer.run.training import data_iterators

    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    iterator = data_iterators(trainer, trainer.datasets[0], 0)
    args = trainer.args
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        out = schedule(
            forward_step_func=forward_step_func or trainer.forward_step_func(1),
            data_iterator=iterator, model=trainer.model, num_microbatches=num_microbatches,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.seq_length, forward_only=forward_only,
        )
    # per microbatch: [loss sum, tokens] of each of the task's losses
    names = trainer.task.loss_names
    losses = [[float(v) for name in names for v in entry[name]] for entry in out]
    return losses, ({} if forward_only else named_grads(trainer))


class RecordingWeightGradStore(WeightGradStore):
    """A WeightGradStore that records the keys of its B (deferring) and W (run) calls."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def deferring(self, key):
        self.calls.append(("B", key))
        return super().deferring(key)

    def run(self, key, parts=1):
        """A W in parts is recorded once, at its first part."""
        if ("W", key) not in self.calls:
            self.calls.append(("W", key))
        return super().run(key, parts)


def compare_schedules(rank, flags, world_size, task_name="gpt"):
    """Rank function: megatron-core's schedule and DPP (when pipelined) on the same model
    and batch, training and forward-only; with --dpp-split-backward DPP also runs with
    B and W tasks ("dpp_split", and the store's B / W calls and what is left pending)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.dpp.config import DppOptions
    from megatron.dpp.schedule import DppSchedule
    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.data.data import microbatch_lengths
    from megatron.trainer.run.training import setup

    args = parse_args(flags, world_size=world_size)
    with contextlib.ExitStack() as stack:
        trainer = setup(_task(task_name), args, stack)
        m = args.num_microbatches
        core = get_forward_backward_func()
        result = {
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
            "dp_rank": parallel_state.get_data_parallel_rank(),
        }
        result["core"] = one_step(trainer, core, m)
        result["core_eval"] = one_step(trainer, core, m, forward_only=True)[0]
        if args.pipeline_model_parallel_size > 1:
            dpp = DppSchedule(DppOptions.from_args(args))
            stack.callback(dpp.close)
            if args.seq_length_cv > 0:
                # as the trainer does: DPP orders the microbatches by their token counts
                dpp.set_microbatch_costs(microbatch_lengths(
                    0, args.global_batch_size, args.micro_batch_size * args.data_parallel_size,
                    args.seq_length, args.seq_length_cv, args.seed))
            result["dpp"] = one_step(trainer, dpp, m)
            result["dpp_eval"] = one_step(trainer, dpp, m, forward_only=True)[0]
            if args.dpp_split_backward:
                dpp.weight_grads = store = RecordingWeightGradStore()
                if args.seq_length_cv > 0:
                    dpp.set_microbatch_costs(microbatch_lengths(
                        0, args.global_batch_size, args.micro_batch_size * args.data_parallel_size,
                        args.seq_length, args.seq_length_cv, args.seed))
                result["dpp_split"] = one_step(trainer, dpp, m)
                result["split_calls"], result["split_pending"] = store.calls, store.pending()
        return result


def _task(name):
    if name == "gpt":
        from megatron.trainer.tasks.gpt import GPT_TASK

        return GPT_TASK
    from megatron.trainer.tasks.bert import BERT_TASK

    return BERT_TASK


def repeated_dpp_runs(rank, flag_sets, world_size, runs):
    """Rank function: for each flag list, megatron-core's schedule once, then one DPP step
    per (slack, jitter) of `runs` (each with its own transport, arrivals delayed by up to
    `jitter` milliseconds), all on the same model and batch, as iteration 1. Also returns
    the order in which this rank ran its forwards, as (chunk, microbatch), in each DPP step.
    One result per flag list."""
    import os

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.dpp.schedule import DppOptions, DppSchedule
    from megatron.dpp.transport.pipeline import JITTER_ENV
    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.run import initialize
    from megatron.trainer.run.training import setup
    from megatron.trainer.tasks.gpt import GPT_TASK
    from tests.trainer_runs import _destroy_model_parallel_only

    initialize._shutdown = _destroy_model_parallel_only  # several set-ups in one process
    results = []
    for flags in flag_sets:
        args = parse_args(flags, world_size=world_size)
        with contextlib.ExitStack() as stack:
            trainer = setup(GPT_TASK, args, stack)
            m = args.num_microbatches
            result = {"core": one_step(trainer, get_forward_backward_func(), m), "dpp": [],
                      "orders": []}
            for slack, jitter in runs:
                os.environ[JITTER_ENV] = str(jitter)
                forward_step, order = trainer.forward_step_func(1), []

                def recording(data_iterator, model, *rest, forward_step=forward_step,
                              order=order):
                    output = forward_step(data_iterator, model, *rest)
                    order.append((unwrap(model).vp_stage,
                                  unwrap(model).decoder.layers[0].current_microbatch))
                    return output

                dpp = DppSchedule(DppOptions(slack=slack, transport="torch"))
                try:
                    result["dpp"].append(one_step(trainer, dpp, m, forward_step_func=recording))
                finally:
                    dpp.close()
                result["orders"].append(order)
            results.append(result)
    return results
