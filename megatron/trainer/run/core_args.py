"""The argparse Namespace below setup: the only places where the run hands on or writes the
parsed flags rather than reading its typed configurations (config/configs.py).

The Namespace is needed here because the code on the other side is written against it, by
Megatron-LM's conventions: a model family's forward step and datasets are built from `args`
(pretrain_gpt.py's providers), megatron.dpp's tracer reads --trace and DPP's flags from it,
and Megatron-LM code expects `args.rank` to hold the process's global rank once the job has
started.
"""

from __future__ import annotations

from megatron.dpp import tracing


def record_rank(args, rank: int) -> None:
    """Megatron-LM's initialisation sets `args.rank`; code written against its Namespace
    reads it there."""
    args.rank = rank


def make_forward_step(task, args, device):
    """The task's forward step (Megatron-LM's forward_step provider takes the Namespace)."""
    return task.make_forward_step(args, device)


def build_datasets(task, args, tokenizer):
    """The task's (train, valid, test) datasets (a train_valid_test_datasets provider)."""
    return task.build_datasets(args, tokenizer)


def open_tracer(args, device, num_chunks: int):
    """--trace's tracer for this rank: megatron.dpp reads its flags from the Namespace."""
    return tracing.open_tracer(args, device, num_chunks)
