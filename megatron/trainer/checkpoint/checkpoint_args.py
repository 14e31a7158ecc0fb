"""--use-checkpoint-args: the model's arguments come from the checkpoint that --load resumes.

Megatron-LM's rules (its checkpointing.py `load_args_from_checkpoint`), applied to the parsed
flags before they are validated, so before anything is built from them:
* FILLED_IN: the checkpoint's value where the command line gives none (--num-layers,
  --hidden-size, ...); a command-line value that differs is kept, with a warning.
* REPLACED: the checkpoint's value replaces the command line's (normalization, position
  embedding, activation, dropout, ...).
* TOKENIZER (unless --no-use-tokenizer-model-from-checkpoint-args) and, with
  --use-mp-args-from-checkpoint-args, PARALLEL: replaced as well.
Each value that changes is logged. --load without any checkpoint keeps the command line's
values (with a warning, as Megatron-LM); a checkpoint that holds no arguments is an error
naming it. The flags are saved under "args": in our checkpoints, a dict of plain values
(checkpoint_config.plain_args) before megatron_lm_format.py, an argparse.Namespace of them
since; in Megatron-LM's, its Namespace. torch_dist's common state is read safely
(checkpoint_trust.load_common_state: argparse.Namespace is allowed, not arbitrary classes).
"""

from __future__ import annotations

import argparse
import logging
import os

from megatron.trainer.checkpoint import torch_checkpoint
from megatron.trainer.checkpoint.checkpoint_config import CheckpointConfig
from megatron.trainer.checkpoint.checkpoint_load import checkpoint_format, load_root
from megatron.trainer.checkpoint.checkpoint_publish import (
    CheckpointError,
    checkpoint_dir,
    latest_iteration,
)
from megatron.trainer.checkpoint.checkpoint_trust import (
    CommonStateRefused,
    load_common_state,
    untrusted_problem,
)

log = logging.getLogger(__name__)

FILLED_IN = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
             "kv_channels", "max_position_embeddings")
REPLACED = (
    "num_query_groups", "group_query_attention", "position_embedding_type",
    "use_rotary_position_embeddings", "rotary_base", "rotary_percent", "rotary_interleaved",
    "disable_bias_linear", "squared_relu", "swiglu", "untie_embeddings_and_output_weights",
    "apply_layernorm_1p", "normalization", "apply_query_key_layer_scaling", "attention_dropout",
    "hidden_dropout", "spec",
)
# the tokenizer's type and model replace the command line's; NullTokenizer's --vocab-size
# (not restored by Megatron-LM, whose NullTokenizer runs give it) is filled in
TOKENIZER_REPLACED = ("tokenizer_type", "tokenizer_model")
TOKENIZER_FILLED_IN = ("vocab_size",)
PARALLEL_REPLACED = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "virtual_pipeline_model_parallel_size")
PARALLEL_FILLED_IN = ("num_layers_per_virtual_pipeline_stage",)


def apply_checkpoint_args(args) -> None:
    """Set `args` from the arguments saved in --load's latest checkpoint, as the module says."""
    found = read_checkpoint_args(args)
    if found is None:
        log.warning("--use-checkpoint-args: no checkpoint under %s; the command line's "
                    "arguments are used", args.load)
        return
    path, saved = found
    filled, replaced = list(FILLED_IN), list(REPLACED)
    if args.use_tokenizer_model_from_checkpoint_args:
        filled += TOKENIZER_FILLED_IN
        replaced += TOKENIZER_REPLACED
    if args.use_mp_args_from_checkpoint_args:
        filled += PARALLEL_FILLED_IN
        replaced += PARALLEL_REPLACED
    for name in filled:
        _take(args, saved, name, path, replace=False)
    for name in replaced:
        _take(args, saved, name, path, replace=True)


def read_checkpoint_args(args) -> tuple[str, dict] | None:
    """(path, saved arguments) of the checkpoint that --load would resume; None when there
    is none. Read before any process group exists: torch_dist's common state, or the
    torch format's file of model-parallel rank 0."""
    config = CheckpointConfig.from_args(args)
    root = load_root(config)
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(f"{root} names iteration {iteration} but {path} is missing")
    problem = None if config.trust else untrusted_problem(root, path)
    if problem is not None:
        raise CheckpointError(f"--use-checkpoint-args: {problem}")
    try:
        if checkpoint_format(path, config) == "torch":
            state = torch_checkpoint.load_first_rank_file(path, config.trust)
        else:
            state = load_common_state(path)
    except CheckpointError:
        raise
    except CommonStateRefused as error:
        raise CheckpointError(f"--use-checkpoint-args: {error}") from error
    except Exception as error:
        raise CheckpointError(f"--use-checkpoint-args: reading {path} failed: "
                              f"{type(error).__name__}: {error}") from error
    saved = state.get("args") if isinstance(state, dict) else None
    if saved is None:
        raise CheckpointError(f"--use-checkpoint-args: {path} holds no saved arguments (it was "
                              "written without them); give the model's flags instead")
    saved = dict(vars(saved)) if isinstance(saved, argparse.Namespace) else dict(saved)
    if "disable_bias_linear" not in saved and "add_bias_linear" in saved:  # Megatron-LM's name
        saved["disable_bias_linear"] = not saved["add_bias_linear"]
    return path, saved


def _take(args, saved: dict, name: str, path: str, replace: bool) -> None:
    value = saved.get(name)
    if value is None:
        return  # not saved (another trainer, an older checkpoint): the command line's stays
    current = getattr(args, name)
    flag = "--" + name.replace("_", "-")
    if current == value:
        return
    if current is None or replace:
        setattr(args, name, value)
        given = "not given" if current is None else f"was {current}"
        log.info("--use-checkpoint-args: %s %s from %s (command line: %s)", flag, value, path,
                 given)
    else:
        log.warning("--use-checkpoint-args: %s %s on the command line differs from %s in %s; "
                    "the command line's is kept (as in Megatron-LM)", flag, current, value, path)
