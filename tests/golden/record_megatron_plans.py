"""Record what megatron-core's own pipeline schedules execute, per rank and in order, as
golden action lists (megatron/dpp/actions.py's CSV) for tests/dpp/test_plan.py.

    OMP_NUM_THREADS=1 python tests/golden/record_megatron_plans.py        # a few minutes

For each pipeline size P it starts P gloo CPU processes and runs megatron-core's
`forward_backward_pipelining_without_interleaving` (1F1B, one chunk) and
`forward_backward_pipelining_with_interleaving` (C = 2 chunks) for M in {P, 2P + 1, 4P}
microbatches, through the real schedule code and its real p2p messages, with a fake
forward and backward step: `schedules.forward_step` / `schedules.backward_step` are
replaced by functions that log (kind, chunk, microbatch) and return tensors of the right
shape. Writes tests/golden/megatron_core_<version>/<schedule>_p<P>_c<C>_m<M>.csv and
rejected.csv (the combinations megatron-core refuses, with its error).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import logging
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: import the repository's packages
    sys.path.insert(0, str(ROOT))

from megatron.dpp.actions import Task, write_actions  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

log = logging.getLogger("record_megatron_plans")

SEQ_LENGTH, MICRO_BATCH, HIDDEN = 2, 1, 4


def configurations(pp_sizes, chunk_counts):
    for p in pp_sizes:
        for chunks in chunk_counts:
            for m in (p, 2 * p + 1, 4 * p):
                yield p, chunks, m


class _Recorder:
    """Stands in for megatron-core's forward_step / backward_step on one rank."""

    def __init__(self):
        import torch

        self.torch = torch
        self.actions: list[Task] = []

    def forward_step(self, forward_step_func, data_iterator, model, num_microbatches,
                     input_tensor, forward_data_store, config, cp_group_size, *args,
                     current_microbatch=None, vp_stage=None, **kwargs):
        chunk = 0 if vp_stage is None else vp_stage
        self.actions.append(Task("F", chunk, current_microbatch))
        output = self.torch.zeros(SEQ_LENGTH, MICRO_BATCH, HIDDEN)
        output.golden_task = (chunk, current_microbatch)  # read back by the backward
        tokens = self.torch.zeros([], dtype=self.torch.int)
        return ([output] if isinstance(input_tensor, list) else output), tokens

    def backward_step(self, input_tensor, output_tensor, output_tensor_grad, model_type,
                      config):
        output = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
        self.actions.append(Task("B", *output.golden_task))

        def grad(x):
            return None if x is None else self.torch.zeros_like(x)

        if isinstance(input_tensor, list):
            return [grad(x) for x in input_tensor]
        return grad(input_tensor)


def _fake_chunks(p: int, chunks: int):
    import torch
    from megatron.core.enums import ModelType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=p * chunks, hidden_size=HIDDEN, num_attention_heads=1,
        pipeline_model_parallel_size=p,
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
        pipeline_dtype=torch.float32,
        # PP=2 x VPP=2 with batched p2p pairs two messages to one peer wrongly
        # (../shared/CPU.md); the order of the tasks does not depend on it
        batch_p2p_comm=chunks == 1,
    )

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = config
            self.model_type = ModelType.encoder_or_decoder

    return [Chunk() for _ in range(chunks)]


def record_rank(rank: int, configs: list[tuple[int, int, int]]) -> list[tuple]:
    """Rank function: (p, chunks, m, this rank's actions or None, error) per config."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    from megatron.trainer.core_compat.cpu_compat import CpuCompat

    results = []
    with CpuCompat():
        dist.init_process_group("gloo")
        for p, chunks, m in configs:
            parallel_state.initialize_model_parallel(
                pipeline_model_parallel_size=p,
                virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None)
            recorder = _Recorder()
            model = _fake_chunks(p, chunks)
            run = (schedules.forward_backward_pipelining_with_interleaving if chunks > 1
                   else schedules.forward_backward_pipelining_without_interleaving)
            patched = contextlib.ExitStack()
            for name in ("forward_step", "backward_step"):
                patched.enter_context(mock.patch.object(schedules, name, getattr(recorder, name)))
            try:
                with patched:
                    run(forward_step_func=None, data_iterator=[None] * chunks, model=model,
                        num_microbatches=m, seq_length=SEQ_LENGTH,
                        micro_batch_size=MICRO_BATCH, forward_only=False)
                results.append((p, chunks, m, recorder.actions, None))
            except (ValueError, RuntimeError) as error:
                # refused before any message: every rank refuses alike
                results.append((p, chunks, m, None, f"{type(error).__name__}: {error}"))
            parallel_state.destroy_model_parallel()
            dist.barrier()
        dist.destroy_process_group()
    return results



def main(argv=None) -> int:
    import megatron.core

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default=str(ROOT / "tests" / "golden"),
                        help="parent directory of megatron_core_<version>/")
    args = parser.parse_args(argv)
    out = Path(args.out) / f"megatron_core_{megatron.core.__version__}"
    out.mkdir(parents=True, exist_ok=True)
    rejected = []
    for p in args.pp:
        configs = list(configurations([p], args.chunks))
        per_rank = run_ranks(p, record_rank, configs, timeout=1800)
        for k, (_, chunks, m) in enumerate(configs):
            errors = {per_rank[r][k][4] for r in range(p)}
            if errors != {None}:
                rejected.append((golden_name(chunks), p, chunks, m, " | ".join(
                    sorted(e for e in errors if e))))
                continue
            path = out / f"{golden_name(chunks)}_p{p}_c{chunks}_m{m}.csv"
            with open(path, "w", newline="") as file:
                write_actions(file, {r: per_rank[r][k][3] for r in range(p)})
            log.info("wrote %s", path)
    with open(out / "rejected.csv", "w", newline="") as file:
        writer = csv.writer(file, lineterminator="\n")
        writer.writerow(["schedule", "pp", "chunks", "microbatches", "error"])
        writer.writerows(rejected)
    log.info("megatron-core rejected %d combinations: %s", len(rejected), out / "rejected.csv")
    return 0


def golden_name(chunks: int) -> str:
    return "interleaved" if chunks > 1 else "1f1b"


if __name__ == "__main__":
    sys.exit(main())
