"""How a rank ends on an error. A known failure (a bad flag, nodes given different settings,
bad data, tokenizer flags or files, a pipeline peer that failed or hung, a checkpoint that
cannot be written, a megatron-core whose internals moved, Ctrl-C, a stop on SIGTERM or SIGINT
under --exit-signal-handler) is reported in one line that names its cause, and the rank exits non-zero; its
traceback goes to the log at DEBUG (MEGATRON_LOG_LEVEL=DEBUG shows it). Anything else is a
bug and keeps its traceback.

Once torch.distributed is up, a failed rank leaves without Python's finalization: a
communication thread blocked on a hung or dead peer cannot be interrupted, and one that
wakes up while the interpreter shuts down aborts the process."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import traceback

import torch.distributed as dist

from megatron.dpp.compat.core_internals import CoreInternalsError
from megatron.dpp.errors import brief, peer_failure
from megatron.dpp.transport.channel import TransportError
from megatron.trainer.checkpoint.checkpoint_publish import CheckpointError
from megatron.trainer.config.arguments import ArgumentError
from megatron.trainer.core_compat.reruns import NonFiniteResult, ResultValidationStop
from megatron.trainer.data.batch_schedule import BatchScheduleError
from megatron.trainer.data.data import DataError
from megatron.trainer.data.index_cache import IndexCacheError
from megatron.trainer.data.tokenizer import TokenizerError, TokenizerFlagError
from megatron.trainer.model.models import ModelFlagError
from megatron.trainer.run.exit_signals import StoppedBySignal
from megatron.trainer.run.memory_history import MemorySnapshotError
from megatron.trainer.run.replica_check import ReplicaMismatch
from megatron.trainer.run.settings_agreement import SettingsMismatch

log = logging.getLogger("megatron.trainer.run.failures")

EXIT_FAILED = 1
EXIT_USAGE = 2  # argparse's
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def known_failure(error: BaseException) -> tuple[str, int] | None:
    """(one-line message, exit status) for a known failure; None for anything else."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (SIGINT)", EXIT_INTERRUPTED
    if isinstance(error, StoppedBySignal):
        return str(error), error.status
    if isinstance(error, SettingsMismatch):
        return str(error), EXIT_USAGE
    if isinstance(error, IndexCacheError):
        return f"dataset index cache: {error}", EXIT_FAILED
    if isinstance(error, DataError):
        return f"bad training data: {error}", EXIT_FAILED
    if isinstance(error, TokenizerError):
        return f"tokenizer: {error}", EXIT_FAILED
    if isinstance(error, TransportError):
        message = f"pipeline transport: {error}"
        if "shm_open of " in message and os.strerror(errno.ENOENT) in message:
            message += (" (the shm channels need the ranks of one host name to share /dev/shm;"
                        " containers on the host network with their own /dev/shm do not: give "
                        "them one, or use --dpp-transport torch)")
        return message, EXIT_FAILED
    if isinstance(error, CheckpointError):
        return f"checkpoint: {error}", EXIT_FAILED
    if isinstance(error, CoreInternalsError | BatchScheduleError | ReplicaMismatch
                  | NonFiniteResult | MemorySnapshotError):
        return str(error), EXIT_FAILED
    if isinstance(error, ResultValidationStop):  # Megatron-LM's exit statuses 16 and 17
        return str(error), error.status
    if peer_failure(error):
        return (f"a peer rank failed, disconnected or timed out in a collective operation: "
                f"{brief(error)}", EXIT_FAILED)
    return None


@contextlib.contextmanager
def exit_on_known_failures(program: str):
    """Around an entry point: a flag error prints `program: message` and exits 2 (as
    argparse); another known failure logs one ERROR line and exits 1 (130 on Ctrl-C)."""
    try:
        yield
    except (ArgumentError, TokenizerFlagError, ModelFlagError) as error:
        sys.stderr.write(f"{program}: {error}\n")
        raise SystemExit(EXIT_USAGE) from None
    except BaseException as error:
        if isinstance(error, SystemExit):
            raise
        known = known_failure(error)
        if known is None:
            if not dist.is_initialized():
                raise
            traceback.print_exception(error)
            _exit_now(EXIT_FAILED)
        message, status = known
        _log_at_configured_level()
        log.debug("traceback of the failure below", exc_info=error)
        log.error("%s", message.replace("\n", " "))
        if dist.is_initialized():
            _exit_now(status)
        raise SystemExit(status) from None


def _exit_now(status: int) -> None:
    """Exit without the interpreter's finalization (see the module docstring)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _log_at_configured_level() -> None:
    """The traceback is logged on every rank at DEBUG when MEGATRON_LOG_LEVEL asks for it
    (ranks other than the first and last log only warnings otherwise)."""
    level = logging.getLevelName(os.environ.get("MEGATRON_LOG_LEVEL", "INFO").upper())
    if isinstance(level, int):
        log.setLevel(level)
