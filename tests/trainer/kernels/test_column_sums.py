"""column_sums: the layers' bias gradients (a product with a row of ones) and the finishing of
per-program partial sums against float64, and the launch shape of the kernels that leave
partial sums."""

from __future__ import annotations

import pytest
import torch

from megatron.trainer.kernels import column_sums

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="the column sum's GEMM path runs on a CUDA GPU")


@needs_gpu
@pytest.mark.parametrize("shape,dtype", [((4096, 6144), torch.bfloat16),
                                         ((2048, 2, 2048), torch.bfloat16),
                                         ((37, 1000), torch.float32),
                                         ((5, 3, 130), torch.float16),
                                         ((1, 7), torch.float32)])
def test_column_sum_matches_float64(shape, dtype):
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=generator).to("cuda", dtype)
    rows = x.reshape(-1, shape[-1])
    exact = rows.double().sum(0)
    got = column_sums.column_sum(x)
    assert got.shape == (shape[-1],) and got.dtype == dtype
    # accumulated in fp32, rounded once to the dtype: within one of its ulps of the exact sum
    ulp = exact.abs() * torch.finfo(dtype).eps + 1e-6 * rows.shape[0]
    assert ((got.double() - exact).abs() <= ulp).all()
    assert torch.equal(column_sums.column_sum(x), got)  # bitwise repeatable
    assert torch.equal(column_sums.column_sum(x, torch.float32), got.float())


@needs_gpu
@pytest.mark.parametrize("shape", [(2, 132, 2048), (64, 8192), (2, 5, 7), (1, 1500, 33)])
def test_finish_sums_the_partial_rows_once_rounded(shape):
    """The norm's [weight, bias] partials, bias-GeLU's, odd sizes, and more rows than one
    tile holds (torch's path)."""
    generator = torch.Generator().manual_seed(5)
    partials = torch.randn(shape, generator=generator).cuda()
    exact = partials.double().sum(-2)
    got = column_sums.finish(partials, torch.bfloat16)
    assert got.shape == exact.shape and got.dtype == torch.bfloat16
    ulp = exact.abs() * torch.finfo(torch.bfloat16).eps + 1e-5 * shape[-2]
    assert ((got.double() - exact).abs() <= ulp).all()
    assert torch.equal(column_sums.finish(partials, torch.bfloat16), got)


def test_row_programs_cover_the_rows_in_whole_blocks():
    for rows, column_programs, block in ((4096, 8, 4), (37, 3, 8), (1, 600, 4), (5000, 1, 32)):
        programs, per_program = column_sums.row_programs(rows, column_programs, block)
        assert per_program % block == 0
        assert (programs - 1) * per_program < rows <= programs * per_program
        assert programs * column_programs <= max(column_sums.TARGET_PROGRAMS, column_programs)


def test_available_only_for_floating_point_cuda_tensors():
    assert not column_sums.available(torch.ones(4, 4))
    if torch.cuda.is_available():
        assert column_sums.available(torch.ones(4, 4, device="cuda"))
        assert not column_sums.available(torch.ones(4, 4, device="cuda", dtype=torch.int32))
        assert not column_sums.available(torch.ones(0, 4, device="cuda"))
