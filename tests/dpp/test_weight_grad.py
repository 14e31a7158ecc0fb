"""The B/W split of the backward (megatron/dpp/weight_grad.py): deferring the weight
gradients and running them later, in any order, gives the losses and gradients of the
ordinary backward, for the project's real layers in every layout the store supports; the
store refuses orders it cannot honour."""

from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace

import pytest
import torch

from megatron.dpp.weight_grad import WeightGradError, WeightGradStore
from megatron.dpp.weight_grad_accumulation import weight_grad_accumulation_fusion
from megatron.trainer.kernels.fused_layers import biased_linear
from tests.distributed import run_ranks
from tests.pipeline_runs import TINY_GPT
from tests.trainer_runs import train_runs, with_flags

SPLIT = with_flags(TINY_GPT, global_batch_size=8, dpp_split_backward=True)  # 4 microbatches
PLAIN_CONFIG = SimpleNamespace(gradient_accumulation_fusion=True, no_sync_func=None,
                               grad_sync_func=None)


def _linear(generator):
    weight = torch.nn.Parameter(torch.randn(24, 16, generator=generator))
    bias = torch.nn.Parameter(torch.randn(24, generator=generator))
    weight.main_grad, weight.grad_added_to_main_grad = torch.zeros(24, 16), False
    return weight, bias


@pytest.fixture
def store():
    with weight_grad_accumulation_fusion():
        store = WeightGradStore()
        store.begin_iteration(PLAIN_CONFIG, num_chunks=1, num_microbatches=2)
        yield store


def test_b_computes_input_and_bias_gradients_w_the_weight_gradient(store):
    generator = torch.Generator().manual_seed(1)
    weight, bias = _linear(generator)
    x = torch.randn(8, 2, 16, generator=generator, requires_grad=True)
    upstream = torch.randn(8, 2, 24, generator=generator)
    with store.deferring((0, 0)):
        biased_linear(x, weight, bias, True).backward(upstream)
    torch.testing.assert_close(x.grad, upstream @ weight.detach())
    torch.testing.assert_close(bias.grad, upstream.sum(dim=(0, 1)))
    assert weight.main_grad.abs().sum() == 0 and store.pending() == [(0, 0)]
    # W reads the layer's input and output gradient, nothing else
    assert store.held_bytes((0, 0)) == x.numel() * 4 + upstream.numel() * 4
    store.run((0, 0))
    expected = upstream.reshape(16, 24).t() @ x.detach().reshape(16, 16)
    torch.testing.assert_close(weight.main_grad, expected, rtol=1e-6, atol=1e-6)
    assert store.pending() == [] and store.held_bytes() == 0


def test_w_before_its_b_twice_or_never_is_refused(store):
    generator = torch.Generator().manual_seed(2)
    weight, bias = _linear(generator)
    with pytest.raises(WeightGradError, match=r"W of \(0, 1\) before its B"):
        store.run((0, 1))
    with store.deferring((0, 1)):
        biased_linear(torch.randn(4, 16, generator=generator), weight, bias, True).sum().backward()
        with pytest.raises(WeightGradError, match=r"W of \(0, 1\) inside its own B"):
            store.run((0, 1))
        with pytest.raises(WeightGradError, match=r"B of \(0, 0\) began inside the B of \(0, 1\)"):
            with store.deferring((0, 0)):
                pass
    with pytest.raises(WeightGradError, match=r"B of \(0, 1\) ran twice"):
        with store.deferring((0, 1)):
            pass
    with pytest.raises(WeightGradError, match=r"\(0, 2\): outside 1 chunk\(s\) x 2 microbatches"):
        with store.deferring((0, 2)):
            pass
    with pytest.raises(WeightGradError, match=r"the W of \[\(0, 1\)\] did not run"):
        store.end_iteration()
    store.run((0, 1))
    with pytest.raises(WeightGradError, match=r"W of \(0, 1\) ran twice"):
        store.run((0, 1))
    store.end_iteration()
    with pytest.raises(WeightGradError, match="begin_iteration"):
        with store.deferring((0, 0)):
            pass


def test_w_in_parts_runs_each_deferred_gemm_once_and_frees_as_it_goes(store):
    """Three linears' deferred GEMMs in two parts: the first part runs the first one (3 * 1
    // 2 = 1 item), the second the other two; the W is pending until its last part."""
    generator = torch.Generator().manual_seed(5)
    layers = [_linear(generator) for _ in range(3)]
    inputs = [torch.randn(4, 16, generator=generator) for _ in layers]
    upstream = [torch.randn(4, 24, generator=generator) for _ in layers]
    with store.deferring((0, 0)):
        torch.autograd.backward(
            [biased_linear(x, weight, bias, True)
             for x, (weight, bias) in zip(inputs, layers, strict=True)], upstream)
    held = store.held_bytes((0, 0))
    assert store.run((0, 0), parts=2) is False
    # the first part ran one of the three GEMMs and let go of its tensors
    assert store.pending() == [(0, 0)] and 0 < store.held_bytes((0, 0)) < held
    ran = [bool(weight.main_grad.abs().sum()) for weight, _ in layers]
    assert sorted(ran) == [False, False, True]
    assert store.run((0, 0), parts=2) is True
    for x, grad, (weight, _) in zip(inputs, upstream, layers, strict=True):
        torch.testing.assert_close(weight.main_grad, grad.t() @ x)
    assert store.pending() == [] and store.held_bytes() == 0
    with pytest.raises(WeightGradError, match=r"W of \(0, 0\) ran twice"):
        store.run((0, 0), parts=2)


def _sums_after_ws_in(order, any_weight_order, parts=1):
    """main_grad of two linears after four microbatches' B in microbatch order and their W
    tasks in `order` (each in `parts` parts), and the bytes held
    right after the first W task ran whole."""
    generator = torch.Generator().manual_seed(11)
    layers = [_linear(generator) for _ in range(2)]
    store = WeightGradStore(any_weight_order=any_weight_order)
    store.begin_iteration(PLAIN_CONFIG, num_chunks=1, num_microbatches=4)
    for microbatch in range(4):
        inputs = [torch.randn(8, 16, generator=generator) for _ in layers]
        upstream = [torch.randn(8, 24, generator=generator) * 10 ** microbatch for _ in layers]
        with store.deferring((0, microbatch)):
            torch.autograd.backward(
                [biased_linear(x, weight, bias, True)
                 for x, (weight, bias) in zip(inputs, layers, strict=True)], upstream)
    held_after_first = None
    for microbatch in order:
        for _ in range(parts):
            store.run((0, microbatch), parts)
        if held_after_first is None:
            held_after_first = store.held_bytes()
    store.end_iteration()
    return [weight.main_grad for weight, _ in layers], held_after_first


def test_any_weight_order_sums_in_b_order_whatever_order_the_ws_run():
    """Gradients of four magnitudes: summed in another order their last bits differ; with
    `any_weight_order` every W order gives main_grad to the bit, and a W that ran ahead of
    an earlier one holds its buffers until that one is in."""
    with weight_grad_accumulation_fusion():
        in_order, held_in_order = _sums_after_ws_in([0, 1, 2, 3], any_weight_order=True)
        inputs_of_three = _sums_after_ws_in([0, 1, 2, 3], any_weight_order=False)[1]
        for order, parts in (([3, 1, 0, 2], 1), ([2, 3, 1, 0], 2), ([1, 0, 3, 2], 3)):
            sums, held = _sums_after_ws_in(order, any_weight_order=True, parts=parts)
            assert all(torch.equal(a, b) for a, b in zip(sums, in_order, strict=True)), order
            # the first W ran ahead of microbatch 0's: its two buffers wait beside the inputs
            # the three other W tasks hold
            assert held == inputs_of_three + 2 * 24 * 16 * 4
        assert held_in_order == inputs_of_three
        accumulated = _sums_after_ws_in([0, 1, 2, 3], any_weight_order=False)[0]
        reordered = _sums_after_ws_in([3, 1, 0, 2], any_weight_order=False)[0]
        for a, b, c in zip(accumulated, reordered, in_order, strict=True):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-3)
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-3)
        assert not all(torch.equal(a, b) for a, b in zip(accumulated, reordered, strict=True))


def test_the_sum_order_changes_between_iterations_only(store):
    with pytest.raises(WeightGradError, match="between iterations only"):
        store.allow_any_weight_order()
    with store.deferring((0, 0)):
        pass
    store.run((0, 0))
    with store.deferring((0, 1)):
        pass
    store.run((0, 1))
    store.end_iteration()
    store.allow_any_weight_order()
    store.begin_iteration(PLAIN_CONFIG, num_chunks=1, num_microbatches=1)
    with store.deferring((0, 0)):
        with pytest.raises(WeightGradError, match="not graphed W work"):
            store.defer(lambda: None)


def test_backward_outside_deferring_is_unchanged(store):
    generator = torch.Generator().manual_seed(3)
    weight, bias = _linear(generator)
    x = torch.randn(4, 16, generator=generator)
    biased_linear(x, weight, bias, True).sum().backward()
    torch.testing.assert_close(weight.main_grad, torch.ones(4, 24).t() @ x)
    assert store.pending() == []


def test_each_chunk_reduces_after_its_last_w_and_never_during_b(store):
    """DDP's hooks, as megatron-core's schedules hand them over in the config: B runs under
    the chunk's no_sync; the chunk's grad_sync follows its last W, not its last B."""
    events = []

    @contextlib.contextmanager
    def no_sync(chunk):
        events.append(("no_sync on", chunk))
        yield
        events.append(("no_sync off", chunk))

    config = SimpleNamespace(
        gradient_accumulation_fusion=True,
        no_sync_func=[lambda: no_sync(0), lambda: no_sync(1)],
        grad_sync_func=[lambda: events.append(("sync", 0)), lambda: events.append(("sync", 1))])
    store.begin_iteration(config, num_chunks=2, num_microbatches=2)
    for key in ((0, 0), (1, 0), (0, 1), (1, 1)):
        with store.deferring(key):
            events.append(("B", key))
    assert events[:3] == [("no_sync on", 0), ("B", (0, 0)), ("no_sync off", 0)]
    assert all(kind != "sync" for kind, _ in events)
    events.clear()
    for key in ((1, 1), (0, 0), (1, 0), (0, 1)):
        store.run(key)
        events.append(("W", key))
    assert events == [("W", (1, 1)), ("W", (0, 0)), ("sync", 1), ("W", (1, 0)), ("sync", 0),
                      ("W", (0, 1))]
    store.end_iteration()


def test_a_model_without_the_fusion_path_is_refused():
    config = SimpleNamespace(**{**vars(PLAIN_CONFIG), "gradient_accumulation_fusion": False})
    with pytest.raises(WeightGradError, match="without gradient_accumulation_fusion"):
        WeightGradStore().begin_iteration(config, 1, 1)
    store = WeightGradStore()
    store.begin_iteration(PLAIN_CONFIG, 1, 1)
    with pytest.raises(WeightGradError, match="needs the gradient-accumulation fusion path"):
        with store.deferring((0, 0)):
            pass


@pytest.mark.parametrize(("flags", "message"), [
    (["--pipeline-model-parallel-size", "2"], "> 1 needs --use-dpp"),
    (["--no-gradient-accumulation-fusion"], "drop --no-gradient-accumulation-fusion"),
    (["--transformer-impl", "transformer_engine"], "use --transformer-impl local"),
])
def test_flag_refuses_what_it_cannot_split(flags, message):
    from megatron.trainer.config.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError, match="--dpp-split-backward") as raised:
        parse_args([*SPLIT, *flags], world_size=2)
    assert message in str(raised.value)


# --- the project's GPT, built by the trainer's setup, one step per path -----------------

def _plain_step(trainer):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.pipeline_runs import one_step

    return one_step(trainer, get_forward_backward_func(), trainer.args.num_microbatches)


def _deferred_step(trainer, store, w_order):
    """Each microbatch's forward, then its B under the store; all Ws at the end in
    `w_order`; then megatron-core's gradient finalisation (DP reduction)."""
    from megatron.core.pipeline_parallel import schedules

    from megatron.dpp.compat import core_internals
    from megatron.trainer.run.training import data_iterators
    from tests.pipeline_runs import named_grads

    (model,) = trainer.model
    config, m = trainer.config, trainer.args.num_microbatches
    model.zero_grad_buffer()
    iterator = data_iterators(trainer, trainer.datasets[0], 0)
    forward_step_func = trainer.task.make_forward_step(trainer.args, trainer.device)
    outputs, held = [], []
    store.begin_iteration(config, 1, m)
    for i in range(m):
        output, _ = schedules.forward_step(forward_step_func, iterator, model, m, None, outputs,
                                           config, 1, is_first_microbatch=i == 0,
                                           current_microbatch=i)
        with store.deferring((0, i)):
            core_internals.backward_step(None, output, None, config)
        held.append(store.held_bytes((0, i)))
    for i in w_order:
        store.run((0, i))
    store.end_iteration()
    config.finalize_model_grads_func([model])
    losses = [[float(v) for v in entry["lm loss"]] for entry in outputs]
    return losses, named_grads(trainer), held


def _split_vs_plain(rank, runs, world_size):
    """Per flag list, set up the trainer and run plain, deferred, plain, deferred, plain
    steps on the same weights and batch."""
    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.run import initialize
    from megatron.trainer.run.training import setup
    from megatron.trainer.tasks.gpt import GPT_TASK
    from tests.trainer_runs import _destroy_model_parallel_only

    initialize._shutdown = _destroy_model_parallel_only  # several setups in one process
    results = []
    for flags in runs:
        args = parse_args(flags, world_size=world_size)
        with contextlib.ExitStack() as stack:
            trainer = setup(GPT_TASK, args, stack)
            store = WeightGradStore()
            order = random.Random(7).sample(range(args.num_microbatches), args.num_microbatches)
            plain, deferred, held = [], [], []
            for _ in range(2):  # DDP's bucket hooks take another path after the first batch
                plain.append(_plain_step(trainer))
                losses, grads, held = _deferred_step(trainer, store, order)
                deferred.append((losses, grads))
            plain.append(_plain_step(trainer))
            results.append({"plain": plain, "deferred": deferred, "held": held,
                            "tokens": args.seq_length * args.micro_batch_size})
    return results


def _one_rank(rank, runs):
    results = _split_vs_plain(rank, runs, 1)
    torch.distributed.destroy_process_group()
    return results


def _assert_split_equals_plain(result, name):
    plain, deferred = result["plain"], result["deferred"]
    # the swap is undone: a plain step after deferred ones is the first plain step, exactly
    assert plain[-1][0] == plain[0][0], name
    for grad_name, (grad, _) in plain[0][1].items():
        assert torch.equal(plain[-1][1][grad_name][0], grad), (name, grad_name)
    for (plain_losses, plain_grads), (losses, grads) in zip(plain[:2], deferred, strict=True):
        assert losses == plain_losses, name
        assert grads.keys() == plain_grads.keys()
        for grad_name, (grad, _) in plain_grads.items():
            assert grad.abs().sum() > 0, (name, grad_name)
            torch.testing.assert_close(grads[grad_name][0], grad, rtol=1e-5, atol=1e-6,
                                       msg=f"{name}: {grad_name}")


def _gpt_deferred_bytes(tokens, hidden, ffn, vocab, layers, bytes_per_element):
    """What the docstring of weight_grad.py says a deferred microbatch holds (TP = 1):
    per layer the inputs of qkv, proj, fc1, fc2 and their output gradients; the output
    layer's input and the logits' gradient."""
    per_layer = tokens * (hidden + hidden + hidden + ffn) + tokens * (3 * hidden + hidden + ffn
                                                                      + hidden)
    return (layers * per_layer + tokens * (hidden + vocab)) * bytes_per_element


def test_one_process_tied_untied_bf16():
    runs = {
        "tied": SPLIT,
        "untied": with_flags(SPLIT, untie_embeddings_and_output_weights=True),
        "bf16": with_flags(SPLIT, bf16=True),
    }
    (results,) = run_ranks(1, _one_rank, list(runs.values()))
    for name, result in zip(runs, results, strict=True):
        _assert_split_equals_plain(result, name)
    # the memory a deferred microbatch holds, as documented (vocab 128, fp32 and bf16)
    fp32 = _gpt_deferred_bytes(results[0]["tokens"], 32, 128, 128, 4, 4)
    assert results[0]["held"] == [fp32] * 4
    assert results[2]["held"] == [fp32 // 2] * 4


# --- two ranks: one process pair for all (start-up and imports dominate on 2 cores) -------

LAYOUTS = {
    "TP=2": with_flags(SPLIT, tensor_model_parallel_size=2),
    "TP=2 untied": with_flags(SPLIT, tensor_model_parallel_size=2,
                              untie_embeddings_and_output_weights=True),
    "DP=2 overlap": with_flags(SPLIT, global_batch_size=16, overlap_grad_reduce=True),
    "DP=2 overlap distopt": with_flags(SPLIT, global_batch_size=16, overlap_grad_reduce=True,
                                       use_distributed_optimizer=True),
}
SP_W_ORDER = [1, 2, 0]
# --dpp-split-backward in the trainer (megatron-core's schedule, each W right after its B)
# at DP=2 with overlapped reduction, and the plain trainer
TRAINER_SPLIT = with_flags(SPLIT, global_batch_size=16, overlap_grad_reduce=True, train_iters=3)
TRAINER_RUNS = [TRAINER_SPLIT, with_flags(TRAINER_SPLIT, dpp_split_backward=None)]


def _two_ranks(rank):
    torch.distributed.init_process_group("gloo")
    sequence_parallel = _sequence_parallel_blocks(rank, SP_W_ORDER)
    layouts = _split_vs_plain(rank, list(LAYOUTS.values()), 2)
    trainer = train_runs(rank, TRAINER_RUNS, 2)  # ends the process group
    return {"sequence parallel": sequence_parallel, "layouts": layouts, "trainer": trainer}


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(2, _two_ranks)


@pytest.mark.slow
def test_tensor_and_data_parallel_layouts(two_ranks):
    for rank_results in two_ranks:
        for name, result in zip(LAYOUTS, rank_results["layouts"], strict=True):
            _assert_split_equals_plain(result, name)


def _sequence_parallel_blocks(rank, w_order):
    """Two blocks of megatron-core's column- and row-parallel linears with sequence
    parallelism on two tensor-parallel ranks: (main_grad, bias gradient) per parameter and
    the input gradients, plain then deferred. (The project's GPT under --sequence-parallel
    with the split: tests/dpp/test_dpp_equivalence.py, case tp2_pp2_sp.)"""
    import functools

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.trainer.core_compat.cpu_compat import CpuCompat

    with CpuCompat(), weight_grad_accumulation_fusion():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                                   tensor_model_parallel_size=2, sequence_parallel=True,
                                   gradient_accumulation_fusion=True,
                                   use_cpu_initialization=True)
        init = functools.partial(torch.nn.init.normal_, std=0.3)
        torch.manual_seed(0)  # the same full weights on both ranks, each keeps its slice
        layers = []
        for _ in range(2):
            layers.append(ColumnParallelLinear(16, 32, config=config, init_method=init,
                                               bias=True, gather_output=False))
            layers.append(RowParallelLinear(32, 16, config=config, init_method=init, bias=True,
                                            input_is_parallel=True, skip_bias_add=False))
        params = [p for layer in layers for p in layer.parameters()]
        weights = [layer.weight for layer in layers]
        for weight in weights:
            weight.main_grad = torch.zeros_like(weight)
            weight.grad_added_to_main_grad = False  # as DDP sets it
        generator = torch.Generator().manual_seed(1 + rank)
        inputs = [torch.randn(8, 2, 16, generator=generator) for _ in w_order]
        upstream = [torch.randn(8, 2, 16, generator=generator) for _ in w_order]

        def step(store):
            for param in params:
                param.grad = None
            for weight in weights:
                weight.main_grad.zero_()
            input_grads = []
            if store is not None:
                store.begin_iteration(PLAIN_CONFIG, 1, len(inputs))
            for index, (x, grad) in enumerate(zip(inputs, upstream, strict=True)):
                x = x.clone().requires_grad_()
                hidden = x
                for layer in layers:
                    hidden, _ = layer(hidden)
                with store.deferring((0, index)) if store else contextlib.nullcontext():
                    hidden.backward(grad)
                input_grads.append(x.grad)
            if store is not None:
                for index in w_order:
                    store.run((0, index))
                store.end_iteration()
            return ([w.main_grad.clone() for w in weights],
                    [layer.bias.grad.clone() for layer in layers], input_grads)

        results = step(None), step(WeightGradStore())
    parallel_state.destroy_model_parallel()
    return results


@pytest.mark.slow
def test_sequence_parallel_linears(two_ranks):
    for rank_results in two_ranks:
        plain, deferred = rank_results["sequence parallel"]
        for plain_tensors, deferred_tensors in zip(plain, deferred, strict=True):
            for ours, theirs in zip(deferred_tensors, plain_tensors, strict=True):
                assert theirs.abs().sum() > 0
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_trainer_flag_runs_each_w_after_its_b(two_ranks):
    """The trainer with --dpp-split-backward: the losses and gradient norms without it."""
    for rank_results in two_ranks:
        split_run, plain_run = rank_results["trainer"]
        assert split_run["batches"] == plain_run["batches"] == [16, 16, 16]
        for ours, theirs in zip(split_run["grad_norms"], plain_run["grad_norms"], strict=True):
            assert ours == pytest.approx(theirs, rel=1e-5)
        for ours, theirs in zip(split_run["losses"], plain_run["losses"], strict=True):
            assert ours["lm loss"] == pytest.approx(theirs["lm loss"], rel=1e-6)


# --- GPU: the CUDA-graph blocks with B and W graphed apart --------------------------------

GPU_MODES = ("eager", "graphs, W right after B", "eager deferred", "graphs deferred",
             "graphs deferred, W in 2 parts")


def _graphs_deferred_vs_eager(rank, backward_order, w_order):
    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.model.cuda_graphs import install_block_graphs
    from megatron.trainer.model.models import (
        build_gpt_stage,
        build_model_chunks,
        transformer_config,
    )
    from megatron.trainer.run.initialize import initialize_distributed
    from megatron.trainer.run.optimizer import wrap_model_chunks
    from tests.trainer_runs import exact_vocab_configs

    flags = [*with_flags(TINY_GPT, num_layers=2, hidden_size=64, seq_length=32,
                         max_position_embeddings=32, bf16=True, dpp_split_backward=True),
             "--distributed-backend", "nccl"]
    results = {}
    with contextlib.ExitStack() as stack:
        device = initialize_distributed(exact_vocab_configs(parse_args(flags, world_size=1)),
                                        stack)
        stack.enter_context(weight_grad_accumulation_fusion())
        generator = torch.Generator().manual_seed(3)
        batches = [torch.randint(0, 128, (2, 32), generator=generator).to(device)
                   for _ in backward_order]
        positions = torch.arange(32, device=device).expand(2, 32)
        for mode in GPU_MODES:
            configs = exact_vocab_configs(parse_args(flags, world_size=1))
            config = transformer_config(configs)
            (model,) = wrap_model_chunks(build_model_chunks(configs, config, build_gpt_stage),
                                         configs, config, device)
            store = None if mode == "eager" else WeightGradStore()
            deferring = "deferred" in mode
            parts = 2 if mode.endswith("2 parts") else 1
            installed = (install_block_graphs([model], configs, device, store, parts)
                         if mode.startswith("graphs") else [])
            fc1 = model.module.module.decoder.layers[0].mlp.linear_fc1.weight
            steps = []
            for _ in range(2):  # the second step replays the slots with updated weights
                if deferring:
                    store.begin_iteration(config, 1, len(batches))
                losses = [model(tokens, positions, None, labels=tokens).float().mean()
                          for tokens in batches]
                for index in backward_order:
                    with store.deferring((0, index)) if deferring else contextlib.nullcontext():
                        losses[index].backward()
                # whether B left the linear layers' weight gradients to W
                fc1_untouched_by_b = bool(fc1.main_grad.abs().sum() == 0)
                if deferring:
                    for index in w_order:
                        # a W in parts: complete only at its last part
                        assert all(not store.run((0, index), parts) for _ in range(parts - 1))
                        assert store.run((0, index), parts)
                    store.end_iteration()
                steps.append(([loss.item() for loss in losses],
                              [p.main_grad.cpu() for p in model.parameters()],
                              fc1_untouched_by_b))
                with torch.no_grad():  # the same update in every mode
                    for param in model.parameters():
                        param.mul_(0.75)
                model.zero_grad_buffer()
            results[mode] = {"steps": steps, "slots": [len(g.slots) for g in installed]}
    return results


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graphed_b_and_w_equal_the_eager_backward():
    backward_order, w_order = [2, 0, 1], [1, 2, 0]  # three microbatches in flight
    (results,) = run_ranks(1, _graphs_deferred_vs_eager, backward_order, w_order, gpu=True)
    eager = results["eager"]
    # a slot is free only after its W; the second step reuses the three
    assert results["graphs deferred"]["slots"] == [3]
    assert results["graphs deferred, W in 2 parts"]["slots"] == [3]
    for mode in GPU_MODES[1:]:
        exact = mode == "graphs, W right after B"  # the same sums in the same order
        for (eager_losses, eager_grads, _), (losses, grads, untouched) in zip(
                eager["steps"], results[mode]["steps"], strict=True):
            assert untouched == ("deferred" in mode), mode
            assert losses == eager_losses, mode
            for eager_grad, grad in zip(eager_grads, grads, strict=True):
                assert eager_grad.abs().sum() > 0
                # deferred: the same kernels; the microbatches reach main_grad in W's order
                torch.testing.assert_close(grad, eager_grad, rtol=0 if exact else 1e-5,
                                           atol=0 if exact else 1e-6, msg=mode)
