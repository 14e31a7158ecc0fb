"""One-line messages from the errors of torch.distributed and of I/O: the gist of an error,
and whether it means a peer rank died. Used by the transport (megatron/dpp/transport/) and by
the trainer's checkpointing and failure reports, so neither reaches into the other for them.
"""

from __future__ import annotations

import re

import torch.distributed

# gloo's errors start with the C++ source location and end with advice
_SOURCE_LOCATION = re.compile(r"^\[[^\]]+\.(?:cc|cpp|h):\d+\]\s*")
_ADVICE = ". This is typically caused"


def brief(error: BaseException) -> str:
    """An error's gist for a one-line message: its first line, without the source location
    and the advice of torch.distributed's gloo errors."""
    lines = str(error).strip().splitlines()
    line = _SOURCE_LOCATION.sub("", lines[0] if lines else "").split(_ADVICE)[0]
    return line or type(error).__name__


def peer_failure(error: BaseException) -> bool:
    """Whether a torch.distributed operation failed because a peer rank died, closed its
    connection or did not answer in time (NCCL: a DistError; gloo: its TCP transport)."""
    return isinstance(error, torch.distributed.DistError) or (
        isinstance(error, RuntimeError) and "gloo/transport" in str(error))
