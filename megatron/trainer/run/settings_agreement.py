"""The settings every rank of a job must share, compared when the job starts.

Each node parses its own command line; two nodes given different flags (NUM_LAYERS=4 on one
launch script, 2 on the other) would otherwise build halves of two different models, or
stop in a collective whose sizes differ. Right after the ranks join, before anything is
built, every rank gathers every rank's settings (one all_gather_object over the default
group) and all stop with the same line naming each flag that differs and each node's value.

Compared: the model, parallelism, schedule (batches, iterations, DPP) and precision topics
(configs.py), the data apart from where it lies on a node (a prefix compares by its file
name and sizes), the optimizer, the seed, and the flags that decide when ranks meet (saving,
evaluation, logging collectives, --exit-signal-handler). Not compared: paths of a node's own
(checkpoints, caches, logs), timeouts, and the fast-path choices made per machine.
"""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

from megatron.trainer.config.configs import TrainerConfigs

# the compared topics of TrainerConfigs
TOPICS = ("model", "parallel", "schedule", "precision", "data")

# a node's own: its paths and waiting times
NODE_LOCAL = {"data_path", "data_blend", "data_cache_path", "num_workers",
              "distributed_timeout_minutes", "dpp_timeout", "distributed_backend"}
# derived from compared flags (named through them), or compared under another name
DERIVED = {"model", "world_size", "data_parallel_size", "num_microbatches", "params_dtype",
           "padded_vocab_size"}

FURTHER = (
    "seed", "optimizer", "lr", "min_lr", "lr_decay_style", "lr_decay_iters", "lr_decay_samples",
    "lr_warmup_iters", "lr_warmup_fraction", "lr_warmup_samples", "lr_warmup_init",
    "weight_decay", "start_weight_decay", "end_weight_decay", "weight_decay_incr_style",
    "clip_grad", "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum", "train_samples",
    "vocab_size", "save_interval", "non_persistent_save_interval", "log_interval",
    "log_throughput", "log_params_norm", "check_weight_hash_across_dp_replicas_interval",
    "exit_signal_handler",
)


class SettingsMismatch(Exception):
    """Ranks of one job were given different settings; the message names each."""


def settings_of(configs: TrainerConfigs) -> dict[str, str]:
    """Flag -> value (as text) of the settings that must agree, for this rank."""
    values = {field.name: getattr(topic, field.name)
              for topic in (getattr(configs, name) for name in TOPICS)
              for field in dataclasses.fields(topic) if field.name not in NODE_LOCAL | DERIVED}
    values.update({name: configs.flags[name] for name in FURTHER
                   if name in configs.flags and name not in values})
    settings = {"the entry point": f"pretrain_{configs.model.model}.py"}
    settings.update({_flag(name): _text(value) for name, value in values.items()})
    checkpoint, data_path = configs.checkpoint, configs.data.data_path
    settings["--save"] = "given" if checkpoint.save else "not given"
    settings["--load"] = "given" if checkpoint.load else "not given"
    if data_path:
        settings["--data-path"] = " ".join(_data_entry(entry) for entry in data_path)
    return settings


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _text(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def _data_entry(entry: str) -> str:
    """A blend's weight as it is; a prefix as its file name and its files' sizes (the paths
    of two nodes' checkouts differ)."""
    sizes = [os.path.getsize(entry + suffix) for suffix in (".bin", ".idx")
             if os.path.exists(entry + suffix)]
    if not sizes:
        return entry
    return f"{os.path.basename(entry)}({'/'.join(map(str, sizes))} bytes)"


def node_of(rank: int) -> int:
    """The node of this rank, as torchrun numbers them (GROUP_RANK), else as the ranks are
    laid out (LOCAL_WORLD_SIZE per node)."""
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"])
    return rank // int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)


def mismatch_message(gathered: list[tuple[int, dict[str, str]]]) -> str | None:
    """The line naming each setting that differs, from every rank's (node, settings) in rank
    order; None when all agree."""
    differing = []
    for flag in gathered[0][1]:
        values = {rank: settings.get(flag, "unset") for rank, (_, settings) in enumerate(gathered)}
        if len(set(values.values())) == 1:
            continue
        by_place: dict[str, list[str]] = {}
        for rank, value in values.items():
            by_place.setdefault(value, []).append(_place(gathered, rank))
        differing.append(f"{flag} " + ", ".join(
            f"{value} on {_join(places)}" for value, places in by_place.items()))
    if not differing:
        return None
    return ("the nodes were given different settings: " + "; ".join(differing)
            + " (start every node with the same flags and settings)")


def _place(gathered, rank: int) -> str:
    """'node N' where the whole node agrees, else 'rank R (node N)'."""
    node, settings = gathered[rank]
    same_node = [other for other, (n, _) in enumerate(gathered) if n == node]
    if all(gathered[other][1] == settings for other in same_node):
        return f"node {node}"
    return f"rank {rank} (node {node})"


def _join(places: list[str]) -> str:
    return ", ".join(dict.fromkeys(places))


def check_settings_agree(configs: TrainerConfigs) -> None:
    """On every rank, collectively, right after the ranks joined: raises SettingsMismatch
    (the same line on every rank) unless every rank has the same settings."""
    mine = (node_of(dist.get_rank()), settings_of(configs))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    message = mismatch_message(gathered)
    if message is not None:
        raise SettingsMismatch(message)
