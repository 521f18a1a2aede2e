"""kernels.cpu_prefill: the native bf16 prefill attention (AVX512_BF16, and AMX where the CPU
has it) against its torch reference (STYLE.md's rule: max|native − ref_fp32| ≤ 2·max|torch bf16
SDPA − ref_fp32| + atol), invariant to chunking, thread count and the other sequences of a
step, and strict on bad input. Skipped on CPUs without AVX512_BF16 (the callers keep torch's
SDPA there); the AMX cases skip on CPUs without AMX."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_prefill as cp
from kernels.paged_cpu import PagedAttentionPlan
from kernels.prefill_attention import prefill_attention_ref
from tests.kernels.util import assert_close_to_fp32, make_block_tables, make_kv_cache

pytestmark = pytest.mark.skipif(not cp.available(),
                                reason="needs the native extension and AVX512_BF16")
NB, L, BS, HKV, D = 96, 2, 16, 2, 64
# every item the CPU has: the AVX512_BF16 one and, with AMX, the tile one (prefill_amx.h)
ISAS = [pytest.param(cp.ISA_AVX512_BF16, id="avx512bf16"),
        pytest.param(cp.ISA_AMX, id="amx", marks=pytest.mark.skipif(
            not cp.amx_available(), reason="needs AMX-BF16 enabled by the OS"))]


def _case(seq_len: int, q_len: int, hq: int = 6, seed: int = 0):
    cache = make_kv_cache(NB, L, BS, HKV, D, torch.bfloat16, seed)
    table = make_block_tables([seq_len], BS, NB, NB, fill=-1, seed=seed)[0]
    q = torch.randn(q_len, hq, D, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    return q, cache, table


def _torch_bf16(q, cache, table, seq_len, scale):
    """torch's bf16 SDPA over the gathered context (what the paged path ran before)."""
    pos = torch.arange(seq_len)
    blocks = table.long()[pos // BS]
    k, v = cache[blocks, 1, 0, pos % BS], cache[blocks, 1, 1, pos % BS]
    mask = pos[None, :] <= torch.arange(seq_len - q.shape[0], seq_len)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("seq_len,q_len", [(1, 1), (17, 17), (40, 7), (100, 100), (333, 64),
                                           (600, 600), (70, 1)])
def test_matches_reference(seq_len, q_len, isa):
    q, cache, table = _case(seq_len, q_len, seed=seq_len)
    got = cp.prefill_attention(q, cache, 1, table, seq_len, 0.125, isa=isa)
    ref32 = cp.prefill_attention_ref(q, cache, 1, table, seq_len, 0.125)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert_close_to_fp32(got, _torch_bf16(q, cache, table, seq_len, 0.125), ref32)


@pytest.mark.parametrize("isa", ISAS)
def test_strided_query_and_other_group_sizes(isa):
    for hq in (2, 8, 10):  # group 1, 4 and 5 (rows of a token cross AMX's 16-row groups)
        q, cache, table = _case(90, 90, hq=hq, seed=hq)
        wide = torch.zeros(90, hq + 3, D, dtype=torch.bfloat16)
        wide[:, :hq] = q
        got = cp.prefill_attention(wide[:, :hq], cache, 0, table, 90, 0.2, isa=isa)
        assert torch.equal(got, cp.prefill_attention(q.contiguous(), cache, 0, table, 90, 0.2,
                                                     isa=isa))
        ref32 = cp.prefill_attention_ref(q, cache, 0, table, 90, 0.2)
        assert (got.float() - ref32).abs().max().item() < 0.02


@pytest.mark.parametrize("isa", ISAS)
def test_chunking_and_threads_do_not_change_bits(isa):
    q, cache, table = _case(500, 500, seed=3)
    whole = cp.prefill_attention(q, cache, 0, table, 500, 0.125, isa=isa)
    parts, start = [], 0
    for end in (1, 37, 256, 257, 500):  # chunks of 1, 36, 219, 1, 243 tokens
        parts.append(cp.prefill_attention(q[start:end], cache, 0, table, end, 0.125, isa=isa))
        start = end
    assert torch.equal(torch.cat(parts), whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cp.prefill_attention(q, cache, 0, table, 500, 0.125, isa=isa), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not cp.amx_available(), reason="needs AMX-BF16 enabled by the OS")
def test_best_isa_is_amx_where_it_runs_and_head_size_allows():
    """ISA_BEST takes the AMX item for D % 32 == 0 and the AVX512_BF16 one otherwise, so every
    process on one machine writes the same KV; ISA_AMX refuses a head size it cannot take."""
    q, cache, table = _case(130, 130, seed=9)
    best = cp.prefill_attention(q, cache, 0, table, 130, 0.125)
    assert torch.equal(best, cp.prefill_attention(q, cache, 0, table, 130, 0.125, isa=cp.ISA_AMX))
    cache48 = make_kv_cache(16, 1, BS, HKV, 48, torch.bfloat16, 1)
    table48 = make_block_tables([40], BS, 16, 16, fill=-1, seed=1)[0]
    q48 = torch.randn(40, 4, 48).bfloat16()
    assert torch.equal(cp.prefill_attention(q48, cache48, 0, table48, 40, 0.1),
                       cp.prefill_attention(q48, cache48, 0, table48, 40, 0.1,
                                            isa=cp.ISA_AVX512_BF16))
    with pytest.raises(RuntimeError, match="D % 32"):
        cp.prefill_attention(q48, cache48, 0, table48, 40, 0.1, isa=cp.ISA_AMX)


@pytest.mark.parametrize("isa", ISAS)
def test_short_suffix_over_long_context_same_bits_on_any_threads(isa):
    """An agent's next turn: a few query tokens over a long cached context. The op then cuts
    its work into smaller items so every thread gets some (cpu_prefill.cpp): a row's bits stay
    those of the whole prompt in one call, on 1-4 threads."""
    q, cache, table = _case(1400, 1400, seed=7)
    whole = cp.prefill_attention(q, cache, 1, table, 1400, 0.125, isa=isa)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            for tail in (1, 5, 16, 30):
                got = cp.prefill_attention(q[-tail:], cache, 1, table, 1400, 0.125, isa=isa)
                assert torch.equal(got, whole[-tail:]), (n, tail)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_size,block_size", [(48, 16), (96, 16), (128, 8), (64, 5)])
def test_other_head_and_block_sizes(head_size, block_size, isa):
    """K/V packing both ways (AVX-512 transposes where D % 32 == 0, word by word otherwise)
    and blocks that do not hold whole 16-position groups: the reference rule, and a suffix
    equal to the same rows of the whole prompt."""
    hkv, seq_len, nb = 2, 203, 64
    cache = make_kv_cache(nb, L, block_size, hkv, head_size, torch.bfloat16, head_size)
    table = make_block_tables([seq_len], block_size, nb, nb, fill=-1, seed=head_size)[0]
    q = torch.randn(seq_len, 4, head_size,
                    generator=torch.Generator().manual_seed(block_size)).bfloat16()
    if isa == cp.ISA_AMX and head_size % 32:
        isa = cp.ISA_BEST  # the AMX item takes D % 32 == 0 only; ISA_BEST falls back
    got = cp.prefill_attention(q, cache, 1, table, seq_len, 0.1, isa=isa)
    ref32 = cp.prefill_attention_ref(q, cache, 1, table, seq_len, 0.1)
    assert (got.float() - ref32).abs().max().item() < 0.02
    tail = cp.prefill_attention(q[-9:], cache, 1, table, seq_len, 0.1, isa=isa)
    assert torch.equal(tail, got[-9:])


def test_plan_takes_native_path_per_sequence():
    """Two sequences in one step through PagedAttentionPlan: each equals its own call alone (no
    row depends on the other sequence) and the paged reference within the tolerance rule."""
    lens, q_lens = [300, 45], [120, 45]
    cache = make_kv_cache(NB, L, BS, HKV, D, torch.bfloat16, 5)
    tables = make_block_tables(lens, BS, NB, 24, fill=0, seed=5)
    q = torch.randn(sum(q_lens), 6, D, generator=torch.Generator().manual_seed(6)).bfloat16()
    qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    plan = PagedAttentionPlan(tuple(cache.shape), torch.full((sum(q_lens),), -1), 0,
                              prefill_block_tables=tables, prefill_query_start_loc=qsl,
                              prefill_seq_lens=seq_lens)
    got = plan.prefill_attention(cache.view(-1, HKV, D), 1, q, 0.125)
    for s in range(2):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        alone = cp.prefill_attention(q[rows], cache, 1, tables[s], lens[s], 0.125)
        assert torch.equal(got[rows], alone)
    ref = prefill_attention_ref(q.float(), cache[:, 1, 0].float(), cache[:, 1, 1].float(), tables,
                                qsl, seq_lens, 0.125)
    assert (got.float() - ref).abs().max().item() < 0.05


def test_bad_input_raises():
    q, cache, table = _case(40, 40)
    bad = table.clone()
    bad[1] = NB  # past the cache
    with pytest.raises(RuntimeError, match="block id"):
        cp.prefill_attention(q, cache, 0, bad, 40, 0.125)
    with pytest.raises(RuntimeError, match="query tokens"):
        cp.prefill_attention(q, cache, 0, table, 39, 0.125)
    with pytest.raises(RuntimeError, match="bf16"):
        cp.prefill_attention(q.float(), cache, 0, table, 40, 0.125)
    with pytest.raises(RuntimeError, match="layer"):
        cp.prefill_attention(q, cache, L, table, 40, 0.125)
    with pytest.raises(RuntimeError, match="isa"):
        cp.prefill_attention(q, cache, 0, table, 40, 0.125, isa=3)
