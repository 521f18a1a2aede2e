"""The fused CPU decode op (kernels/cpu_decode.py) against its torch reference.

The K/V it writes must be bit-identical to the reference's (same rotary products and sum, no
FMA); the attention output agrees to fp32 rounding (another summation order, exp to ~1 ulp):
atol/rtol 2e-5 on O(1) values, far below the error of a wrong position, head or block (O(0.1)).
"""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode as cd

needs_native = pytest.mark.skipif(not cd.available(), reason="native extension did not build here")


def _isas() -> list[int]:
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        flags = set()
    return [cd.ISA_BEST, cd.ISA_SCALAR] + ([cd.ISA_AVX512] if "avx512f" in flags else [])


def _case(lens: list[int], hq: int, hkv: int, d: int, bs: int = 16, layers: int = 3,
          num_blocks: int = 64, seed: int = 0):
    """Random qkv, rope tables, cache, and per-sequence block tables of distinct shuffled
    blocks; each sequence's new token sits at position len - 1 of its own table."""
    g = torch.Generator().manual_seed(seed)
    t = len(lens)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    angles = torch.rand(512, d // 2, generator=g) * 6.3
    cos = torch.cat([angles.cos(), angles.cos()], 1)
    sin = torch.cat([-angles.sin(), angles.sin()], 1)
    cache = torch.randn(num_blocks, layers, 2, bs, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // bs) for n in lens) + 1  # one padding entry past every table
    tables = torch.zeros(t, width, dtype=torch.int32)
    slots = torch.empty(t, dtype=torch.int64)
    for i, n in enumerate(lens):
        row = [perm.pop() for _ in range(-(-n // bs))]
        tables[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
        slots[i] = row[(n - 1) // bs] * bs + (n - 1) % bs
    positions = torch.tensor(lens, dtype=torch.int64) - 1
    return qkv, cos, sin, positions, cache, slots, tables, torch.tensor(lens, dtype=torch.int32)


@needs_native
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("lens,hq,hkv,d", [
    ([1], 9, 3, 64),                       # SmolLM2's heads, first token
    ([17, 250, 5, 64, 33, 1, 16, 129], 9, 3, 64),  # 8 sequences, tails of blocks and of 16 lanes
    ([40, 3], 4, 4, 32),                   # no GQA, D = 32
    ([23], 8, 1, 6),                       # D not a multiple of 16: the scalar loop
])
def test_matches_reference(isa: int, lens: list[int], hq: int, hkv: int, d: int) -> None:
    qkv, cos, sin, pos, cache, slots, tables, ctx = _case(lens, hq, hkv, d)
    layer, scale = 1, d ** -0.5
    ref_cache = cache.clone()
    want = cd.decode_attention_ref(qkv, cos, sin, pos, ref_cache, layer, slots, tables, ctx,
                                   scale, hq)
    got = cd.decode_attention(qkv, cos, sin, pos, cache, layer, slots, tables, ctx, scale, hq, isa)
    assert torch.equal(cache, ref_cache), "the written K/V differ from the reference's"
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def _case_as(dtype: torch.dtype, *args, **kw):
    """`_case` with its float tensors (qkv, cos, sin, cache) in `dtype`."""
    qkv, cos, sin, pos, cache, slots, tables, ctx = _case(*args, **kw)
    return qkv.to(dtype), cos.to(dtype), sin.to(dtype), pos, cache.to(dtype), slots, tables, ctx


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_negative_slot_writes_nothing(dtype: torch.dtype) -> None:
    """Only the new slot's block changes; the cache is read and written in place (bf16 too)."""
    qkv, cos, sin, pos, cache, slots, tables, ctx = _case_as(dtype, [20, 7], 9, 3, 64)
    slots[1] = -1
    before, ptr = cache.clone(), cache.data_ptr()
    cd.decode_attention(qkv, cos, sin, pos, cache, 0, slots, tables, ctx, 0.125, 9)
    changed = (cache != before).any(dim=(1, 2, 3, 4, 5)).nonzero().flatten().tolist()
    assert changed == [int(slots[0]) // 16] and cache.data_ptr() == ptr


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", ["block", "len", "position", "slot"])
def test_bad_index_raises_before_writing(bad: str, dtype: torch.dtype) -> None:
    qkv, cos, sin, pos, cache, slots, tables, ctx = _case_as(dtype, [20, 7], 9, 3, 64)
    if bad == "block":
        tables[1, 0] = cache.shape[0]
    elif bad == "len":
        ctx[0] = tables.shape[1] * 16 + 1
    elif bad == "position":
        pos[0] = cos.shape[0]
    else:
        slots[0] = cache.shape[0] * 16
    before = cache.clone()
    with pytest.raises(RuntimeError, match="cpu_decode"):
        cd.decode_attention(qkv, cos, sin, pos, cache, 0, slots, tables, ctx, 0.125, 9)
    assert torch.equal(cache, before)


@needs_native
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("rows,width", [(1, 576), (8, 576), (3, 37), (2, 16)])
@pytest.mark.parametrize("residual", [False, True])
def test_add_rms_norm(isa: int, rows: int, width: int, residual: bool) -> None:
    g = torch.Generator().manual_seed(width + rows)
    h, r = torch.randn(rows, width, generator=g) * 3, torch.randn(rows, width, generator=g)
    w = torch.randn(width, generator=g)
    h_ref = h.clone()
    want = cd.add_rms_norm_ref(h_ref, r if residual else None, w, 1e-5)
    got = cd.add_rms_norm(h, r if residual else None, w, 1e-5, isa)
    assert torch.equal(h, h_ref), "the residual add must be the same fp32 sum"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if isa != cd.ISA_BEST:  # every variant sums the squares in the same lane order
        assert torch.equal(got, cd.add_rms_norm(h.clone(), None, w, 1e-5, cd.ISA_SCALAR))


@needs_native
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("rows,inter", [(1, 1536), (8, 1536), (2, 21)])
def test_silu_mul(isa: int, rows: int, inter: int) -> None:
    g = torch.Generator().manual_seed(inter)
    gu = torch.randn(rows, 2 * inter, generator=g) * 4
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    torch.testing.assert_close(cd.silu_mul(gu, isa), cd.silu_mul_ref(gu), atol=1e-6, rtol=1e-5)


@needs_native
def test_norm_ops_reject_wrong_shapes() -> None:
    with pytest.raises(RuntimeError, match="cpu_norm"):
        cd.add_rms_norm(torch.ones(2, 8), torch.ones(2, 7), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="cpu_norm"):
        cd.silu_mul(torch.ones(2, 7))


@needs_native
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,hq,hkv,d", [([17, 250, 5, 64, 33, 1, 16, 129], 9, 3, 64),
                                           ([40, 3], 4, 4, 32), ([23], 8, 1, 6)])
def test_attend_alone_gives_the_fused_ops_bits(isa, dtype, lens, hq, hkv, d) -> None:
    """decode_attend over q rotated (and K/V written) by the torch ops gives each token the
    same bits as decode_attention does from the unrotated row (a decode row of a step that
    also prefills is what it would be in a decode-only step)."""
    from kernels.cpu_rope import rope_write_ref

    qkv, cos, sin, pos, cache, slots, tables, ctx = _case_as(dtype, lens, hq, hkv, d)
    fused_cache, scale = cache.clone(), d ** -0.5
    want = cd.decode_attention(qkv, cos, sin, pos, fused_cache, 1, slots, tables, ctx, scale, hq,
                               isa)
    q = rope_write_ref(qkv, cos, sin, pos, cache, 1, slots, hq)
    assert torch.equal(cache, fused_cache)
    got = cd.decode_attend(q.contiguous(), cache, 1, tables, ctx, scale, isa)
    assert got.shape == (len(lens), hq, d) and torch.equal(got.view(len(lens), -1), want)


@needs_native
def test_attend_alone_rejects_bad_input() -> None:
    qkv, cos, sin, pos, cache, slots, tables, ctx = _case([20, 7], 4, 2, 32)
    q = torch.randn(2, 4, 32)
    bad_table = tables.clone()
    bad_table[0, 0] = cache.shape[0]
    for args, match in [((q, cache, 0, bad_table, ctx), "block id"),
                        ((q, cache, 3, tables, ctx), "layer"),
                        ((q.bfloat16(), cache, 0, tables, ctx), "dtype"),
                        ((q, cache, 0, tables, ctx + 100), "context length"),
                        ((torch.randn(2, 3, 32), cache, 0, tables, ctx), "Hq = g")]:
        with pytest.raises(RuntimeError, match=match):
            cd.decode_attend(*args, scale=0.2)
