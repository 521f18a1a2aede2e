"""prefill_attention: Triton (interpreter) vs torch reference vs an fp64 per-token oracle.

Each sequence's queries are its last q_len tokens: full prefill, chunked prefill over a cached
prefix (at and off block boundaries), decode (q_len 1) and a single-token sequence in one batch.
"""
import pytest
import torch

from kernels import paged_decode_attention_ref, prefill_attention, prefill_attention_ref, prefill_attention_triton
from tests.kernels.util import (
    assert_close_to_fp32,
    cached_positions,
    make_block_tables,
    make_kv_cache,
    oracle_attention,
)

NUM_LAYERS, LAYER = 2, 1
# (seq_len, q_len): fresh 37-token prompt; 16-token chunk after a 32-token (block-aligned) prefix;
# decode after a block boundary; a single-token sequence; 5 new tokens crossing the 64-token tile.
SEQS = [(37, 37), (48, 16), (17, 1), (1, 1), (70, 5)]
# (num_kv_heads, group, head_size, block_size, unused block-table fill)
SHAPES = [
    (2, 1, 16, 16, -1),  # MHA
    (1, 3, 64, 16, 0),  # SmolLM2-like GQA 3:1
    (2, 4, 40, 8, 123456),  # GQA 4:1, head_size padded, garbage past each sequence's blocks
]


def _case(num_kv_heads, group, head_size, block_size, fill, dtype, seqs=SEQS):
    seq_lens = [s for s, _ in seqs]
    q_lens = [q for _, q in seqs]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    kv_cache = make_kv_cache(num_blocks, NUM_LAYERS, block_size, num_kv_heads, head_size, dtype)
    tables = make_block_tables(seq_lens, block_size, num_blocks, -(-max(seq_lens) // block_size) + 1, fill)
    g = torch.Generator().manual_seed(3)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_size, generator=g).to(dtype)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return query, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], tables, query_start_loc, seq_lens_t, head_size**-0.5


def _oracle(query, key_cache, value_cache, tables, query_start_loc, seq_lens, scale):
    out = torch.empty(query.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for s, n in enumerate(seq_lens.tolist()):
        q0, q1 = starts[s], starts[s + 1]
        keys = cached_positions(key_cache, tables[s].tolist(), n)
        values = cached_positions(value_cache, tables[s].tolist(), n)
        positions = list(range(n - (q1 - q0), n))
        out[q0:q1] = oracle_attention(query[q0:q1], keys, values, scale, positions)
    return out


def _upcast(args):
    query, key_cache, value_cache, *rest = args
    return (query.float(), key_cache.float(), value_cache.float(), *rest)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hkv{}-g{}-d{}-bs{}".format(*s[:4]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_ref(shape, dtype):
    args = _case(*shape, dtype)
    out = prefill_attention_triton(*args)
    assert out.dtype == dtype and out.shape == args[0].shape
    assert_close_to_fp32(out, prefill_attention_ref(*args), prefill_attention_ref(*_upcast(args)))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hkv{}-g{}-d{}-bs{}".format(*s[:4]))
def test_ref_matches_fp64_oracle(shape):
    args = _case(*shape, torch.float32)
    expected = _oracle(*args)
    torch.testing.assert_close(prefill_attention_ref(*args).double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prefill_attention(*args).double(), expected, atol=1e-5, rtol=1e-5)
    bf16 = _case(*shape, torch.bfloat16)
    torch.testing.assert_close(prefill_attention_ref(*bf16).double(), _oracle(*bf16), atol=3e-2, rtol=2e-2)


def test_empty_query_sequence_and_explicit_max_q_len():
    seqs = [(20, 0), (33, 3), (5, 0)]  # sequences with nothing new are skipped
    args = _case(1, 3, 16, 16, -1, torch.float32, seqs=seqs)
    out = prefill_attention_triton(*args, max_q_len=3)
    torch.testing.assert_close(out, prefill_attention_ref(*args), atol=1e-5, rtol=1e-5)


def test_q_len_one_equals_paged_decode():
    seqs = [(1, 1), (16, 1), (17, 1), (70, 1)]
    query, key_cache, value_cache, tables, _, seq_lens, scale = _case(1, 3, 64, 16, -1, torch.float32, seqs=seqs)
    query_start_loc = torch.arange(len(seqs) + 1, dtype=torch.int32)
    prefill = prefill_attention_triton(query, key_cache, value_cache, tables, query_start_loc, seq_lens, scale)
    decode = paged_decode_attention_ref(query, key_cache, value_cache, tables, seq_lens, scale)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


def test_launcher_rejects_bad_calls():
    query, key_cache, value_cache, tables, qsl, seq_lens, scale = _case(2, 3, 16, 16, -1, torch.float32)
    with pytest.raises(AssertionError, match="query_start_loc"):
        prefill_attention_triton(query, key_cache, value_cache, tables, qsl[:-1], seq_lens, scale)
    with pytest.raises(AssertionError, match="seq_lens"):
        prefill_attention_triton(query, key_cache, value_cache, tables, qsl, seq_lens.long(), scale)
    with pytest.raises(AssertionError, match="head_size"):
        prefill_attention_triton(query[..., :8], key_cache, value_cache, tables, qsl, seq_lens, scale)
