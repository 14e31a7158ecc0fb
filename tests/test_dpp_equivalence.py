"""--use-dpp gives megatron-core's losses and gradients, and those of no pipelining; so
does --use-dpp --dpp-split-backward (B and W tasks), in the cases that pass it."""

from __future__ import annotations

import pytest
import torch

from megatron.dpp.policy import cost_order
from megatron.dpp.transport import native
from megatron.training.data import variable_length
from tests.distributed import run_ranks
from tests.pipeline_runs import TINY_GPT, compare_schedules

ATOL = 2e-6


def _reference(num_layers: int, global_batch: int):
    """Losses and full gradients without pipelining, from one process."""
    flags = _flags(num_layers, global_batch)
    (result,) = run_ranks(1, compare_schedules, flags, 1)
    losses, grads = result["core"]
    return losses, {name: grad for name, (grad, _) in grads.items()}


def _flags(num_layers: int, global_batch: int, *extra):
    flags = list(TINY_GPT)
    flags[flags.index("--num-layers") + 1] = str(num_layers)
    return flags + ["--global-batch-size", str(global_batch), *extra]


def _mean_loss(losses):
    total = torch.tensor(losses).sum(dim=0)
    return float(total[0] / total[1])


def _check_against_reference(results, reference, key, gradients=True):
    ref_losses, ref_grads = reference
    pipeline_losses = [r[key][0] for r in results if r[key][0]]
    # data-parallel replicas each hold their share of the microbatches
    assert pipeline_losses, "no rank reported losses"
    merged = [pair for losses in pipeline_losses[: len(pipeline_losses)] for pair in losses]
    assert _mean_loss(merged) == pytest.approx(_mean_loss(ref_losses), abs=1e-6)
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
                           "--virtual-pipeline-model-parallel-size", "2",
                           "--no-batch-p2p-comm", *SPLIT]),
    # uneven split: layers 1-3 on the first stage, layer 4 + output layer and loss on the last
    "pp2_uneven": (2, 4, 8, ["--pipeline-model-parallel-size", "2",
                             "--decoder-first-pipeline-num-layers", "3"]),
    # chunks [1,2] [4,5] on the first stage, [3] [6] on the last
    "pp2_vpp2_uneven": (2, 6, 8, ["--pipeline-model-parallel-size", "2",
                                  "--virtual-pipeline-model-parallel-size", "2",
                                  "--decoder-first-pipeline-num-layers", "4",
                                  "--no-batch-p2p-comm"]),
    "pp4": (4, 4, 12, ["--pipeline-model-parallel-size", "4", *SPLIT]),
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


def test_dpp_with_random_delivery_delays():
    """Messages delivered after random delays, so in scrambled order: same result."""
    world, layers, batch, extra = CASES["pp4_vpp2"]
    flags = _flags(layers, batch, *extra, "--dpp-transport", "torch")
    results = run_ranks(world, compare_schedules, flags, world,
                        env={"DPP_TEST_DELIVERY_JITTER_MS": "20"})
    _check_dpp_matches_core(results)
    _check_split(results, _chunks(extra), _microbatches(world, batch, extra))


@pytest.mark.skipif(not native.available(), reason="native extension not built")
@pytest.mark.parametrize("case", ["pp2_vpp2", "pp4"])
def test_dpp_over_shared_memory(case):
    world, layers, batch, extra = CASES[case]
    flags = _flags(layers, batch, *extra, "--dpp-transport", "shm")
    results = run_ranks(world, compare_schedules, flags, world)
    _check_dpp_matches_core(results)
