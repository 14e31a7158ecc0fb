"""What is wrong with a torch_dist checkpoint that does not load, in one line naming the file.

Before megatron.core reads a checkpoint, `torch_dist_problem` looks at its files cheaply: the
files every torch_dist checkpoint has (metadata.json, .metadata, and common.pt where the common
state is not stored in the shard files, as megatron.core >= 0.19 stores it), and the shard
files that .metadata names, each at least as long as the last byte it points into. A
deleted, truncated or overwritten file is then named instead of surfacing, deep in torch's
reader, as a bare EOFError. After a failed load `load_failure` turns megatron.core's or
torch.distributed.checkpoint's error (which wraps every rank's) into one line: a tensor of
another shape by its name and both shapes, with the model flags that differ from the
checkpoint's, or a checkpoint saved without optimizer state loaded with it.
"""

from __future__ import annotations

import json
import os
import re
import zipfile

from megatron.core.dist_checkpointing.core import CheckpointingException
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from megatron.dpp.errors import brief

CONFIG_FILE = "metadata.json"  # megatron.core's: which backends wrote the checkpoint
COMMON_FILE = "common.pt"  # megatron.core's: the state every rank shares (torch.save)
# megatron.core >= 0.19 writes no common.pt: the common state is one ShardedObject of the shard
# files, under this key of .metadata (its bytes: torch.save of a one-element list)
EMBEDDED_COMMON_KEY = "common_state/shard_0_1"
METADATA_FILE = ".metadata"  # torch.distributed.checkpoint's: where each tensor's bytes lie
RNG_KEY = "rng_state"  # the ShardedObject of every rank's RNG states
# the flags that set the model's tensor shapes (as --use-checkpoint-args fills them in)
SHAPE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
               "num_query_groups", "kv_channels", "seq_length", "max_position_embeddings",
               "vocab_size", "padded_vocab_size", "swiglu", "untie_embeddings_and_output_weights",
               "position_embedding_type", "normalization", "disable_bias_linear",
               "num_experts", "multi_latent_attention")
_SHAPE_MISMATCH = re.compile(r"Global shape mismatch for loaded \((?:torch\.Size\()?\(?\[?"
                             r"([^\])]*)\]?\)?\) and expected \(\(?([^)]*)\)?\) tensor for key "
                             r"(\S+)")


def torch_dist_problem(path: str) -> str | None:
    """What makes the torch_dist checkpoint at `path` unreadable (one line naming the file),
    or None where its files look whole."""
    names = set(os.listdir(path))
    if not names:
        return f"{path} is empty (no checkpoint files in it: an interrupted copy?)"
    for name in (CONFIG_FILE, METADATA_FILE):
        if name not in names:
            return f"{os.path.join(path, name)} is missing (every torch_dist checkpoint has it)"
    config = os.path.join(path, CONFIG_FILE)
    try:
        with open(config) as handle:
            json.load(handle)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return f"{config} is not valid JSON ({brief(error)})"
    metadata = os.path.join(path, METADATA_FILE)
    try:
        read = FileSystemReader(path).read_metadata()
    except Exception as error:  # unpickling a damaged file raises whatever the bytes make
        return f"{metadata} is unreadable (truncated or overwritten?): {_named(error)}"
    common = os.path.join(path, COMMON_FILE)
    if COMMON_FILE in names:
        try:
            with zipfile.ZipFile(common) as archive:
                damaged = archive.testzip()
        except (OSError, zipfile.BadZipFile, EOFError) as error:
            return f"{common} is not a file of torch.save (garbage or truncated: {brief(error)})"
        if damaged is not None:
            return f"{common} is damaged: its entry {damaged} fails its CRC check"
    elif EMBEDDED_COMMON_KEY not in read.state_dict_metadata:
        return (f"{common} is missing and {metadata} names no common state in the shard files "
                "(every torch_dist checkpoint has one or the other)")
    return _shard_problem(path, read.storage_data)


def has_embedded_common_state(path: str) -> bool:
    """Whether the torch_dist checkpoint at `path` keeps its common state in its shard files
    (megatron.core >= 0.19) rather than in common.pt."""
    if os.path.exists(os.path.join(path, COMMON_FILE)):
        return False
    return EMBEDDED_COMMON_KEY in FileSystemReader(path).read_metadata().state_dict_metadata


def _shard_problem(path: str, storage: dict) -> str | None:
    """A shard file that .metadata names but that is missing or shorter than its data."""
    needed: dict[str, int] = {}
    for info in storage.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        shard = os.path.join(path, name)
        try:
            size = os.path.getsize(shard)
        except FileNotFoundError:
            return f"{shard} is missing ({METADATA_FILE} names it)"
        if size < end:
            return (f"{shard} is truncated: {size} bytes, but {METADATA_FILE} places data up "
                    f"to byte {end}")
    return None


def saved_rng_layout(path: str) -> tuple[int, ...] | None:
    """The parallel layout the RNG states of the torch_dist checkpoint at `path` were saved
    in: the global shape in the key of their ShardedObject (`rng_state/shard_<at>_<shape>`),
    None where it holds none."""
    keys = FileSystemReader(path).read_metadata().state_dict_metadata
    for key in keys:
        if key.startswith(RNG_KEY + "/shard_"):
            return tuple(int(size) for size in key.rsplit("_", 1)[1].split("."))
    return None


def load_failure(path: str, error: BaseException, strictness: str, saved_args: dict | None,
                 run_args: dict | None) -> str:
    """One line for megatron.core's load of `path` failing with `error`. `saved_args`: the
    flags saved in the checkpoint, where it could be read; `run_args`: this run's."""
    causes = _rank_errors(error)
    for cause in causes:
        match = _SHAPE_MISMATCH.search(str(cause))
        if match:
            loaded, expected, key = match.groups()
            message = (f"{path} holds another model: tensor {key} is [{_dims(loaded)}] in the "
                       f"checkpoint but [{_dims(expected)}] in this model")
            differing = _differing_flags(saved_args, run_args)
            if differing:
                message += f" (flags that differ, this run vs checkpoint: {differing})"
            return message
    if _lacks_optimizer_state(path, causes):
        return (f"{path} holds no optimizer state (saved with --no-save-optim): resume from it "
                "with --no-load-optim (a new optimizer state), or from a checkpoint saved "
                "with one")
    described = "; ".join(dict.fromkeys(_named(cause) for cause in causes))
    return f"loading {path} (--dist-ckpt-strictness {strictness}) failed: {described}"


def _lacks_optimizer_state(path: str, causes: list[BaseException]) -> bool:
    """Whether the load failed looking up an optimizer tensor in a checkpoint that holds
    none (megatron.core's KeyError names the first missing key and lists every saved one)."""
    if not any(isinstance(cause, KeyError) and str(cause).strip("'\"").startswith("optimizer.")
               for cause in causes):
        return False
    try:
        keys = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception:  # unreadable: the general message says what failed
        return False
    return not any(key.startswith("optimizer.") for key in keys)


def _rank_errors(error: BaseException) -> list[BaseException]:
    """The errors of every failing rank inside torch.distributed.checkpoint's exception."""
    if isinstance(error, CheckpointException) and error.failures:
        return [wrapped[0] for _, wrapped in sorted(error.failures.items())]
    return [error]


def _named(error: BaseException) -> str:
    text = " ".join(str(error).split())
    if isinstance(error, CheckpointingException):
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _dims(text: str) -> str:
    return ", ".join(part.strip() for part in text.split(",") if part.strip())


def _differing_flags(saved: dict | None, current: dict | None) -> str:
    if not saved or not current:
        return ""
    return ", ".join(
        f"--{name.replace('_', '-')} {current[name]} vs {saved[name]}" for name in SHAPE_FLAGS
        if name in saved and name in current and saved[name] != current[name])
