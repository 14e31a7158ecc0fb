"""column_sums: the layers' bias gradients (a product with a row of ones) against float64, and
the launch shape of the kernels that leave partial sums (their finishing is checked through
the norm's and bias-GeLU's gradients, tests/test_triton_norm.py and test_triton_gelu.py)."""

from __future__ import annotations

import pytest
import torch

from megatron.trainer import column_sums

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
