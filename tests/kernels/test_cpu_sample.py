"""kernels/cpu_sample.py: argmax and logsumexp per row against torch, every variant; ties take
the first index; rows do not depend on the batch; bad input raises."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_sample as cs

pytestmark = pytest.mark.skipif(not cs.available(), reason="the native extension did not build")


def _variants() -> list[int]:
    from baton.dtypes import cpu_flags

    return [cs.ISA_BEST, cs.ISA_SCALAR] + ([cs.ISA_AVX512] if "avx512f" in cpu_flags() else [])


@pytest.mark.parametrize("isa", _variants())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,v", [(1, 49152), (3, 37), (8, 1000), (2, 1), (5, 16)])
def test_matches_torch(isa: int, dtype: torch.dtype, b: int, v: int) -> None:
    x = (torch.randn(b, v, generator=torch.Generator().manual_seed(b * v)) * 4).to(dtype)
    ids, lse = cs.greedy_lse(x, isa)
    ref_ids, ref_lse = cs.greedy_lse_ref(x)
    assert ids.dtype == torch.int64 and lse.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("isa", _variants())
def test_ties_take_the_first_index_and_rows_are_independent(isa: int) -> None:
    x = torch.zeros(4, 100)
    x[0, [7, 23, 71]] = 3.0     # three lanes hold the max: the smallest index wins
    x[1, [40, 24]] = 2.0        # same lane (index mod 16)
    x[2, 99] = 1.0              # in the tail past the last 16
    x[3] = float("-inf")
    x[3, 50] = 0.0
    ids, lse = cs.greedy_lse(x, isa)
    assert ids.tolist() == [7, 24, 99, 50]
    assert lse[3].item() == 0.0
    for i in range(4):
        one_ids, one_lse = cs.greedy_lse(x[i:i + 1], isa)
        assert one_ids.item() == ids[i].item() and one_lse.item() == lse[i].item()


def test_bad_input_raises() -> None:
    with pytest.raises(RuntimeError, match="greedy_lse"):
        cs.greedy_lse(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="greedy_lse"):
        cs.greedy_lse(torch.zeros(3))
    with pytest.raises(RuntimeError, match="greedy_lse"):
        cs.greedy_lse(torch.zeros(4, 6)[:, ::2])
