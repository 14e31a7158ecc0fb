"""`--cuda-graph-impl block`: the flags it refuses, and (on a GPU) that replaying the
recorded graphs gives the eager model's losses and gradients whatever order the
microbatches' backwards run in."""

from __future__ import annotations

import contextlib
import dataclasses
import time

import pytest
import torch

from megatron.trainer.config.arguments import ArgumentError, parse_args
from megatron.trainer.config.configs import TrainerConfigs
from megatron.trainer.model.cuda_graphs import CudaGraphError, install_block_graphs
from tests.distributed import run_ranks
from tests.trainer_runs import exact_vocab_configs

TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
    "--global-batch-size", "2", "--vocab-size", "128", "--mock-data", "--tokenizer-type",
    "NullTokenizer", "--lr", "1e-4", "--train-iters", "1", "--hidden-dropout", "0",
    "--attention-dropout", "0",
]


@pytest.mark.parametrize(("flags", "message"), [
    (["--cuda-graph-impl", "local"], "captured by Megatron-LM's training loop"),
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size > 1"),
    (["--recompute-activations"], "activation recomputation"),
    (["--overlap-grad-reduce"], "--overlap-grad-reduce"),
    (["--cuda-graph-impl", "none", "--cuda-graph-memory-limit", "4"],
     "--cuda-graph-memory-limit 4.0 needs --cuda-graph-impl block"),
])
def test_refused_flags_are_named(flags, message):
    impl = [] if "--cuda-graph-impl" in flags else ["--cuda-graph-impl", "block"]
    with pytest.raises(ArgumentError, match="cuda-graph-impl") as raised:
        parse_args([*TINY_GPT, *impl, *flags], world_size=2)
    assert message in str(raised.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_machine_without_gpu_is_refused():
    with pytest.raises(ArgumentError, match="--cuda-graph-impl block needs a CUDA GPU"):
        parse_args([*TINY_GPT, "--cuda-graph-impl", "block"], world_size=1)


def test_cpu_device_is_refused_with_the_device_named():
    args = parse_args(TINY_GPT, world_size=1)
    with pytest.raises(CudaGraphError, match="needs a CUDA device; this run is on cpu"):
        install_block_graphs([], TrainerConfigs.from_args(args), torch.device("cpu"))


def _eager_vs_graphs(rank, dtype_flags, order):
    from megatron.dpp.weight_grad_accumulation import weight_grad_accumulation_fusion
    from megatron.trainer.model.models import (
        build_gpt_stage,
        build_model_chunks,
        transformer_config,
    )
    from megatron.trainer.run.initialize import initialize_distributed
    from megatron.trainer.run.optimizer import wrap_model_chunks

    flags = [*TINY_GPT, *dtype_flags, "--distributed-backend", "nccl"]
    results = {}
    with contextlib.ExitStack() as stack:
        device = initialize_distributed(TrainerConfigs.from_args(parse_args(flags, world_size=1)),
                                        stack)
        stack.enter_context(weight_grad_accumulation_fusion())
        generator = torch.Generator().manual_seed(3)
        batches = [torch.randint(0, 128, (2, 32), generator=generator).to(device)
                   for _ in order]
        positions = torch.arange(32, device=device).expand(2, 32)
        for graphs in (False, True):
            args = parse_args(flags, world_size=1)
            configs = exact_vocab_configs(args)
            config = transformer_config(configs)
            (model,) = wrap_model_chunks(build_model_chunks(configs, config, build_gpt_stage),
                                         configs, config, device)
            installed = install_block_graphs([model], configs, device) if graphs else []
            steps = []
            for _ in range(2):  # the second step replays the slots with updated weights
                losses = [model(tokens, positions, None, labels=tokens).float().mean()
                          for tokens in batches]
                for index in order:
                    losses[index].backward()
                main_grads = [p.main_grad.clone() for p in model.parameters()]
                steps.append(([loss.item() for loss in losses], main_grads))
                with torch.no_grad():
                    for param, grad in zip(model.parameters(), main_grads, strict=True):
                        param.add_(grad.to(param.dtype), alpha=-0.5)
                model.zero_grad_buffer()
            with torch.no_grad():
                evaluation = model(batches[0], positions, None, labels=batches[0]).float()
            results[graphs] = {
                "steps": [(losses, [g.cpu() for g in grads]) for losses, grads in steps],
                "evaluation": evaluation.cpu(),
                "slots": [len(g.slots) for g in installed],
            }
    return results


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("dtype_flags", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_graph_replays_equal_eager_in_any_backward_order(dtype_flags):
    order = [2, 0, 1]  # three microbatches in flight, backwards not in forward order
    (results,) = run_ranks(1, _eager_vs_graphs, dtype_flags, order, gpu=True)
    eager, graphs = results[False], results[True]
    assert graphs["slots"] == [len(order)]  # one slot per microbatch in flight, reused
    for (eager_losses, eager_grads), (graph_losses, graph_grads) in zip(
            eager["steps"], graphs["steps"], strict=True):
        assert graph_losses == eager_losses
        for eager_grad, graph_grad in zip(eager_grads, graph_grads, strict=True):
            torch.testing.assert_close(graph_grad, eager_grad, rtol=0, atol=0)
    torch.testing.assert_close(graphs["evaluation"], eager["evaluation"], rtol=0, atol=0)


def _eager_vs_bucket_graphs(rank, lengths, limits):
    """Two steps of microbatches of the given lengths (several per bucket, all in flight,
    backwards in reverse), eager and with graphs per shape under each memory limit (GiB)."""
    from megatron.dpp.weight_grad_accumulation import weight_grad_accumulation_fusion
    from megatron.trainer.model.models import (
        build_gpt_stage,
        build_model_chunks,
        transformer_config,
    )
    from megatron.trainer.run.initialize import initialize_distributed
    from megatron.trainer.run.optimizer import wrap_model_chunks

    flags = [*TINY_GPT, "--bf16", "--distributed-backend", "nccl", "--seq-length-cv", "0.5",
             "--pad-to-multiple", "8", "--cuda-graph-impl", "block"]
    results = {}
    with contextlib.ExitStack() as stack:
        device = initialize_distributed(TrainerConfigs.from_args(parse_args(flags, world_size=1)),
                                        stack)
        stack.enter_context(weight_grad_accumulation_fusion())
        generator = torch.Generator().manual_seed(3)
        batches = [torch.randint(0, 128, (2, n), generator=generator).to(device)
                   for n in lengths]
        for limit in (None, *limits):
            extra = [] if limit in (None, "eager") else ["--cuda-graph-memory-limit", str(limit)]
            args = parse_args([*flags, *extra], world_size=1)
            configs = exact_vocab_configs(args)
            config = transformer_config(configs)
            (model,) = wrap_model_chunks(build_model_chunks(configs, config, build_gpt_stage),
                                         configs, config, device)
            installed = install_block_graphs([model], configs, device) if limit != "eager" else []
            steps = []
            for _ in range(2):
                losses = [model(t, torch.arange(t.shape[1], device=device).expand(2, -1), None,
                                labels=t).float().mean() for t in batches]
                for loss in reversed(losses):
                    loss.backward()
                main_grads = [p.main_grad.clone() for p in model.parameters()]
                steps.append(([loss.item() for loss in losses], [g.cpu() for g in main_grads]))
                with torch.no_grad():
                    for param, grad in zip(model.parameters(), main_grads, strict=True):
                        param.add_(grad.to(param.dtype), alpha=-0.5)
                model.zero_grad_buffer()
                for graphs in installed:  # between steps, as train_step does
                    graphs.record_warm()
            results[limit] = {"steps": steps, "slots": [
                sorted((shape[0], len(slots)) for shape, slots in g.slots.recorded.items())
                for g in installed], "budgets": [
                (g.slots.budget.used_bytes, g.slots.budget.bytes_per_token) for g in installed]}
    return results


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graphs_per_length_bucket_equal_eager_within_the_memory_limit():
    """Lengths 8, 16 and 32 of the buckets 8, 16, 24 and 32 (--pad-to-multiple 8 at
    --seq-length 32), six microbatches in flight: six lanes, each recording the largest
    bucket and its shape when it is made and the rest at the end of the first step (the
    second replays), giving eager's losses and gradients;
    under a limit of 0 GiB only the first slot (the largest bucket) is recorded and the rest
    runs eagerly, with the same results."""
    lengths = [8, 16, 8, 32, 16, 8]
    (results,) = run_ranks(1, _eager_vs_bucket_graphs, lengths, ["eager", 0], gpu=True)
    eager = results["eager"]
    assert results[None]["slots"] == [[(8, 6), (16, 6), (24, 6), (32, 6)]]
    assert results[0]["slots"] == [[(32, 1)]]
    # a lane's smaller buckets reuse the pool its largest one sized: the six lanes hold
    # little more than six recordings of 32 x 2 tokens, not the 2.5x of 8 + 16 + 24 + 32
    ((used_bytes, bytes_per_token),) = results[None]["budgets"]
    assert 0 < used_bytes <= 1.5 * 6 * bytes_per_token * 32 * 2, (used_bytes, bytes_per_token)
    for limit in (None, 0):
        for (eager_losses, eager_grads), (losses, grads) in zip(
                eager["steps"], results[limit]["steps"], strict=True):
            assert losses == eager_losses, limit
            for eager_grad, grad in zip(eager_grads, grads, strict=True):
                torch.testing.assert_close(grad, eager_grad, rtol=0, atol=0)


def _graphs_with_dropout(rank, runs):
    """Per run (graphs?, forward order): two steps of three microbatches with dropout 0.1,
    each forward after ForwardRng.reseed(step, microbatch, 0) as the schedules do it."""
    from megatron.dpp.weight_grad_accumulation import weight_grad_accumulation_fusion
    from megatron.trainer.model.models import (
        build_gpt_stage,
        build_model_chunks,
        transformer_config,
    )
    from megatron.trainer.run.initialize import initialize_distributed
    from megatron.trainer.run.optimizer import wrap_model_chunks
    from megatron.trainer.run.rng import ForwardRng

    flags = [*TINY_GPT, "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
             "--distributed-backend", "nccl"]
    results = []
    with contextlib.ExitStack() as stack:
        device = initialize_distributed(TrainerConfigs.from_args(parse_args(flags, world_size=1)),
                                        stack)
        stack.enter_context(weight_grad_accumulation_fusion())
        generator = torch.Generator().manual_seed(3)
        batches = [torch.randint(0, 128, (2, 32), generator=generator).to(device)
                   for _ in range(3)]
        positions = torch.arange(32, device=device).expand(2, 32)
        for graphs, order, key_offset in runs:
            args = parse_args(flags, world_size=1)
            configs = exact_vocab_configs(args)
            rng = ForwardRng(args.seed, device)
            config = transformer_config(configs)
            (model,) = wrap_model_chunks(build_model_chunks(configs, config, build_gpt_stage),
                                         configs, config, device)
            if graphs:
                install_block_graphs([model], configs, device)
            steps = []
            for step in (1, 2):
                losses = {}
                for index in order:
                    rng.reseed(step, index + key_offset, 0)
                    tokens = batches[index]
                    losses[index] = model(tokens, positions, None, labels=tokens).float().mean()
                for index in reversed(order):
                    losses[index].backward()
                main_grads = [p.main_grad.clone() for p in model.parameters()]
                steps.append(([losses[i].item() for i in range(3)],
                              [g.cpu() for g in main_grads]))
                with torch.no_grad():
                    for param, grad in zip(model.parameters(), main_grads, strict=True):
                        param.add_(grad.to(param.dtype), alpha=-0.5)
                model.zero_grad_buffer()
            results.append(steps)
    return results


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graph_replays_draw_the_keyed_dropout_masks():
    """Dropout inside the graphs draws from the generator state ForwardRng sets before each
    forward: graphed runs in two forward orders agree with each other and with eager, and
    other keys give other masks (the dropout is on)."""
    runs = [(False, [0, 1, 2], 0), (True, [0, 1, 2], 0), (True, [2, 0, 1], 0),
            (False, [0, 1, 2], 10)]
    (eager, graphs, reordered, other_keys), = run_ranks(1, _graphs_with_dropout, runs,
                                                          gpu=True)
    for run in (graphs, reordered):
        for (losses, grads), (eager_losses, eager_grads) in zip(run, eager, strict=True):
            # the same masks. With megatron-core's kernels the forwards were bit-equal; with the
            # Triton fusions (the default on a GPU) a graphed loss was one fp32 ulp from eager's
            # on an H200 (2026-11-24, cause not yet found); another mask moves it far more
            for loss, eager_loss in zip(losses, eager_losses, strict=True):
                assert abs(loss - eager_loss) <= 1e-6 * abs(eager_loss), (loss, eager_loss)
            # the replayed dropout backward rounds apart from eager's in the last bits (at
            # most 1.5e-8 on an H200); another mask would differ at the gradients' scale
            for grad, eager_grad in zip(grads, eager_grads, strict=True):
                torch.testing.assert_close(grad, eager_grad, rtol=1e-4, atol=1e-7)
    assert all(abs(other - loss) > 1e-4 * abs(loss)
               for other, loss in zip(other_keys[0][0], eager[0][0], strict=True))


def test_block_gradients_reach_main_grad_as_per_tensor_adds_would():
    """The backward graph's one multi-tensor add of the small gradients (biases, norms) gives
    each main_grad exactly what a separate add per tensor gives, for mixed shapes and dtypes."""
    from megatron.trainer.model.cuda_graphs import _accumulate_into_main_grads

    generator = torch.Generator().manual_seed(3)
    mains = [torch.randn(shape, generator=generator, dtype=dtype)
             for shape, dtype in (((5,), torch.float32), ((3, 4), torch.float32),
                                  ((7,), torch.float64))]
    grads = [torch.randn(main.shape, generator=generator).bfloat16() for main in mains]
    expected = [main.clone().add_(grad) for main, grad in zip(mains, grads, strict=True)]
    _accumulate_into_main_grads(list(zip(mains, grads, strict=True)))
    for main, want in zip(mains, expected, strict=True):
        assert torch.equal(main, want)


def test_bucket_shapes_are_the_padded_lengths_known_in_advance():
    """--pad-to-multiple 8 at --seq-length 32: the four block inputs a lane records by the
    end of its first step; with a token budget every row count it allows at each length,
    up to a global batch's samples; none where the shapes are too many."""
    from megatron.trainer.data.microbatches import MAX_WARM_SHAPES
    from megatron.trainer.model.cuda_graphs import bucket_shapes

    configs = TrainerConfigs.from_args(
        parse_args([*TINY_GPT, "--seq-length-cv", "0.5", "--pad-to-multiple", "8"],
                   world_size=1))

    def shapes(seq_length=32, microbatch_tokens=None, global_batch_size=2):
        return bucket_shapes(dataclasses.replace(
            configs, model=dataclasses.replace(configs.model, seq_length=seq_length,
                                               max_position_embeddings=max(seq_length, 32)),
            data=dataclasses.replace(configs.data, microbatch_tokens=microbatch_tokens),
            schedule=dataclasses.replace(configs.schedule,
                                         global_batch_size=global_batch_size)))

    assert shapes() == tuple((n, 2, 64) for n in (8, 16, 24, 32))
    # the last bucket is the sequence's length, not the next multiple
    assert shapes(seq_length=30) == tuple((n, 2, 64) for n in (8, 16, 24, 30))
    assert shapes(seq_length=8 * (MAX_WARM_SHAPES + 1)) == ()  # more lengths: each on first use
    # 64 tokens: 8 rows of 8 (capped at the 6 samples of a global batch), 4 of 16, 2 of 24
    # and of 32
    assert shapes(microbatch_tokens=64, global_batch_size=6) == (
        *((8, rows, 64) for rows in range(1, 7)), *((16, rows, 64) for rows in range(1, 5)),
        (24, 1, 64), (24, 2, 64), (32, 1, 64), (32, 2, 64))
    assert shapes(microbatch_tokens=32 * 40, global_batch_size=1000) == ()  # 333 shapes


class _SlowRecorder:
    """Stands in for a block's graphs: every record_warm() takes `seconds`."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def record_warm(self) -> int:
        time.sleep(self.seconds)
        return 1 if self.seconds else 0


def _warm_shapes_rank(rank):
    from types import SimpleNamespace

    from megatron.trainer.run.training import record_warm_shapes

    torch.distributed.init_process_group("gloo")
    trainer = SimpleNamespace(block_graphs=[_SlowRecorder(2.0 if rank == 0 else 0.0)],
                              graphs_settled=False)
    took = []
    for _ in range(2):
        started = time.monotonic()
        record_warm_shapes(trainer)
        took.append(time.monotonic() - started)
    torch.distributed.destroy_process_group()
    return took, trainer.graphs_settled


def test_after_the_first_step_the_ranks_wait_for_each_others_recordings():
    """Rank 0 records for 2 s after each step, rank 1 nothing: after the first step rank 1
    waits for rank 0 (so its next step does not start waiting on a recording peer), after
    later steps it does not."""
    (first_took, settled0), (other_took, settled1) = run_ranks(2, _warm_shapes_rank)
    assert settled0 and settled1
    assert first_took[0] >= 2.0 and other_took[0] >= 1.5, (first_took, other_took)
    assert other_took[1] < 1.0, other_took
