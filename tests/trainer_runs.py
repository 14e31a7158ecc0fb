"""Rank functions for the trainer tests: run megatron.trainer's real loop (`setup` +
`train`) and record what each iteration produced, plus the trainer's log records.

Several runs can share one process (`train_runs`): they share the default process group
and rebuild megatron.core's groups, which saves the ~4 s import and start-up per run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

TINY = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
    "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
    "--log-interval", "1",
]


def exact_vocab_configs(args):
    """The run's typed configurations with the model's vocabulary exactly --vocab-size, as
    the tests that build a model without a tokenizer want (setup pads the tokenizer's)."""
    from megatron.trainer.config.configs import TrainerConfigs

    configs = TrainerConfigs.from_args(args)
    return dataclasses.replace(configs, model=dataclasses.replace(
        configs.model, padded_vocab_size=args.vocab_size))


def with_flags(base: list[str], **overrides) -> list[str]:
    """`base` with each `--flag [values]` replaced or appended: `train_iters=4` gives
    `--train-iters 4`, a list gives several values, `True` a bare switch, `None` removes it."""
    flags = list(base)
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        if flag in flags:
            at = end = flags.index(flag)
            end += 1
            while end < len(flags) and not flags[end].startswith("--"):
                end += 1
            del flags[at:end]
        if value is True:
            flags.append(flag)
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.entries: list[tuple[str, str]] = []

    def emit(self, record):
        self.entries.append((record.levelname, record.getMessage()))


def task_by_name(name: str):
    if name == "gpt":
        from megatron.trainer.tasks.gpt import GPT_TASK

        return GPT_TASK
    from megatron.trainer.tasks.bert import BERT_TASK

    return BERT_TASK


def repeating(task, num_samples: int):
    """`task` whose training set is cut to its first `num_samples` samples, so that every
    global batch of that size is the same batch."""
    import torch

    def build_datasets(args, tokenizer):
        train, valid, test = task.build_datasets(args, tokenizer)
        return torch.utils.data.Subset(train, range(num_samples)), valid, test

    return dataclasses.replace(task, build_datasets=build_datasets)


def train_run(rank, flags, world_size, task_name="gpt", repeat=None):
    """Rank function: one `pretrain`-equivalent run; see `train_runs`."""
    return train_runs(rank, [flags], world_size, task_name, repeat)[0]


def train_runs(rank, runs, world_size, task_name="gpt", repeat=None, stopping=()):
    """Rank function: for each flag list, set up and train as `pretrain` does (on a training
    set of `repeat` samples when given). Returns one dict per run: `losses` (per iteration,
    this rank's reduced losses; empty off the last stage), `grad_norms`, `batches`,
    `planned_samples` (per iteration, the samples each data iterator that reads ahead has
    planned so far), `logs`
    ((level, message) of megatron.trainer), `state`; a run that raises one of the exception
    types `stopping` has `stopped` (the exception's text and `status`) instead of `state`."""
    import torch.distributed as dist

    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.run import initialize, training

    original_step = training.train_step
    # keep the default process group between runs (re-creating it in one process hangs in
    # gloo's rendezvous); megatron.core's groups are still rebuilt for every run
    initialize._shutdown = _destroy_model_parallel_only
    task = task_by_name(task_name)
    if repeat is not None:
        task = repeating(task, repeat)
    results = []
    for flags in runs:
        record = {"losses": [], "grad_norms": [], "batches": [], "planned_samples": []}

        def recording_step(trainer, iterator, readers=(), record=record):
            out = original_step(trainer, iterator, readers)
            record["losses"].append(out["losses"])
            record["grad_norms"].append(out["grad_norm"])
            record["batches"].append(out["batch"])
            # how far each reading-ahead data iterator has planned, after the step
            record["planned_samples"].append([reader.next_start for reader in readers])
            return out

        training.train_step = recording_step
        handler = _Records()
        logger = logging.getLogger("megatron.trainer")
        logger.addHandler(handler)
        try:
            args = parse_args(flags, world_size=world_size, model=task_name)
            with contextlib.ExitStack() as stack:
                trainer = training.setup(task, args, stack)
                training.train(trainer)
                record["state"] = vars(trainer.state).copy()
        except stopping as stop:
            record["stopped"] = (str(stop), getattr(stop, "status", None))
        finally:
            training.train_step = original_step
            logger.removeHandler(handler)
        record["logs"] = handler.entries
        results.append(record)
    dist.destroy_process_group()
    return results


def _destroy_model_parallel_only(exc_type=None, exc=None, traceback=None) -> bool:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return False
