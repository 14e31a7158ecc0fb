"""Reproducible link and straggler profiles: what a slow network link and straggling stages
do to a pipeline's time, as pure functions of a seed. The one model of both: the simulator
(sim/simulator.py) and the runtime's emulation below both schedules (transport/emulation.py)
take every delay and straggle factor from these draws, so that fed the same flags and seed
they apply exactly the same ones, whatever order they ask in.

Link: a message on an emulated edge becomes usable `delay_ms` + U(0, `jitter_ms`) +
bytes / `gbps` GB/s after it was sent. Edges: `all` pipeline edges, or `pods`: only those
between pods (at runtime the ranks' own pods; in the simulator the stages split into
`pods` equal consecutive groups, as two nodes of a job hold the two halves of a pipeline).
A message's draw is keyed by (seed, iteration, source stage, destination stage, and the
task it feeds there: kind, local chunk, microbatch).

Straggler: with probability `prob` a compute task (F, or a backward) on one of `stages`
(None: all) takes `factor` times as long; its draw is keyed by (seed, iteration, microbatch,
stage, local chunk, F or B). A split backward's W takes its B's draw, so that the same work
straggles under a schedule that splits the backward and one that runs it whole. A draw is a
hash of its key, never a position in a random stream, so it does not depend on which rank
asks first or how many draws came before.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

from megatron.dpp.actions import BACKWARD, WEIGHT

LINK_EDGES = ("pods", "all")
_SCALE = float(1 << 64)


def unit_draw(*key) -> float:
    """A number in [0, 1) that depends only on `key` (ints and strings)."""
    text = ":".join(str(part) for part in key).encode()
    return struct.unpack("<Q", hashlib.blake2b(text, digest_size=8).digest())[0] / _SCALE


def pod_of(stage: int, pp_size: int, pods: int) -> int:
    """The pod of a pipeline stage when `pods` equal groups of consecutive stages share a
    node (pod 0 holds the first stages)."""
    return math.floor(stage * pods / pp_size)


@dataclass(frozen=True)
class LinkProfile:
    """A slow link on some pipeline edges (see the module docstring); `gbps` in GB/s."""

    delay_ms: float
    jitter_ms: float = 0.0
    gbps: float | None = None
    edges: str = "pods"
    pods: int = 2

    def __post_init__(self):
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError(f"emulated link delay {self.delay_ms} ms, jitter {self.jitter_ms} "
                             "ms: both must be >= 0")
        if self.gbps is not None and self.gbps <= 0:
            raise ValueError(f"emulated link bandwidth {self.gbps} GB/s must be > 0")
        if self.edges not in LINK_EDGES:
            raise ValueError(f"emulated link edges {self.edges!r}: choose one of "
                             f"{', '.join(LINK_EDGES)}")
        if self.pods < 1:
            raise ValueError(f"pods must be >= 1, got {self.pods}")

    @classmethod
    def parse(cls, milliseconds: str, gbps: float | None = None, edges: str = "pods",
              pods: int = 2) -> LinkProfile:
        """From the command line's `D[,J]` (milliseconds)."""
        try:
            values = [float(part) for part in milliseconds.split(",")]
        except ValueError:
            values = []
        if len(values) not in (1, 2) or any(v < 0 for v in values):
            raise ValueError(f"--emulate-link-ms {milliseconds!r}: expected D or D,J "
                             "(milliseconds >= 0), e.g. 30 or 30,10")
        return cls(values[0], values[1] if len(values) == 2 else 0.0, gbps, edges, pods)

    def affects(self, src: int, dst: int, pp_size: int) -> bool:
        """Whether the edge between pipeline stages src and dst is emulated, its pods those
        of `self.pods` equal groups of stages (the simulator's view)."""
        if src == dst:
            return False
        return self.emulates(pod_of(src, pp_size, self.pods), pod_of(dst, pp_size, self.pods))

    def emulates(self, src_pod, dst_pod) -> bool:
        """Whether an edge from a rank of `src_pod` to one of `dst_pod` is emulated."""
        return self.edges == "all" or src_pod != dst_pod

    def mean_ms(self, nbytes: int = 0) -> float:
        """The mean time a message of `nbytes` spends on an emulated edge."""
        return self.delay_ms + self.jitter_ms / 2 + self._transfer_ms(nbytes)

    def hop_ms(self, seed: int, iteration: int, src: int, dst: int, kind: str, chunk: int,
               microbatch: int, nbytes: int = 0) -> float:
        """The time from send to usable of the message from stage src to dst that feeds
        task (kind, local chunk, microbatch) there."""
        jitter = 0.0
        if self.jitter_ms:
            jitter = self.jitter_ms * unit_draw("link", seed, iteration, src, dst, kind, chunk,
                                                microbatch)
        return self.delay_ms + jitter + self._transfer_ms(nbytes)

    def _transfer_ms(self, nbytes: int) -> float:
        return 0.0 if self.gbps is None else nbytes / (self.gbps * 1e6)

    def describe(self) -> str:
        text = f"link {self.delay_ms:g} ms"
        if self.jitter_ms:
            text += f" + U(0, {self.jitter_ms:g}) ms"
        if self.gbps:
            text += f" + size / {self.gbps:g} GB/s"
        return text + (" on every pipeline edge" if self.edges == "all"
                       else " on the edges between pods")


@dataclass(frozen=True)
class StragglerProfile:
    """Straggling compute tasks (see the module docstring); `stages` None: every stage."""

    stages: tuple[int, ...] | None
    prob: float
    factor: float

    def __post_init__(self):
        if not 0 <= self.prob <= 1:
            raise ValueError(f"straggler probability {self.prob} not in [0, 1]")
        if self.factor < 1:
            raise ValueError(f"straggler factor {self.factor} must be >= 1")
        if self.stages is not None and any(stage < 0 for stage in self.stages):
            raise ValueError(f"straggler stages {self.stages}: stage numbers are >= 0")

    @classmethod
    def parse(cls, text: str) -> StragglerProfile:
        """From the command line's STAGES:PROB:FACTOR (STAGES: `all`, a stage number or
        stage numbers joined by commas)."""
        problem = (f"--emulate-straggler {text!r}: expected STAGES:PROB:FACTOR (STAGES a stage "
                   "number, a comma list or all; PROB in [0, 1]; FACTOR >= 1), e.g. all:0.1:3")
        parts = text.split(":")
        if len(parts) != 3:
            raise ValueError(problem)
        try:
            stages = None if parts[0] == "all" else tuple(int(s) for s in parts[0].split(","))
            return cls(stages, float(parts[1]), float(parts[2]))
        except ValueError:
            raise ValueError(problem) from None

    def factor_of(self, seed: int, iteration: int, microbatch: int, stage: int, kind: str,
                  chunk: int = 0) -> float:
        """How many times its usual time task (kind, chunk, microbatch) of pipeline stage
        `stage` takes (1 or `factor`)."""
        if self.prob == 0 or (self.stages is not None and stage not in self.stages):
            return 1.0
        drawn = BACKWARD if kind == WEIGHT else kind  # a W is the rest of its backward
        hit = unit_draw("straggler", seed, iteration, microbatch, stage, chunk, drawn) < self.prob
        return self.factor if hit else 1.0

    def describe(self) -> str:
        where = "every stage" if self.stages is None else "stage " + ",".join(
            map(str, self.stages))
        return f"stragglers on {where}: p {self.prob:g}, x{self.factor:g}"


@dataclass(frozen=True)
class Emulation:
    """A run's emulated variability, seeded by `seed`; no link and no straggler: off."""

    seed: int
    link: LinkProfile | None = None
    straggler: StragglerProfile | None = None

    @property
    def active(self) -> bool:
        return self.link is not None or self.straggler is not None

    def describe(self) -> str:
        parts = [p.describe() for p in (self.link, self.straggler) if p is not None]
        return f"emulated: {'; '.join(parts)} (seed {self.seed}; time only, values untouched)"

    def link_between(self, src_pod, dst_pod) -> LinkProfile | None:
        """The profile of the link from a rank of `src_pod` to one of `dst_pod`, or None
        where that edge is not emulated."""
        if self.link is None or not self.link.emulates(src_pod, dst_pod):
            return None
        return self.link

    def delay_s(self, iteration: int, src: int, dst: int, kind: str, chunk: int,
                microbatch: int, nbytes: int) -> float:
        """Seconds from send to usable of the message from stage src to dst that feeds task
        (kind, chunk, microbatch) there (LinkProfile.hop_ms)."""
        return self.link.hop_ms(self.seed, iteration, src, dst, kind, chunk, microbatch,
                                nbytes) / 1000.0

    def straggle_factor(self, iteration: int, microbatch: int, stage: int, chunk: int,
                        kind: str) -> float:
        """How many times its usual time this task takes (StragglerProfile.factor_of)."""
        if self.straggler is None:
            return 1.0
        return self.straggler.factor_of(self.seed, iteration, microbatch, stage, kind, chunk)
