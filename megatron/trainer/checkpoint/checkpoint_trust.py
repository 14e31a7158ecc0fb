"""What loading a checkpoint trusts, and what it refuses without --trust-checkpoint.

Loading unpickles: torch.distributed.checkpoint reads a torch_dist checkpoint's `.metadata`
and its ShardedObjects (the RNG states) with pickle, so a crafted file there runs code on
every rank. Those readers cannot be restricted, so their files are trusted only when no one
but this user could have written them: `untrusted_problem` refuses a checkpoint (the --load
directory, the iteration's directory, or any file or directory in it) that is
world-writable or owned by another user.

A torch_dist checkpoint's common state (the flags, counters, schedule: `common.pt`, or with
megatron.core >= 0.19 one object of the shard files) is read by `load_common_state` with
torch.load(weights_only=True), always: beyond tensors and plain
values it builds only `legacy_safe_globals` (argparse.Namespace, the Namespace Megatron-LM's
trainer saves its flags in) and what megatron.core registers with torch for its own
checkpoints; anything else is refused by name, --trust-checkpoint or not.

The legacy `--ckpt-format torch` files are read with torch.load(weights_only=True), allowing
by name only what Megatron-LM's checkpoints hold beyond tensors and plain values (numpy's
RNG state, argparse.Namespace and the enums its flags hold): a crafted pickle there is
refused whoever owns it. --trust-checkpoint lifts both (a checkpoint of a colleague on a
shared filesystem, a legacy file holding other classes).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import pickle
import re
import stat

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from megatron.trainer.checkpoint.checkpoint_files import (
    COMMON_FILE,
    EMBEDDED_COMMON_KEY,
    has_embedded_common_state,
)

TRUST_FLAG = "--trust-checkpoint"


def untrusted_problem(root: str, path: str) -> str | None:
    """Why the checkpoint at `path` (under --load `root`) cannot be trusted, or None."""
    me = os.geteuid()
    for candidate in _paths(root, path):
        try:
            info = os.lstat(candidate)
        except OSError:
            continue  # vanished or unreadable: the load itself will say so
        if info.st_mode & stat.S_IWOTH and not stat.S_ISLNK(info.st_mode):
            cause = "is world-writable"
        elif info.st_uid != me:
            cause = f"is owned by uid {info.st_uid}, not this user (uid {me})"
        else:
            continue
        return (f"refusing to load {path}: {candidate} {cause}, and loading a checkpoint "
                f"unpickles its files (a crafted one runs code on every rank); check it and "
                f"give {TRUST_FLAG} to load it anyway")
    return None


def _paths(root: str, path: str):
    yield root
    yield path
    for directory, names, files in os.walk(path):
        for name in names + files:
            yield os.path.join(directory, name)


def _optional(module: str, name: str):
    with contextlib.suppress(ImportError, AttributeError):
        return getattr(importlib.import_module(module), name)
    return None


def _numpy_reconstruct():
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        found = _optional(module, "_reconstruct")
        if found is not None:
            return found
    raise ImportError("numpy has no multiarray._reconstruct")


def legacy_safe_globals() -> list:
    """What torch.load(weights_only=True) may build beyond tensors and plain values: numpy
    arrays (the RNG state), argparse.Namespace (Megatron-LM's saved flags) and the enums
    among those flags."""
    reconstruct = _numpy_reconstruct()
    allowed = [argparse.Namespace, np.ndarray, np.dtype, type(np.dtype(np.uint32)),
               (reconstruct, "numpy.core.multiarray._reconstruct"),
               (reconstruct, "numpy._core.multiarray._reconstruct")]
    for module, name in (("megatron.core.transformer.enums", "AttnBackend"),
                         ("megatron.core.transformer.enums", "AttnMaskType"),
                         ("megatron.core.enums", "ModelType")):
        found = _optional(module, name)
        if found is not None:
            allowed.append(found)
    return allowed


def refused_global(error: BaseException) -> str | None:
    """The class or function a weights_only load refused, from torch's error."""
    match = re.search(r"GLOBAL ([\w.]+)", str(error))
    return match.group(1) if match else None


def load_common_state(path: str) -> dict:
    """The common state of the torch_dist checkpoint at `path`, read as the module says;
    CommonStateRefused names a class it holds that loading does not build."""
    if has_embedded_common_state(path):
        filename = f"{path} (its common state, {EMBEDDED_COMMON_KEY} in the shard files)"
        # megatron.core stores torch.save([state]) as it is; torch's own planner wraps those
        # bytes in one more torch.save (of the BytesIO): both are read
        state = _restricted_load(_embedded_common_bytes(path), filename,
                                 [*legacy_safe_globals(), io.BytesIO])
        if isinstance(state, io.BytesIO):
            state.seek(0)
            state = _restricted_load(state, filename, legacy_safe_globals())
        if not (isinstance(state, list) and len(state) == 1):
            raise CommonStateRefused(f"{filename} holds a {type(state).__name__}, not the "
                                     "one-element list megatron.core stores there")
        state = state[0]
    else:
        filename = os.path.join(path, COMMON_FILE)
        state = _restricted_load(filename, filename, legacy_safe_globals())
    if not isinstance(state, dict):
        raise CommonStateRefused(f"{filename} holds a {type(state).__name__}, not the dict "
                                 "of a checkpoint's common state")
    return state


def _restricted_load(source, filename: str, allowed: list):
    """torch.load(weights_only=True) of `source`, building beyond plain values only
    `allowed` and what megatron.core registers; a refusal names the class."""
    try:
        with _allowed(allowed):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        refused = refused_global(error)
        if refused is None:
            raise
        raise CommonStateRefused(
            f"{filename} holds {refused}, which loading does not build: a checkpoint's common "
            "state (the flags, argparse.Namespace included, and counters) holds plain values; "
            "a crafted pickle runs code") from error


class _RawBytesPlanner(DefaultLoadPlanner):
    """Keeps a stored object's bytes as they are: torch's default planner unpickles them
    with weights_only=False, which would run whatever a crafted checkpoint holds."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # into the caller's own BytesIO: the planner's dict may be a copy of the caller's
        target = self.state_dict[read_item.dest_index.fqn]
        target.write(value.read())
        target.seek(0)


def _embedded_common_bytes(path: str) -> io.BytesIO:
    """The bytes of the common state stored in the shard files, read without a process
    group."""
    wanted = {EMBEDDED_COMMON_KEY: io.BytesIO()}
    dcp.load(wanted, storage_reader=dcp.FileSystemReader(path),
             planner=_RawBytesPlanner(flatten_state_dict=False), no_dist=True)
    return wanted[EMBEDDED_COMMON_KEY]


class CommonStateRefused(ValueError):
    """A checkpoint's common state that loading does not read."""


def load_legacy_file(filename: str, trusted: bool, mmap: bool = False) -> dict:
    """torch.load of a legacy checkpoint file: restricted to `legacy_safe_globals` unless
    `trusted`."""
    if trusted:
        return torch.load(filename, map_location="cpu", weights_only=False, mmap=mmap)
    with _allowed(legacy_safe_globals()):
        return torch.load(filename, map_location="cpu", weights_only=True, mmap=mmap)


def _allowed(extra: list):
    """torch's safe_globals context for what `extra` adds to the process's allowed globals.
    (On leaving, torch's context removes every global it was given, also those registered
    before, such as megatron.core's own: so it is given only the missing ones.)"""
    present = torch.serialization.get_safe_globals()
    return torch.serialization.safe_globals([item for item in extra if item not in present])
