"""--check-weight-hash-across-dp-replicas-interval N: every N iterations each rank hashes its
weights and the data-parallel replicas compare the hashes. Replicas that drifted apart (a
lost gradient reduction, a faulty GPU, a non-deterministic kernel in a replicated update)
stop the run with the ranks and the first parameters that differ, instead of training on
silently.
"""

from __future__ import annotations

import hashlib
import logging

import torch
import torch.distributed as dist
from megatron.core import parallel_state

log = logging.getLogger(__name__)

NAMED_AT_MOST = 3  # parameters named in the message


class ReplicaMismatch(RuntimeError):
    """Data-parallel replicas hold different weights; the message names ranks and weights."""


def weight_digests(model: list[torch.nn.Module]) -> list[tuple[str, str]]:
    """(chunk/parameter name, SHA-1 of its values as float32) for each parameter."""
    digests = []
    for index, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            values = param.detach().float().cpu().contiguous().numpy()
            digests.append((f"chunk {index} {name}", hashlib.sha1(values.tobytes()).hexdigest()))
    return digests


def check_replicas_agree(model: list[torch.nn.Module], iteration: int,
                         params_gathered_lazily: bool) -> None:
    """Raise ReplicaMismatch on every rank of a data-parallel group whose replicas differ.
    `params_gathered_lazily`: the distributed optimizer's all-gather waits for the next
    forward (--overlap-param-gather); it is completed first, as that forward would."""
    if params_gathered_lazily:
        for chunk in model:
            chunk.disable_forward_pre_hook()  # synchronous parameter all-gather
    try:
        group = parallel_state.get_data_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        local = weight_digests(model)
        gathered: list = [None] * len(ranks)
        dist.all_gather_object(gathered, local, group=group)
    finally:
        if params_gathered_lazily:
            for chunk in model:
                chunk.enable_forward_pre_hook()
    differing = [(name, {rank: theirs[i][1] for rank, theirs in zip(ranks, gathered, strict=True)})
                 for i, (name, _) in enumerate(local)
                 if len({theirs[i][1] for theirs in gathered}) > 1]
    if not differing:
        log.debug("iteration %d: weights equal on data-parallel ranks %s", iteration, ranks)
        return
    details = []
    for name, by_rank in differing[:NAMED_AT_MOST]:
        groups: dict[str, list[int]] = {}
        for rank, digest in by_rank.items():
            groups.setdefault(digest, []).append(rank)
        details.append(f"{name}: " + " vs ".join(f"ranks {members}" for members in
                                                    groups.values()))
    raise ReplicaMismatch(
        f"--check-weight-hash-across-dp-replicas-interval: after iteration {iteration} the "
        f"data-parallel replicas (global ranks {ranks}) hold different weights in "
        f"{len(differing)} of {len(local)} parameters; " + "; ".join(details))
