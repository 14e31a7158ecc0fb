"""What the checkpoint code needs from the flags, read once into a frozen dataclass.

Megatron-LM's meaning of each flag, as implemented in megatron/trainer/checkpoint/checkpointing.py:
* `--ckpt-format torch_dist` (the default, as in Megatron-LM): megatron.core.dist_checkpointing,
  one directory of shards per iteration, reshardable. `torch`: Megatron-LM's legacy layout,
  `iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt` per model-parallel rank (written by data-parallel
  rank 0) and `distrib_optim.pt` beside it for the distributed optimizer. `--load` reads
  whichever format the directory holds.
* `--async-save`: torch_dist writes run in a background process (megatron.core's
  AsyncCallsQueue); the checkpoint is published (renamed into place, pointer replaced) only
  when every rank's write is done, at the latest before the next save or at the end.
* `--dist-ckpt-strictness`: megatron.core's StrictHandling for torch_dist loads.
* `--save-retain-interval R`: after each save the previous one is deleted unless its
  iteration is a multiple of R.
* `--use-checkpoint-opt_param-scheduler` / `--override-opt_param-scheduler`: the lr / weight
  decay schedule comes from the checkpoint / from the flags; with neither, the two must agree.
* Every checkpoint holds the run's flags (`args`, plain values) for `--use-checkpoint-args`
  (megatron/trainer/checkpoint/checkpoint_args.py); torch_dist ones as an argparse.Namespace
  with Megatron-LM's counters, as its trainer saves and reads them (megatron_lm_format.py).
* `--auto-detect-ckpt-format`: with `--ckpt-format torch`, --load reads a torch_dist
  checkpoint too (without it only torch-format ones, as in Megatron-LM).
* `--async-ckpt-use-cpu-shm`: an asynchronous save copies its tensors into CPU shared memory
  in the training process; the writer process gets those, never CUDA tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

NON_PERSISTENT_SUBDIR = "non_persistent"


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    format: str = "torch_dist"  # "torch_dist" | "torch"
    async_save: bool = False
    persistent_worker: bool = False
    strictness: str = "assume_ok_unexpected"
    fully_parallel_save: bool = True
    fully_parallel_load: bool = False
    distributed_optimizer: bool = False
    optim_fully_reshardable: bool = False
    save_optim: bool = True
    load_optim: bool = True
    load_rng: bool = True
    finetune: bool = False
    # None: flags and checkpoint must agree; "checkpoint" or "flags" wins otherwise
    scheduler_source: str | None = None
    retain_interval: int | None = None
    non_persistent_interval: int | None = None
    non_persistent_dir: str | None = None
    # --ckpt-assume-constant-structure: every torch_dist save reuses the first one's plan
    assume_constant_structure: bool = False
    async_strategy: str = "mcore"  # megatron-core's own writer (>= 0.17 also offers NVRx's)
    verify_integrity: bool = False  # a SHA-256 manifest written at save, checked at load
    auto_detect_format: bool = False  # --ckpt-format torch also loads torch_dist checkpoints
    async_cpu_shm: bool = False  # asynchronous saves hand the writer shared-memory copies
    trust: bool = False  # --trust-checkpoint: load whoever wrote it (checkpoint_trust.py)
    # the run's flags, saved with every checkpoint (--use-checkpoint-args reads them)
    run_args: dict | None = field(default=None, compare=False, hash=False, repr=False)

    @classmethod
    def from_args(cls, args) -> CheckpointConfig:
        source = ("checkpoint" if args.use_checkpoint_opt_param_scheduler
                  else "flags" if args.override_opt_param_scheduler else None)
        non_persistent_dir = None
        if args.non_persistent_ckpt_type == "global":
            root = args.save or args.load
            non_persistent_dir = args.non_persistent_global_ckpt_dir or (
                os.path.join(root, NON_PERSISTENT_SUBDIR) if root else None)
        return cls(
            save=args.save, load=args.load, save_interval=args.save_interval,
            format=args.ckpt_format, async_save=args.async_save,
            persistent_worker=args.use_persistent_ckpt_worker,
            strictness=args.dist_ckpt_strictness,
            fully_parallel_save=args.ckpt_fully_parallel_save,
            fully_parallel_load=args.ckpt_fully_parallel_load,
            distributed_optimizer=args.use_distributed_optimizer,
            optim_fully_reshardable=args.dist_ckpt_optim_fully_reshardable,
            save_optim=not args.no_save_optim, load_optim=not args.no_load_optim,
            load_rng=not args.no_load_rng, finetune=args.finetune,
            scheduler_source=source, retain_interval=args.save_retain_interval,
            non_persistent_interval=args.non_persistent_save_interval,
            non_persistent_dir=non_persistent_dir,
            assume_constant_structure=args.ckpt_assume_constant_structure,
            async_strategy=args.async_strategy,
            verify_integrity=args.verify_integrity,
            auto_detect_format=args.auto_detect_ckpt_format,
            async_cpu_shm=args.async_ckpt_use_cpu_shm,
            trust=args.trust_checkpoint,
            run_args=plain_args(args),
        )

    @property
    def optimizer_sharding(self) -> str | None:
        """megatron.core's `distrib_optim_sharding_type` for a torch_dist save."""
        if not self.distributed_optimizer:
            return None
        return "fully_reshardable" if self.optim_fully_reshardable else "dp_reshardable"


def _plain(value) -> bool:
    if isinstance(value, list | tuple):
        return all(_plain(item) for item in value)
    return value is None or isinstance(value, bool | int | float | str)


def plain_args(args) -> dict:
    """The flags (and the values validation derived) that are plain values: what a
    checkpoint keeps of them, loadable with torch.load(weights_only=True)."""
    return {name: value for name, value in sorted(vars(args).items()) if _plain(value)}
