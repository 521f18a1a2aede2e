"""paged_decode_attention: Triton (interpreter) vs torch reference vs an fp64 per-token oracle."""
import pytest
import torch

from kernels import paged_decode_attention, paged_decode_attention_ref, paged_decode_attention_triton
from tests.kernels.util import (
    assert_close_to_fp32,
    cached_positions,
    make_block_tables,
    make_kv_cache,
    oracle_attention,
)

NUM_LAYERS, LAYER = 2, 1
# One token; exactly one block; one past a block boundary; exactly one 64-token kernel tile; ragged.
CONTEXT_LENS = [1, 16, 17, 64, 70]
# (num_kv_heads, group, head_size, block_size, unused block-table fill)
SHAPES = [
    (2, 1, 16, 16, -1),  # MHA
    (1, 3, 64, 16, 0),  # SmolLM2-like GQA 3:1
    (2, 4, 40, 8, 123456),  # GQA 4:1, head_size padded to 64, garbage past each sequence's blocks
]


def _case(num_kv_heads, group, head_size, block_size, fill, dtype, lens=CONTEXT_LENS):
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    kv_cache = make_kv_cache(num_blocks, NUM_LAYERS, block_size, num_kv_heads, head_size, dtype)
    tables = make_block_tables(lens, block_size, num_blocks, max_blocks=-(-max(lens) // block_size) + 2, fill=fill)
    g = torch.Generator().manual_seed(2)
    query = torch.randn(len(lens), num_kv_heads * group, head_size, generator=g).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    return query, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], tables, context_lens, head_size**-0.5


def _oracle(query, key_cache, value_cache, tables, context_lens, scale):
    out = torch.empty(query.shape, dtype=torch.float64)
    for b, n in enumerate(context_lens.tolist()):
        keys = cached_positions(key_cache, tables[b].tolist(), n)
        values = cached_positions(value_cache, tables[b].tolist(), n)
        out[b] = oracle_attention(query[b : b + 1], keys, values, scale, [n - 1])[0]
    return out


def _upcast(args):
    query, key_cache, value_cache, *rest = args
    return (query.float(), key_cache.float(), value_cache.float(), *rest)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hkv{}-g{}-d{}-bs{}".format(*s[:4]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_ref(shape, dtype):
    args = _case(*shape, dtype)
    out = paged_decode_attention_triton(*args)
    assert out.dtype == dtype and out.shape == args[0].shape
    assert_close_to_fp32(out, paged_decode_attention_ref(*args), paged_decode_attention_ref(*_upcast(args)))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hkv{}-g{}-d{}-bs{}".format(*s[:4]))
def test_ref_matches_fp64_oracle(shape):
    args = _case(*shape, torch.float32)
    expected = _oracle(*args)
    torch.testing.assert_close(paged_decode_attention_ref(*args).double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged_decode_attention(*args).double(), expected, atol=1e-5, rtol=1e-5)
    bf16 = _case(*shape, torch.bfloat16)
    torch.testing.assert_close(paged_decode_attention_ref(*bf16).double(), _oracle(*bf16), atol=3e-2, rtol=2e-2)


def test_single_sequence_single_token():
    args = _case(1, 3, 16, 16, -1, torch.float32, lens=[1])
    # One token: the output is that token's value row for every head of the group.
    expected = args[2][args[3][0, 0], 0].repeat_interleave(3, dim=0)[None]
    torch.testing.assert_close(paged_decode_attention_triton(*args), expected)


def test_launcher_rejects_bad_calls():
    query, key_cache, value_cache, tables, lens, scale = _case(2, 3, 16, 16, -1, torch.float32)
    with pytest.raises(AssertionError, match="multiple"):
        paged_decode_attention_triton(query[:, :5], key_cache, value_cache, tables, lens, scale)
    with pytest.raises(AssertionError, match="int32"):
        paged_decode_attention_triton(query, key_cache, value_cache, tables.long(), lens, scale)
    with pytest.raises(AssertionError, match="dtype"):
        paged_decode_attention_triton(query.bfloat16(), key_cache, value_cache, tables, lens, scale)


# Speculative decode rows (1 + k query tokens): (context length, query tokens) per sequence.
MULTI = [(1, 1), (5, 3), (16, 1), (17, 2), (40, 9), (70, 4)]


def _multi_case(num_kv_heads, group, head_size, block_size, fill, dtype, rows=MULTI):
    lens = [n for n, _ in rows]
    query, key_cache, value_cache, tables, context_lens, scale = _case(
        num_kv_heads, group, head_size, block_size, fill, dtype, lens)
    q_lens = torch.tensor([q for _, q in rows], dtype=torch.int32)
    start_loc = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    g = torch.Generator().manual_seed(3)
    query = torch.randn(int(q_lens.sum()), num_kv_heads * group, head_size, generator=g).to(dtype)
    return (query, key_cache, value_cache, tables, context_lens, scale, start_loc), max(q_lens)


def _multi_oracle(query, key_cache, value_cache, tables, context_lens, scale, start_loc):
    out = torch.empty(query.shape, dtype=torch.float64)
    for b, n in enumerate(context_lens.tolist()):
        q0, q1 = start_loc[b].item(), start_loc[b + 1].item()
        keys = cached_positions(key_cache, tables[b].tolist(), n)
        values = cached_positions(value_cache, tables[b].tolist(), n)
        out[q0:q1] = oracle_attention(query[q0:q1], keys, values, scale,
                                      list(range(n - (q1 - q0), n)))
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hkv{}-g{}-d{}-bs{}".format(*s[:4]))
def test_multi_token_rows_ref_matches_fp64_oracle(shape):
    """A row's q_len tokens are its context's last positions and attend causally."""
    args, _ = _multi_case(*shape, torch.float32)
    torch.testing.assert_close(paged_decode_attention_ref(*args).double(), _multi_oracle(*args),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hkv{}-g{}-d{}-bs{}".format(*s[:4]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_token_rows_triton_matches_ref(shape, dtype):
    args, max_q = _multi_case(*shape, dtype)
    out = paged_decode_attention_triton(*args, max_query_len=max_q)
    ref32 = paged_decode_attention_ref(*_upcast(args))
    assert_close_to_fp32(out, paged_decode_attention_ref(*args), ref32)


def test_one_token_rows_with_start_loc_equal_the_plain_call():
    args = _case(2, 4, 40, 8, 123456, torch.float32)
    start_loc = torch.arange(len(CONTEXT_LENS) + 1, dtype=torch.int32)
    for fn in (paged_decode_attention_ref, paged_decode_attention_triton):
        torch.testing.assert_close(fn(*args, start_loc), fn(*args), atol=0, rtol=0)
