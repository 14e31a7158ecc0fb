"""--use-dpp gives megatron-core's losses and gradients, and those of no pipelining; so
does --use-dpp --dpp-split-backward (B and W tasks), in the cases that pass it."""

from __future__ import annotations

import pytest
import torch

from megatron.dpp.plan import StageConfig, static_order
from megatron.dpp.policy import cost_order
from megatron.dpp.transport import native
from megatron.trainer.data.data import variable_length
from tests.distributed import run_ranks
from tests.pipeline_runs import TINY_GPT, compare_schedules, repeated_dpp_runs

ATOL = 2e-6


def _reference(num_layers: int, global_batch: int, task: str = "gpt"):
    """Losses and full gradients without pipelining, from one process."""
    flags = _flags(num_layers, global_batch)
    (result,) = run_ranks(1, compare_schedules, flags, 1, task)
    losses, grads = result["core"]
    return losses, {name: grad for name, (grad, _) in grads.items()}


def _flags(num_layers: int, global_batch: int, *extra):
    flags = list(TINY_GPT)
    flags[flags.index("--num-layers") + 1] = str(num_layers)
    return flags + ["--global-batch-size", str(global_batch), *extra]


def _check_against_reference(results, reference, key, gradients=True):
    ref_losses, ref_grads = reference
    # the last stage's ranks report; its tensor-parallel ranks report the same losses
    reporting = [r for r in results if r[key][0]]
    assert reporting, "no rank reported losses"
    replicas = {r["dp_rank"]: r[key][0] for r in reporting if r["tp_rank"] == 0}
    for r in reporting:
        assert r[key][0] == replicas[r["dp_rank"]]
    # data-parallel rank d's microbatch j holds the samples of the reference's microbatch
    # j * dp + d (data.MicroBatchIterator)
    dp = len(replicas)
    assert sorted(replicas) == list(range(dp))
    for dp_rank, losses in replicas.items():
        expected = ref_losses[dp_rank::dp]
        assert len(losses) == len(expected) > 0
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected),
                                   atol=1e-5, rtol=1e-6)
    if not gradients:
        return
    seen = set()
    for r in results:
        for name, (grad, split) in r[key][1].items():
            expected = ref_grads[name]
            if split >= 0 and r["tp_size"] > 1:
                expected = expected.chunk(r["tp_size"], dim=split)[r["tp_rank"]]
            torch.testing.assert_close(grad, expected, atol=ATOL, rtol=1e-5, msg=name)
            seen.add(name)
    assert seen == set(ref_grads), f"gradients missing: {set(ref_grads) - seen}"


def _check_dpp_matches_core(results, key="dpp"):
    for r in results:
        core_losses, core_grads = r["core"]
        dpp_losses, dpp_grads = r[key]
        torch.testing.assert_close(torch.tensor(dpp_losses), torch.tensor(core_losses),
                                   atol=1e-6, rtol=1e-6)
        if "core_eval" in r:
            torch.testing.assert_close(torch.tensor(r["dpp_eval"]), torch.tensor(r["core_eval"]),
                                       atol=1e-6, rtol=1e-6)
        assert core_grads.keys() == dpp_grads.keys()
        for name in core_grads:
            torch.testing.assert_close(dpp_grads[name][0], core_grads[name][0],
                                       atol=ATOL, rtol=1e-5, msg=name)


def _check_split(results, num_chunks, num_microbatches):
    """--dpp-split-backward: megatron-core's losses and gradients; every (chunk, microbatch)
    had its B and then its W through the store, and nothing is left pending."""
    _check_dpp_matches_core(results, "dpp_split")
    keys = sorted((c, i) for c in range(num_chunks) for i in range(num_microbatches))
    for r in results:
        assert r["split_pending"] == []
        calls = r["split_calls"]
        for kind in ("B", "W"):
            assert sorted(key for k, key in calls if k == kind) == keys
        assert all(calls.index(("B", key)) < calls.index(("W", key)) for key in keys)


# DPP with B and W tasks, run beside megatron-core and DPP without the split
SPLIT = ["--use-dpp", "--dpp-split-backward"]

CASES = {
    # name: (world size, layers, global batch, extra flags)
    "pp2": (2, 4, 8, ["--pipeline-model-parallel-size", "2", *SPLIT]),
    "pp2_m5": (2, 4, 10, ["--pipeline-model-parallel-size", "2"]),
    "pp2_vpp2": (2, 4, 8, ["--pipeline-model-parallel-size", "2",
                           "--virtual-pipeline-model-parallel-size", "2", *SPLIT]),
    # uneven split: layers 1-3 on the first stage, layer 4 + output layer and loss on the last
    "pp2_uneven": (2, 4, 8, ["--pipeline-model-parallel-size", "2",
                             "--decoder-first-pipeline-num-layers", "3"]),
    # chunks [1,2] [4,5] on the first stage, [3] [6] on the last
    "pp2_vpp2_uneven": (2, 6, 8, ["--pipeline-model-parallel-size", "2",
                                  "--virtual-pipeline-model-parallel-size", "2",
                                  "--decoder-first-pipeline-num-layers", "4"]),
    "pp4": (4, 4, 12, ["--pipeline-model-parallel-size", "4", *SPLIT]),
    # each W deferred as ZB-H1 defers them (the default runs it right after its B)
    "pp4_deferred": (4, 4, 12, ["--pipeline-model-parallel-size", "4", *SPLIT,
                                "--dpp-defer-weights"]),
    "pp4_vpp2": (4, 8, 16, ["--pipeline-model-parallel-size", "4",
                            "--virtual-pipeline-model-parallel-size", "2", *SPLIT]),
    "tp2_pp2": (4, 4, 8, ["--pipeline-model-parallel-size", "2",
                          "--tensor-model-parallel-size", "2", *SPLIT]),
    "tp2_pp2_sp": (4, 4, 8, ["--pipeline-model-parallel-size", "2",
                             "--tensor-model-parallel-size", "2", "--sequence-parallel", *SPLIT]),
    "dp2_pp2": (4, 4, 16, ["--pipeline-model-parallel-size", "2", *SPLIT]),
    # the store starts each chunk's (overlapped) reduction after its last W
    "dp2_pp2_distopt": (4, 4, 16, ["--pipeline-model-parallel-size", "2",
                                   "--use-distributed-optimizer", "--overlap-grad-reduce",
                                   *SPLIT]),
}

# global layer numbers (from 1) each pipeline rank holds where the split is uneven
STAGE_LAYERS = {"pp2_uneven": [[1, 2, 3], [4]], "pp2_vpp2_uneven": [[1, 2, 4, 5], [3, 6]]}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_dpp_equals_core_and_no_pipelining(case):
    world, layers, batch, extra = CASES[case]
    flags = _flags(layers, batch, *extra, "--dpp-transport", "torch")
    results = run_ranks(world, compare_schedules, flags, world)
    if case in STAGE_LAYERS:
        held = [sorted({int(name.split(".")[1]) for name in r["dpp"][1]
                        if name.startswith("layers.")}) for r in results]
        assert held == STAGE_LAYERS[case]
    _check_dpp_matches_core(results)
    reference = _reference(layers, batch)
    # the distributed optimizer leaves each replica only its shard of the reduced gradient
    # (the rest of main_grad is local): there the gradients are compared with core's only
    gradients = "--use-distributed-optimizer" not in extra
    _check_against_reference(results, reference, "dpp", gradients)
    if "--dpp-split-backward" in extra:
        _check_split(results, _chunks(extra), _microbatches(world, batch, extra))
        _check_against_reference(results, reference, "dpp_split", gradients)


def _chunks(extra) -> int:
    flag = "--virtual-pipeline-model-parallel-size"
    return int(extra[extra.index(flag) + 1]) if flag in extra else 1


def _microbatches(world, batch, extra) -> int:
    """Per data-parallel replica: the global batch over DP x the micro-batch size (2)."""
    sizes = {flag: int(extra[extra.index(flag) + 1]) if flag in extra else 1
             for flag in ("--pipeline-model-parallel-size", "--tensor-model-parallel-size")}
    data_parallel = world // (sizes["--pipeline-model-parallel-size"]
                              * sizes["--tensor-model-parallel-size"])
    return batch // (data_parallel * 2)


@pytest.mark.slow
def test_bert_dpp_equals_core_and_no_pipelining():
    """BERT (every stage reads the batch for its padding mask; two losses) at PP=2."""
    flags = _flags(4, 8, "--pipeline-model-parallel-size", "2", "--dpp-transport", "torch")
    results = run_ranks(2, compare_schedules, flags, 2, "bert")
    assert len(results[-1]["dpp"][0][0]) == 4  # [lm loss, tokens, sop loss, tokens]
    _check_dpp_matches_core(results)
    _check_against_reference(results, _reference(4, 8, "bert"), "dpp")


@pytest.mark.slow
def test_dpp_orders_variable_length_microbatches_and_matches_core():
    """--seq-length-cv: the trainer hands DPP the token counts, the plan runs the short
    microbatches first and last; losses (in microbatch order) and gradients stay megatron's."""
    lengths = [variable_length(64, 0.5, 1234, 2 * k) for k in range(8)]
    assert cost_order(lengths) != list(range(8))  # the case really reorders
    flags = _flags(4, 16, "--pipeline-model-parallel-size", "2", "--seq-length", "64",
                   "--max-position-embeddings", "64", "--seq-length-cv", "0.5",
                   "--dpp-transport", "torch")
    results = run_ranks(2, compare_schedules, flags, 2)
    _check_dpp_matches_core(results)


@pytest.mark.slow
def test_dpp_with_random_delivery_delays():
    """Messages delivered after random delays, so in scrambled order: same result."""
    world, layers, batch, extra = CASES["pp4_vpp2"]
    flags = _flags(layers, batch, *extra, "--dpp-transport", "torch")
    results = run_ranks(world, compare_schedules, flags, world,
                        env={"DPP_TEST_DELIVERY_JITTER_MS": "20"})
    _check_dpp_matches_core(results)
    _check_split(results, _chunks(extra), _microbatches(world, batch, extra))


@pytest.mark.slow
def test_dpp_decides_at_simulated_gpu_time():
    """The GPU-time decisions (megatron/dpp/gpu_queue.py) on a simulated device (each task
    3 ms, the host one task ahead) with arrivals delayed at random: megatron-core's losses
    and gradients, every W after its B."""
    world, layers, batch, extra = CASES["pp4"]
    flags = _flags(layers, batch, *extra, "--dpp-transport", "torch")
    results = run_ranks(world, compare_schedules, flags, world,
                        env={"DPP_TEST_SIMULATED_TASK_MS": "3",
                             "DPP_TEST_DELIVERY_JITTER_MS": "5"})
    _check_dpp_matches_core(results)
    _check_split(results, _chunks(extra), _microbatches(world, batch, extra))


@pytest.mark.slow
def test_static_replay_equals_core():
    """--dpp-static: the plan (interleaved, with the split and the W deferred its
    zero-bubble order) run in order on the DPP runtime gives megatron-core's losses and
    gradients."""
    world, layers, batch, extra = CASES["pp2_vpp2"]
    flags = _flags(layers, batch, *extra, "--dpp-static", "--dpp-defer-weights",
                   "--dpp-transport", "torch")
    results = run_ranks(world, compare_schedules, flags, world,
                        env={"DPP_TEST_DELIVERY_JITTER_MS": "5"})
    _check_dpp_matches_core(results)
    chunks, m = _chunks(extra), _microbatches(world, batch, extra)
    _check_split(results, chunks, m)
    for rank, r in enumerate(results):  # the B and W tasks ran in the deferred plan's order
        plan = static_order(StageConfig(rank, world, chunks, m, split_backward=True,
                                        defer_weights=True))
        assert r["split_calls"] == [(t.kind, (t.chunk, t.microbatch)) for t in plan
                                    if t.kind != "F"]


@pytest.mark.slow
def test_dropout_keyed_by_microbatch_not_by_order():
    """Dropout 0.1 at PP=2 x VPP=2: DPP steps that interleave each rank's two chunks'
    forwards differently (megatron's order at slack 0; at slack 2 more warm-up forwards,
    and arrivals delayed at random) give bit-identical losses and gradients, equal to
    megatron-core's; also with recomputation, which must replay the same masks."""
    world, layers, batch, layout = CASES["pp2_vpp2"]
    flags = _flags(layers, batch, *layout, "--hidden-dropout", "0.1", "--attention-dropout",
                   "0.1")
    runs = [(0, 0), (2, 20), (2, 20)]  # (slack, delivery jitter in ms)
    flag_sets = {"plain": flags, "recompute": flags + ["--recompute-activations"]}
    per_rank = run_ranks(world, repeated_dpp_runs, list(flag_sets.values()), world, runs)
    for index, name in enumerate(flag_sets):
        results = [rank[index] for rank in per_rank]
        assert results[0]["orders"][0] != results[0]["orders"][1], \
            f"{name}: the first stage ran its forwards in one order: the test shows nothing"
        for r in results:
            first_losses, first_grads = r["dpp"][0]
            for losses, grads in r["dpp"][1:]:
                assert losses == first_losses, name
                for grad_name, (grad, _) in grads.items():
                    assert torch.equal(grad, first_grads[grad_name][0]), (name, grad_name)
            _check_dpp_matches_core([{"core": r["core"], "dpp": r["dpp"][0]}])


@pytest.mark.slow
@pytest.mark.skipif(not native.available(), reason="native extension not built")
@pytest.mark.parametrize("case", ["pp2_vpp2", "pp4"])
def test_dpp_over_shared_memory(case):
    world, layers, batch, extra = CASES[case]
    flags = _flags(layers, batch, *extra, "--dpp-transport", "shm")
    results = run_ranks(world, compare_schedules, flags, world)
    _check_dpp_matches_core(results)
