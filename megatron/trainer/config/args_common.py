"""Shared by the flag modules: the error for bad flags, its one-line message, small checks."""

from __future__ import annotations

# --pad-to-multiple's default on GPU: at --seq-length 2048, 16 shapes (buckets)
GPU_PAD_TO_MULTIPLE = 128


class ArgumentError(ValueError):
    """Inconsistent or unsupported flags; the message names each flag and value."""


def one_line(problems: list[str]) -> str:
    """The flag problems as one line: every rank of a job prints it, and the launch scripts
    show a repeated line once."""
    return problems[0] if len(problems) == 1 else "invalid arguments: " + "; ".join(problems)


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
