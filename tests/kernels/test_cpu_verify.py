"""The fused CPU op of multi-token decode rows (kernels/cpu_verify.py) against its torch
reference: K/V written bit-identically, attention to fp32 rounding (atol/rtol 2e-5, far
below the O(0.1) error of a wrong position, head, block or causal limit); every variant this
CPU has (AVX-512F where present); scalar and AVX2 compute the same bits."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_verify as cv
from tests.kernels.test_cpu_decode import _case as _decode_case
from tests.kernels.test_cpu_decode import _isas as _decode_isas

needs_native = pytest.mark.skipif(not cv.available(), reason="native extension did not build here")


def _isas() -> list[int]:
    """cpu_decode's variants for this CPU (the same numbers) and AVX2 where torch sees it."""
    avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return _decode_isas() + ([cv.ISA_AVX2] if avx2 else [])


def _case(rows: list[tuple[int, int]], hq: int, hkv: int, d: int, bs: int = 16, seed: int = 0):
    """Rows of (context length, query tokens) over test_cpu_decode's random rope tables, cache
    and block tables; each row's tokens at the last positions of its context."""
    _, cos, sin, _, cache, _, tables, lens = _decode_case(
        [n for n, _ in rows], hq, hkv, d, bs=bs, layers=2, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(sum(q for _, q in rows), (hq + 2 * hkv) * d, generator=g)
    places = [(b, p) for b, (n, q) in enumerate(rows) for p in range(n - q, n)]
    positions = torch.tensor([p for _, p in places])
    slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for b, p in places])
    q_lens = torch.tensor([q for _, q in rows], dtype=torch.int32)
    qsl = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    return qkv, cos, sin, positions, cache, slots, tables, lens, qsl


def _run(fn, case, layer=1, **kw):
    qkv, cos, sin, pos, cache, slots, tables, lens, qsl = case
    cache = cache.clone()
    hq = qkv.shape[1] // cache.shape[5] - 2 * cache.shape[4]
    out = fn(qkv, cos, sin, pos, cache, layer, slots, tables, lens, qsl,
             cache.shape[5] ** -0.5, hq, **kw)
    return out, cache


ROWS = [
    ([(1, 1)], 9, 3, 64),                                      # one token, nothing cached
    ([(17, 1), (250, 9), (5, 5), (64, 3), (33, 2)], 9, 3, 64),  # SmolLM2's heads, mixed rows
    ([(40, 4), (3, 2)], 4, 4, 32),                             # no GQA
    ([(23, 6)], 8, 1, 8),                                      # group 8, D = 8
]


@needs_native
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("rows,hq,hkv,d", ROWS)
def test_matches_reference(isa, rows, hq, hkv, d):
    case = _case(rows, hq, hkv, d)
    ref, ref_cache = _run(cv.verify_attention_ref, case)
    out, cache = _run(cv.verify_attention, case, isa=isa)
    assert torch.equal(cache, ref_cache)  # the K/V written: bit for bit
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_native
def test_scalar_and_avx2_give_the_same_bits():
    if cv.ISA_AVX2 not in _isas():
        pytest.skip("no AVX2 here")
    case = _case(ROWS[1][0], 9, 3, 64, seed=3)
    assert torch.equal(_run(cv.verify_attention, case, isa=cv.ISA_SCALAR)[0],
                       _run(cv.verify_attention, case, isa=cv.ISA_AVX2)[0])


@needs_native
def test_one_token_rows_equal_the_one_token_op():
    from kernels import cpu_decode as cd
    case = _case([(17, 1), (250, 1), (64, 1)], 9, 3, 64, seed=5)
    qkv, cos, sin, pos, cache, slots, tables, lens, _ = case
    one, _ = _run(cv.verify_attention, case)
    c2 = cache.clone()
    ref = cd.decode_attention(qkv, cos, sin, pos, c2, 1, slots, tables, lens, 64 ** -0.5, 9)
    torch.testing.assert_close(one, ref, atol=2e-5, rtol=2e-5)


@needs_native
@pytest.mark.parametrize("bad", ["start_loc", "short_context", "block", "position", "slot"])
def test_bad_index_raises_before_writing(bad):
    qkv, cos, sin, pos, cache, slots, tables, lens, qsl = _case([(17, 3), (40, 2)], 4, 2, 16)
    if bad == "start_loc":
        qsl = torch.tensor([0, 3, 4], dtype=torch.int32)  # does not end at T = 5
    elif bad == "short_context":
        lens = torch.tensor([2, 40], dtype=torch.int32)  # 3 tokens in a context of 2
    elif bad == "block":
        tables[1, 1] = 64
    elif bad == "position":
        pos = pos.clone()
        pos[4] = 512
    else:
        slots = slots.clone()
        slots[0] = 64 * 16
    before = cache.clone()
    with pytest.raises(RuntimeError, match="cpu_verify"):
        cv.verify_attention(qkv, cos, sin, pos, cache, 1, slots, tables, lens, qsl, 0.25, 4)
    assert torch.equal(cache, before)
