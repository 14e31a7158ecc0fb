"""Random draws of a forward keyed by what the forward computes, not by when it runs.

Dropout draws from the generators megatron-core's layers use: torch's default generator on
CPU; on GPU the CUDA default generator and the streams of megatron-core's RNG tracker (the
model-parallel stream differs between tensor-parallel ranks, the default one does not).
Consumed in the order tasks run, the masks would change with that order, which under DPP
depends on arrival times. `ForwardRng` reseeds those generators immediately before every
forward of a model chunk from (seed, iteration, microbatch, virtual stage), so a run is
reproducible and equals megatron-core's schedules on the same layout. Activation
recomputation saves and restores the generators' states, so it replays the same draws;
CUDA graph replays read the generator's seed and offset when they are launched, and the
reseed happens before the chunk's forward, never inside a capture.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.utils import get_attr_wrapped_model

# megatron-core's tracker streams (tensor_parallel.random); other names get a stream of
# their own that is the same on every tensor-parallel rank
_MODEL_PARALLEL = "model-parallel-rng"
_EXPERT_PARALLEL = "expert-parallel-rng"


class ForwardRng:
    """One per rank. `keyed(forward_step_func, iteration)` wraps a schedule's forward step
    so that each call reseeds first; the microbatch is the one megatron-core's forward_step
    hands the chunk's transformer layers (`current_microbatch`), which both megatron-core's
    schedules and DPP set to the real microbatch id."""

    def __init__(self, seed: int, device: torch.device):
        self.seed = seed
        self.device = device
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.expert_ranks = (parallel_state.get_expert_model_parallel_rank(),
                             parallel_state.get_expert_tensor_parallel_rank())
        if device.type == "cuda":
            self._default = torch.cuda.default_generators[device.index or 0]
            self._scratch = torch.Generator(device=device)  # builds tracker states
        else:
            self._default = torch.default_generator
        # forwards of chunks without transformer layers in the current schedule call
        self._counted: dict[int, int] = {}
        # (iteration, microbatch, virtual stage) of the forward step running or last run
        self.current_key: tuple[int, int, int] | None = None

    def keyed(self, forward_step_func: Callable, iteration: int) -> Callable:
        """The forward step for one schedule call of training iteration `iteration`."""
        self._counted = {}

        def forward_step(data_iterator, model, *args):
            self.current_key = (iteration, self._microbatch(model), self._virtual_stage(model))
            self.reseed(*self.current_key)
            return forward_step_func(data_iterator, model, *args)

        return forward_step

    def reseed(self, iteration: int, microbatch: int, virtual_stage: int) -> None:
        """Host-side only: no device work, no synchronisation."""
        key = (self.seed, iteration, microbatch, virtual_stage)
        self._default.manual_seed(_hash(*key))
        if self.device.type != "cuda":
            return  # on CPU megatron-core's tracker forks nothing (initialize.set_seeds)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        states = tracker.get_states()
        for name, state in states.items():
            seed = _hash(*key, *self._stream(name))
            if isinstance(state, torch.Generator):
                state.manual_seed(seed)  # a graph-safe tracker's generator: keep the object
            else:
                self._scratch.manual_seed(seed)
                states[name] = self._scratch.get_state()
        tracker.set_states(states)

    def _stream(self, name: str) -> tuple:
        """What tells a tracker stream apart, as megatron-core's
        model_parallel_cuda_manual_seed derives its seeds."""
        if name == _MODEL_PARALLEL:
            return (1, self.tp_rank)
        if name == _EXPERT_PARALLEL:
            return (2, *self.expert_ranks)
        return (3, _hash_text(name))

    def _virtual_stage(self, model) -> int:
        vp_stage = get_attr_wrapped_model(model, "vp_stage")
        return (vp_stage or 0) * self.pp_size + self.pp_rank

    def _microbatch(self, model) -> int:
        layers = get_attr_wrapped_model(model, "decoder").layers
        if len(layers) > 0:
            return layers[0].current_microbatch
        # a chunk holding only the embedding (--account-for-embedding-in-pipeline-split) has
        # no layer that carries the id; the schedules run one chunk's forwards in microbatch
        # order (DPP's cost order of --seq-length-cv aside), so count them
        stage = self._virtual_stage(model)
        self._counted[stage] = self._counted.get(stage, 0) + 1
        return self._counted[stage] - 1


def _hash(*values: int) -> int:
    """A 63-bit seed from signed 64-bit integers."""
    digest = hashlib.blake2b(struct.pack(f"<{len(values)}q", *values), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _hash_text(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")
