"""The foreach stand-ins give what megatron-core's no-apex fallbacks give."""

from __future__ import annotations

import torch
from megatron.core import utils as core_utils
from megatron.core.optimizer import clip_grads

from megatron.trainer.core_compat import no_apex
from megatron.trainer.core_compat.cpu_compat import CpuCompat


def _tensors(seed: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in ((7, 3), (11,), (4, 5, 6))]


def test_l2_norm_matches_fallback():
    tensors = _tensors(0)
    with CpuCompat():  # the fallback puts its result on "cuda"
        expected, _ = core_utils.local_multi_tensor_l2_norm(0, None, [tensors], False)
    total, per_tensor = no_apex.foreach_l2_norm(0, None, [tensors], True)
    assert total.shape == (1,) and total.dtype == torch.float32
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(per_tensor, torch.stack([t.norm() for t in tensors]))


def test_scale_in_place_and_across_dtypes():
    grads = _tensors(1)
    expected = [g * 0.25 for g in grads]
    no_apex.foreach_scale(0, None, [grads, grads], 0.25)
    for got, want in zip(grads, expected, strict=True):
        assert torch.equal(got, want)
    main = _tensors(2)
    model_fallback = [torch.zeros_like(t, dtype=torch.bfloat16) for t in main]
    model_foreach = [torch.zeros_like(t, dtype=torch.bfloat16) for t in main]
    core_utils.local_multi_tensor_scale(0, None, [main, model_fallback], 1.0)
    no_apex.foreach_scale(0, None, [main, model_foreach], 1.0)
    for got, want in zip(model_foreach, model_fallback, strict=True):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_swap_is_undone():
    assert clip_grads.l2_norm_impl is core_utils.local_multi_tensor_l2_norm
    with no_apex.foreach_multi_tensor_ops():
        assert clip_grads.l2_norm_impl is no_apex.foreach_l2_norm
        assert clip_grads.multi_tensor_scale_impl is no_apex.foreach_scale
    assert clip_grads.l2_norm_impl is core_utils.local_multi_tensor_l2_norm
    assert clip_grads.multi_tensor_scale_impl is core_utils.local_multi_tensor_scale
