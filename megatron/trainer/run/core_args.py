"""The argparse Namespace below setup: the only places where the run hands the parsed flags
on rather than reading its typed configurations (config/configs.py); nothing below setup
reads or writes the Namespace itself.

The Namespace is needed here because the code on the other side is written against it, by
Megatron-LM's conventions: a model family's forward step and datasets are built from `args`
(pretrain_gpt.py's forward_step and train_valid_test_datasets providers).
"""

from __future__ import annotations


def make_forward_step(task, args, device):
    """The task's forward step (Megatron-LM's forward_step provider takes the Namespace)."""
    return task.make_forward_step(args, device)


def build_datasets(task, args, tokenizer):
    """The task's (train, valid, test) datasets (a train_valid_test_datasets provider)."""
    return task.build_datasets(args, tokenizer)

