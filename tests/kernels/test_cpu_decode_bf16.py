"""The fused CPU decode ops (kernels/cpu_decode.py) on bf16 tensors against torch references.

- The K/V the attention op writes and the residual stream add_rms_norm updates must be
  bit-identical to the torch bf16 path's (the same roundings, replayed).
- Outputs follow STYLE.md's rule (tests/kernels/util.py): max|kernel − ref_fp32| ≤
  2·max|torch bf16 − ref_fp32| + atol, ref_fp32 being the torch reference in fp32 on the same
  bf16 inputs (for attention: the same rotated, bf16-rounded q and cache).
- Batch invariance: a token's output does not depend on the other tokens of the step.
"""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode as cd
from kernels.cpu_rope import rotate_ref
from tests.kernels.test_cpu_decode import _case
from tests.kernels.util import assert_close_to_fp32

needs_native = pytest.mark.skipif(not cd.available(), reason="native extension did not build here")


def _has_avx512f() -> bool:
    try:
        return "avx512f" in open("/proc/cpuinfo").read().split()
    except OSError:
        return False


VARIANTS = [pytest.param(cd.ISA_BEST, id="best"), pytest.param(cd.ISA_SCALAR, id="scalar"),
            pytest.param(cd.ISA_AVX512, id="avx512", marks=pytest.mark.skipif(
                not _has_avx512f(), reason="this CPU has no AVX-512F variant (flag avx512f)"))]
CASES = [
    ([1], 9, 3, 64),                                # SmolLM2's heads, first token
    ([17, 250, 5, 64, 33, 1, 16, 129], 9, 3, 64),   # 8 sequences, tails of blocks and of 16 lanes
    ([40, 3], 4, 4, 32),                            # no GQA, D = 32
    ([23], 8, 1, 6),                                # D not a multiple of 16: the scalar loop
    ([300, 2], 4, 2, 16),                           # the tiny test models' head size
    ([70, 19], 8, 1, 64),                           # 8 heads per KV head: no pv64
]


def _bf16_case(lens, hq, hkv, d, seed=0):
    qkv, cos, sin, pos, cache, slots, tables, ctx = _case(lens, hq, hkv, d, seed=seed)
    return qkv.bfloat16(), cos.bfloat16(), sin.bfloat16(), pos, cache.bfloat16(), slots, tables, ctx


def _rotated_q(qkv, cos, sin, pos, hq, d):
    heads = qkv.view(qkv.shape[0], -1, d)[:, :hq]
    return rotate_ref(heads, cos[pos][:, None], sin[pos][:, None])  # bf16 ops, as the reference


@needs_native
@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("lens,hq,hkv,d", CASES)
def test_attention_matches_reference(isa, lens, hq, hkv, d):
    qkv, cos, sin, pos, cache, slots, tables, ctx = _bf16_case(lens, hq, hkv, d)
    layer, scale = 1, d ** -0.5
    ref_cache = cache.clone()
    want = cd.decode_attention_ref(qkv, cos, sin, pos, ref_cache, layer, slots, tables, ctx,
                                   scale, hq)
    got = cd.decode_attention(qkv, cos, sin, pos, cache, layer, slots, tables, ctx, scale, hq, isa)
    assert got.dtype == torch.bfloat16
    assert torch.equal(cache, ref_cache), "the written K/V differ from the torch bf16 path's"
    q = _rotated_q(qkv, cos, sin, pos, hq, d)
    ref32 = cd.attend_ref(q.float(), cache.float(), layer, tables, ctx, scale)
    assert_close_to_fp32(got, want, ref32)


@needs_native
@pytest.mark.parametrize("isa", VARIANTS)
def test_attention_is_batch_invariant(isa):
    lens, hq, hkv, d = CASES[1]
    qkv, cos, sin, pos, cache, slots, tables, ctx = _bf16_case(lens, hq, hkv, d, seed=1)
    whole = cd.decode_attention(qkv, cos, sin, pos, cache.clone(), 0, slots, tables, ctx, 0.125,
                                hq, isa)
    for t in range(len(lens)):
        one = slice(t, t + 1)
        alone = cd.decode_attention(qkv[one], cos, sin, pos[one], cache.clone(), 0, slots[one],
                                    tables[one], ctx[one], 0.125, hq, isa)
        assert torch.equal(alone[0], whole[t]), f"token {t}"


@needs_native
@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("lens", [[500, 10, 10], [30, 480], [400, 20, 20, 300, 5]])
def test_attention_bits_do_not_depend_on_the_thread_split(isa, lens):
    """Threads take runs of (token, KV head) units cut by context length, so with unequal
    contexts a token's heads may be split between threads ([500, 10, 10] on 2 threads: two of
    its heads on one, the third on the other): the same bits on 1, 2 and 3 threads."""
    qkv, cos, sin, pos, cache, slots, tables, ctx = _bf16_case(lens, 9, 3, 64, seed=2)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(cd.decode_attention(qkv, cos, sin, pos, cache.clone(), 0, slots, tables,
                                            ctx, 0.125, 9, isa))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_native
def test_mixed_dtypes_raise_before_writing():
    """(Bad indices and negative slots: tests/kernels/test_cpu_decode.py, fp32 and bf16.)"""
    qkv, cos, sin, pos, cache, slots, tables, ctx = _bf16_case([20, 7], 9, 3, 64)
    before = cache.clone()
    for args in ((qkv.float(), cos, sin), (qkv, cos.float(), sin.float())):
        with pytest.raises(RuntimeError, match="cpu_decode: .* must be a contiguous CPU tensor"):
            cd.decode_attention(*args, pos, cache, 0, slots, tables, ctx, 0.125, 9)
    assert torch.equal(cache, before)


@needs_native
@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("rows,width", [(1, 576), (8, 576), (3, 37), (2, 16), (100, 40)])
@pytest.mark.parametrize("residual", [False, True])
def test_add_rms_norm(isa, rows, width, residual):
    g = torch.Generator().manual_seed(width + rows)
    h = (torch.randn(rows, width, generator=g) * 3).bfloat16()
    r = torch.randn(rows, width, generator=g).bfloat16()
    w = torch.randn(width, generator=g).bfloat16()
    h_ref = h.clone()
    want = cd.add_rms_norm_ref(h_ref, r if residual else None, w, 1e-5)
    got = cd.add_rms_norm(h, r if residual else None, w, 1e-5, isa)
    assert torch.equal(h, h_ref), "the residual add must round like torch's bf16 add"
    ref32 = cd.add_rms_norm_ref(h_ref.float(), None, w.float(), 1e-5)
    assert_close_to_fp32(got, want, ref32)
    if isa != cd.ISA_BEST:  # every variant sums the squares in the same lane order
        assert torch.equal(got, cd.add_rms_norm(h.clone(), None, w, 1e-5, cd.ISA_SCALAR))


@needs_native
@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (8, 1536), (2, 21), (50, 40)])
def test_silu_mul(isa, rows, inter):
    g = torch.Generator().manual_seed(inter)
    gu = torch.randn(rows, 2 * inter, generator=g) * 4
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    gu = gu.bfloat16()
    got = cd.silu_mul(gu, isa)
    assert_close_to_fp32(got, cd.silu_mul_ref(gu), cd.silu_mul_ref(gu.float()))


@needs_native
def test_norm_ops_write_into_a_buffer_with_the_gemm_rows():
    """rows > T: the output is the first T rows of a zero-tailed [rows, W] buffer, with the
    same bits as without (decoder.py hands it to the next GEMM, which pads to `rows`)."""
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(37, 64, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    gu = torch.randn(37, 80, generator=g).bfloat16()
    for got, want, width in ((cd.add_rms_norm(h.clone(), None, w, 1e-5, rows=48),
                              cd.add_rms_norm(h.clone(), None, w, 1e-5), 64),
                             (cd.silu_mul(gu, rows=48), cd.silu_mul(gu), 40)):
        assert torch.equal(got, want) and got.shape == (37, width)
        buf = got.as_strided((48, width), (width, 1))
        assert got.untyped_storage().nbytes() == 48 * width * 2 and buf[37:].abs().sum() == 0
    assert cd.silu_mul(gu, rows=30).untyped_storage().nbytes() == 37 * 40 * 2  # plain output


@needs_native
def test_norm_ops_reject_mixed_dtypes():
    h = torch.ones(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cpu_norm"):
        cd.add_rms_norm(h, None, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="cpu_norm"):
        cd.add_rms_norm(h.half(), None, torch.ones(8, dtype=torch.half), 1e-5)
