"""The dataset index cache (--data-cache-path, else `cache/` beside the data): megatron.core
writes each split's document, sample and shuffle indices there as .npy files on first use
and memory-maps them on every later run. A file cut short (a full disk, a copy interrupted)
would stop the run deep in numpy ("mmap length is greater than file size"), and a cache
directory that cannot be written stops rank 0 in megatron.core's builder while the other
ranks wait; both are named here in one line with the fix."""

from __future__ import annotations

import contextlib
import errno
import glob
import math
import os

import numpy as np

from megatron.trainer.data.data import DataError

UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)


class IndexCacheError(DataError):
    """A cached index file that cannot be read, or a cache that cannot be written."""


def cache_files(data_cache_path: str | None, prefixes: list[str]) -> list[str]:
    """The .npy files of the cache a run with these flags reads."""
    if data_cache_path:
        return sorted(glob.glob(os.path.join(data_cache_path, "*.npy")))
    return sorted(path for prefix in prefixes for path in glob.glob(
        os.path.join(os.path.dirname(prefix) or ".", "cache", "*_indices", "*.npy")))


def file_problem(path: str) -> str | None:
    """What is wrong with one cached .npy file (None: its size is what its header says)."""
    try:
        with open(path, "rb") as stream:
            version = np.lib.format.read_magic(stream)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read_header(stream)
            data_start = stream.tell()
    except (OSError, ValueError) as error:
        return f"is not a readable .npy file ({error})"
    needed = data_start + math.prod(shape) * dtype.itemsize
    size = os.path.getsize(path)
    if size < needed:
        return f"is truncated: {size} bytes, its header needs {needed}"
    return None


def check_cache(data_cache_path: str | None, prefixes: list[str]) -> None:
    """Before the job starts, on every rank (each node may have a cache of its own)."""
    for path in cache_files(data_cache_path, prefixes):
        problem = file_problem(path)
        if problem is not None:
            raise IndexCacheError(f"{path} {problem}: delete it (the run writes it again)")


@contextlib.contextmanager
def write_errors_named(data_cache_path: str | None):
    """Around building the datasets: an index file that cannot be written is one line
    naming where the cache goes."""
    try:
        yield
    except Exception as failure:
        # megatron.core's builder raises a bare Exception from the OSError
        error = _unwritable(failure)
        if error is None:
            raise
        where = (f"--data-cache-path {data_cache_path}" if data_cache_path
                 else "the cache/ directory beside the --data-path files")
        raise IndexCacheError(f"cannot write to {where}: "
                        f"{error.strerror} ({error.filename}); give --data-cache-path a "
                        "writable directory") from failure


def _unwritable(error: BaseException | None) -> OSError | None:
    """The OSError of a write refused (read-only, no permission, full) in `error`'s chain."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in UNWRITABLE:
            return error
        error = error.__cause__ or error.__context__
    return None
