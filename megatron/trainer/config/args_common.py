"""Shared by the flag modules: the table their flags are declared in, the error for bad
flags, its one-line message, small checks."""

from __future__ import annotations

import ast

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


_TYPES = {"int": int, "float": float, "str": str}


def add_flags(group, table: dict) -> None:
    """Adds each flag of `table` to the argparse `group`, in the table's order.

    A key says what argparse needs beyond the name, in docs/flags.md's notation:
    "--name [--alias] [int|float|str] [{a,b,...}] [= default]". A name alone is a switch
    (store_true); a typed flag without "= default" defaults to None. A value is the help
    text (None: none), or argparse's keyword arguments (help included) for what a key
    cannot say: another dest, nargs, a metavar.
    """
    for key, value in table.items():
        kwargs = _flag_kwargs(key)
        if isinstance(value, dict):
            kwargs.update(value)
        elif value is not None:
            kwargs["help"] = value
        group.add_argument(*kwargs.pop("names"), **kwargs)


def _flag_kwargs(key: str) -> dict:
    spec, given, default = key.partition(" = ")
    words = spec.split()
    names = [word for word in words if word.startswith("-")]
    kind, choices = None, None
    for word in words[len(names):]:
        if word in _TYPES:
            kind = _TYPES[word]
        elif word.startswith("{") and word.endswith("}"):
            choices = word[1:-1].split(",")
        else:
            raise ValueError(f"flag table key {key!r}: {word!r} is neither a type nor choices")
    if kind is None and choices is None and not given:
        return {"names": names, "action": "store_true"}
    kwargs = {"names": names, "default": None}
    if kind in (int, float):
        kwargs["type"] = kind
        if choices is not None:
            choices = [kind(choice) for choice in choices]
        if given:
            kwargs["default"] = ast.literal_eval(default)  # 1000 stays an int, as written
    elif given:
        kwargs["default"] = default
    if choices is not None:
        kwargs["choices"] = choices
    return kwargs
