"""Reproducible link and straggler profiles: what a slow network link and straggling stages
do to a pipeline's time, as pure functions of a seed, so that the simulator and an
emulating runtime draw exactly the same delays whatever order they ask in.

Link: a message on an affected edge becomes usable `delay_ms` + U(0, `jitter_ms`) +
bytes / `gbps` after it was sent (gbps: gigabits per second). Edges: `all` pipeline edges,
or `pods`: only those between pods (the stages split into `pods` equal consecutive groups,
as two nodes of a job hold the two halves of a pipeline).

Straggler: with probability `prob` a compute task (F, B or W) on one of `stages` (None: all)
takes `factor` times as long. Every draw is a hash of (seed, iteration, microbatch, stage,
task kind) (a message's of its edge and the task it feeds), never a position in a random
stream, so it does not depend on which rank asks first or how many draws came before.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

_SCALE = float(1 << 64)


def unit_draw(*key) -> float:
    """A number in [0, 1) that depends only on `key` (ints and strings)."""
    text = ":".join(str(part) for part in key).encode()
    return struct.unpack("<Q", hashlib.blake2b(text, digest_size=8).digest())[0] / _SCALE


def pod_of(stage: int, pp_size: int, pods: int) -> int:
    """The pod of a pipeline stage when `pods` equal groups of consecutive stages share a
    node (pod 0 holds the first stages)."""
    return stage * pods // pp_size


@dataclass(frozen=True)
class LinkProfile:
    """A slow link on some pipeline edges (see the module docstring)."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    gbps: float | None = None
    edges: str = "pods"
    pods: int = 2

    def __post_init__(self):
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError(f"link delay and jitter must be >= 0 ms, got {self.delay_ms}, "
                             f"{self.jitter_ms}")
        if self.gbps is not None and self.gbps <= 0:
            raise ValueError(f"link bandwidth must be > 0 Gbit/s, got {self.gbps}")
        if self.edges not in ("pods", "all"):
            raise ValueError(f"link edges {self.edges!r}: choose pods or all")
        if self.pods < 1:
            raise ValueError(f"pods must be >= 1, got {self.pods}")

    @classmethod
    def parse(cls, milliseconds: str, gbps: float | None = None, edges: str = "pods",
              pods: int = 2) -> LinkProfile:
        """From the command line's `D[,J]` (milliseconds)."""
        parts = milliseconds.split(",")
        try:
            values = [float(part) for part in parts]
        except ValueError:
            values = []
        if not 1 <= len(values) <= 2:
            raise ValueError(f"link delay {milliseconds!r}: expected D or D,J in milliseconds")
        return cls(values[0], values[1] if len(values) == 2 else 0.0, gbps, edges, pods)

    def affects(self, src: int, dst: int, pp_size: int) -> bool:
        """Whether the edge between pipeline stages src and dst is emulated."""
        if src == dst:
            return False
        return self.edges == "all" or (pod_of(src, pp_size, self.pods)
                                       != pod_of(dst, pp_size, self.pods))

    def mean_ms(self, nbytes: int = 0) -> float:
        """The mean time a message of `nbytes` spends on an affected edge."""
        return self.delay_ms + self.jitter_ms / 2 + self._transfer_ms(nbytes)

    def hop_ms(self, seed: int, iteration: int, src: int, dst: int, kind: str, chunk: int,
               microbatch: int, nbytes: int = 0) -> float:
        """The time from send to usable of the message from stage src to dst that feeds
        task (kind, chunk, microbatch) there."""
        jitter = 0.0
        if self.jitter_ms:
            jitter = self.jitter_ms * unit_draw("link", seed, iteration, src, dst, kind, chunk,
                                                microbatch)
        return self.delay_ms + jitter + self._transfer_ms(nbytes)

    def _transfer_ms(self, nbytes: int) -> float:
        return 0.0 if self.gbps is None else nbytes * 8e-6 / self.gbps

    def describe(self) -> str:
        jitter = f" + U(0, {self.jitter_ms:g}) ms" if self.jitter_ms else ""
        rate = f" + bytes / {self.gbps:g} Gbit/s" if self.gbps else ""
        return f"link {self.delay_ms:g} ms{jitter}{rate} on {self.edges} edges"


@dataclass(frozen=True)
class StragglerProfile:
    """Straggling compute tasks (see the module docstring); `stages` None: every stage."""

    prob: float
    factor: float
    stages: frozenset[int] | None = None

    def __post_init__(self):
        if not 0.0 <= self.prob <= 1.0:
            raise ValueError(f"straggler probability must be in [0, 1], got {self.prob}")
        if self.factor < 1.0:
            raise ValueError(f"straggler factor must be >= 1, got {self.factor}")

    @classmethod
    def parse(cls, text: str) -> StragglerProfile:
        """From the command line's STAGES:PROB:FACTOR (STAGES: `all` or stage numbers
        joined by commas)."""
        parts = text.split(":")
        if len(parts) != 3:
            raise ValueError(f"straggler {text!r}: expected STAGES:PROB:FACTOR, e.g. all:0.1:3")
        stages = None
        try:
            if parts[0] != "all":
                stages = frozenset(int(s) for s in parts[0].split(","))
            prob, factor = float(parts[1]), float(parts[2])
        except ValueError:
            raise ValueError(f"straggler {text!r}: STAGES is 'all' or stage numbers, PROB and "
                             "FACTOR numbers") from None
        if stages is not None and any(s < 0 for s in stages):
            raise ValueError(f"straggler {text!r}: stage numbers must be >= 0")
        return cls(prob, factor, stages)

    def factor_of(self, seed: int, iteration: int, microbatch: int, stage: int,
                  kind: str) -> float:
        """How many times its usual time this task takes (1 or `factor`)."""
        if self.stages is not None and stage not in self.stages:
            return 1.0
        hit = unit_draw("straggler", seed, iteration, microbatch, stage, kind) < self.prob
        return self.factor if hit else 1.0

    def describe(self) -> str:
        where = "all stages" if self.stages is None else "stages " + ",".join(
            map(str, sorted(self.stages)))
        return f"stragglers on {where}: p {self.prob:g}, x{self.factor:g}"
