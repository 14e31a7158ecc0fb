"""--multi-latent-attention: megatron-core's MLA layers (local spec, SDPA core with MLA's
separate q/k and v head dims) train on CPU with the same losses without pipelining, at
PP=2 under megatron-core's schedule and under --use-dpp."""

from __future__ import annotations

import re

import pytest
import torch

from megatron.trainer.config.arguments import ArgumentError, parse_args
from tests.distributed import run_ranks
from tests.trainer_runs import TINY, train_runs, with_flags

# q/k heads of 8 + 4 rotary channels, v heads of 6: SDPA with value heads of another size
MLA = [*TINY, "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "8",
       "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
       "--train-iters", "3", "--global-batch-size", "8",
       # attention scores far enough from 0 that the rotary frequencies change the loss
       "--init-method-std", "0.2"]


@pytest.mark.slow
def test_mla_trains_with_equal_losses_at_pp1_and_pp2():
    pp2 = with_flags(MLA, pipeline_model_parallel_size=2)
    runs = [MLA, pp2, with_flags(pp2, use_dpp=True),
            with_flags(pp2, use_dpp=True, rotary_scaling_factor=4)]
    # the same 8 samples every iteration: the loss must fall
    results = run_ranks(2, train_runs, runs, 2, "gpt", 8)
    single, core, dpp, scaled = ([r[k] for r in results] for k in range(len(runs)))
    reference = [step["lm loss"] for step in single[0]["losses"]]  # PP=1, data-parallel 2
    assert reference == sorted(reference, reverse=True) and reference[0] > reference[-1]
    for run in (core, dpp):
        losses = [step["lm loss"] for step in run[1]["losses"]]  # the last stage reports
        torch.testing.assert_close(losses, reference, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(run[1]["grad_norms"], single[0]["grad_norms"],
                                   atol=1e-5, rtol=1e-5)
    # YaRN's scaling changes the rotary frequencies of MLA's position channels
    scaled_losses = [step["lm loss"] for step in scaled[1]["losses"]]
    assert abs(scaled_losses[0] - reference[0]) > 1e-3


@pytest.mark.parametrize("extra, message", [
    (["--rotary-scaling-factor", "4"], "--rotary-scaling-factor 4.0: MLA's rotary embedding, "
     "needs --multi-latent-attention"),
    (["--rope-type", "yarn"], "--rope-type yarn: MLA's rotary embedding"),
    (["--multi-latent-attention", "--group-query-attention", "--num-query-groups", "2"],
     "mutually exclusive"),
    (["--multi-latent-attention", "--qk-pos-emb-head-dim", "3"], "must be even"),
    (["--multi-latent-attention", "--kv-lora-rank", "0"], "--kv-lora-rank 0 must be >= 1"),
    (["--multi-latent-attention", "--rope-type", "rope", "--mscale", "2"],
     "--mscale with --rope-type rope"),
])
def test_what_mla_cannot_take_is_refused(extra, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        parse_args(TINY + extra, world_size=1)


def test_bert_has_no_mla():
    with pytest.raises(ArgumentError, match="BERT has no MLA"):
        parse_args(TINY + ["--multi-latent-attention"], world_size=1, model="bert")


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="MLA's fused YaRN RoPE (Triton) and the fast path need a CUDA GPU")
@pytest.mark.long
def test_mla_fast_path_on_gpu_equals_unfused_eager():
    """Local MLA layers with the GPU defaults (fused YaRN RoPE, CUDA-graph blocks, fused
    cross-entropy) against the same run unfused and eager: the same losses."""
    # the fused kernel's Triton ranges (q/k head, v head, half the rotary channels) are
    # powers of two
    flags = with_flags(MLA, transformer_impl="local", v_head_dim=8)
    runs = [flags, [*flags, "--no-rope-fusion", "--cuda-graph-impl", "none",
                    "--no-cross-entropy-loss-fusion"]]
    fast, plain = run_ranks(1, train_runs, runs, 1, "gpt", 8, gpu=True)[0]
    assert not [m for _, m in fast["logs"] if " off: " in m]
    torch.testing.assert_close([s["lm loss"] for s in fast["losses"]],
                               [s["lm loss"] for s in plain["losses"]], atol=1e-4, rtol=1e-4)
