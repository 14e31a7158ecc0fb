"""What the loop runs on: a model family's `ModelTask` and the `Trainer` that setup builds
(trainer_setup.py) and train() drives (training.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.dpp import tracing
from megatron.trainer.checkpoint import checkpointing
from megatron.trainer.config.configs import TrainerConfigs
from megatron.trainer.core_compat.planned_p2p import PlannedShapes
from megatron.trainer.core_compat.reruns import RerunConfig, ResultValidation
from megatron.trainer.run import core_args
from megatron.trainer.run.emulation import Stragglers
from megatron.trainer.run.exit_signals import ExitSignals
from megatron.trainer.run.manual_gc import ManualGC
from megatron.trainer.run.memory_history import MemoryHistory
from megatron.trainer.run.rng import ForwardRng
from megatron.trainer.run.timers import Timers


@dataclass
class ModelTask:
    """What a model family brings to the shared loop."""

    name: str
    build_stage: Callable  # (configs, config, pre_process, post_process, vp_stage) -> module
    build_datasets: Callable  # (args, tokenizer) -> (train, valid, test)
    make_forward_step: Callable  # (args, device) -> forward_step_func(data_iterator, model)
    loss_names: tuple[str, ...]
    data_on_every_stage: bool = False  # BERT: every stage needs the padding mask
    masked_attention: bool = False  # BERT: its blocks take the padding mask (fast_path.py)
    documents: bool = False  # its datasets read --variable-seq-lengths' documents (GPT)
    splits_by_document: bool = False  # --split cuts documents (BERT), not sequences (GPT)


@dataclass
class Trainer:
    args: object  # the parsed flags, handed on only through core_args.py
    task: ModelTask
    device: torch.device
    model: list
    optimizer: object
    scheduler: object
    config: object
    batch_calculator: object
    datasets: tuple
    state: checkpointing.TrainingState
    schedule: Callable
    rng: ForwardRng
    configs: TrainerConfigs  # the flags by topic, what the loop reads
    timers: Timers
    tracer: object = field(default_factory=tracing.NullTracer)  # --trace: see start_tracing
    collector: ManualGC = field(default_factory=lambda: ManualGC(enabled=False))
    # --record-memory-history: the allocator's snapshot after chosen iterations
    memory_history: MemoryHistory = field(
        default_factory=lambda: MemoryHistory(False, "", 0, 1))
    checkpointer: checkpointing.Checkpointer | None = None  # None: no --save / --load
    # --rerun-mode: megatron-core's rerun state machine (installed by setup)
    reruns: ResultValidation = field(default_factory=lambda: ResultValidation(RerunConfig()))
    # --cuda-graph-impl block: each transformer block's graphs (model/cuda_graphs.py), and
    # whether the ranks have met after the first step's recordings (record_warm_shapes)
    block_graphs: list = field(default_factory=list)
    graphs_settled: bool = False
    # megatron-core's schedule told each microbatch's shape by the plan, or given emulated
    # links (None: megatron-core's own p2p)
    planned_shapes: PlannedShapes | None = None
    stragglers: Stragglers | None = None  # --emulate-straggler
    exit_signals: ExitSignals | None = None  # --exit-signal-handler

    @property
    def reporting(self) -> bool:
        """The last rank reports losses (it is on the last pipeline stage)."""
        return dist.get_rank() == dist.get_world_size() - 1

    def forward_step_func(self, iteration: int) -> Callable:
        """The model's forward step for one schedule call of `iteration`, its random draws
        keyed by (seed, iteration, microbatch, virtual stage)."""
        step = self.rng.keyed(core_args.make_forward_step(self.task, self.args, self.device),
                              iteration)
        return step if self.stragglers is None else self.stragglers.wrap(step)
