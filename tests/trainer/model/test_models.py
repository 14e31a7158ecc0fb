"""The project's layer spec: SDPA core attention computes what megatron.core's own
DotProductAttention computes, and the config avoids kernels that are not installed."""

from __future__ import annotations

import contextlib

import torch

from tests.distributed import run_ranks
from tests.pipeline_runs import TINY_GPT, one_step


def _loss_and_grads(rank, stock: bool):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.model import models
    from megatron.trainer.model.attention import SDPAttention
    from megatron.trainer.run.training import setup
    from megatron.trainer.tasks.gpt import GPT_TASK

    # the stock core needs CUDA in production; under the CPU compatibility layer it runs
    models._stock_attention = lambda args: stock
    args = parse_args(TINY_GPT + ["--global-batch-size", "4"], world_size=1)
    with contextlib.ExitStack() as stack:
        trainer = setup(GPT_TASK, args, stack)
        cores = {type(m) for m in trainer.model[0].modules()}
        expected = DotProductAttention if stock else SDPAttention
        assert expected in cores, cores
        losses, grads = one_step(trainer, trainer.schedule, args.num_microbatches)
        fused = trainer.config.masked_softmax_fusion
    return losses, {name: grad for name, (grad, _) in grads.items()}, fused


def test_sdpa_core_matches_megatron_dot_product_attention():
    (sdpa,) = run_ranks(1, _loss_and_grads, False)
    (stock,) = run_ranks(1, _loss_and_grads, True)
    torch.testing.assert_close(torch.tensor(sdpa[0]), torch.tensor(stock[0]),
                               atol=1e-5, rtol=1e-6)
    assert sdpa[1].keys() == stock[1].keys()
    for name in sdpa[1]:
        torch.testing.assert_close(sdpa[1][name], stock[1][name], atol=1e-5, rtol=1e-4,
                                   msg=name)
    # the fused softmax kernels (apex / Megatron-LM builds) are not installed here, so the
    # config must not ask megatron.core for them (it would fail at the first forward)
    assert sdpa[2] is False and stock[2] is False
