"""kernels.paged_cpu.PagedAttentionPlan (the CPU path) against the per-call torch references."""
import pytest
import torch

from kernels import paged_decode_attention_ref, prefill_attention_ref, write_kv_ref
from kernels.paged_cpu import PagedAttentionPlan
from tests.kernels.util import make_block_tables, make_kv_cache

NUM_LAYERS = 3
# (num_kv_heads, group, head_size, block_size, unused block-table fill)
SHAPES = [(2, 1, 16, 16, -1), (1, 3, 64, 16, 0), (2, 4, 40, 8, 123456)]
IDS = ["hkv{}-g{}-d{}-bs{}".format(*s[:4]) for s in SHAPES]


def _plan(kv_cache, slots, td, dec=(None, None), pre=(None, None, None)):
    return PagedAttentionPlan(tuple(kv_cache.shape), slots, td, *dec, *pre)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_ref_on_every_layer(shape, dtype):
    hkv, _, d, bs, _ = shape
    kv = make_kv_cache(9, NUM_LAYERS, bs, hkv, d, dtype)
    expected = kv.clone()
    g = torch.Generator().manual_seed(1)
    # slots across blocks, one at a block end, negatives skipped
    slots = torch.tensor([0, bs - 1, bs, -1, 5 * bs + 3, -7, 9 * bs - 1], dtype=torch.int64)
    plan = _plan(kv, slots, 0)
    rows = kv.view(-1, hkv, d)
    for layer in range(NUM_LAYERS):
        k = torch.randn(len(slots), hkv, d, generator=g).to(dtype)
        v = torch.randn(len(slots), hkv, d, generator=g).to(dtype)
        write_kv_ref(k, v, expected[:, layer, 0], expected[:, layer, 1], slots)
        plan.write_kv(rows, layer, k, v)
    assert torch.equal(kv, expected)


def test_write_kv_rejects_a_slot_past_the_cache():
    kv = make_kv_cache(2, 1, 4, 1, 8, torch.float32)
    plan = _plan(kv, torch.tensor([8], dtype=torch.int64), 0)
    with pytest.raises(IndexError):
        plan.write_kv(kv.view(-1, 1, 8), 0, torch.zeros(1, 1, 8), torch.zeros(1, 1, 8))


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("lens", [[1], [16], [17, 64, 70, 1, 16], [33, 33]], ids=str)
@pytest.mark.parametrize("torch_path", [False, True], ids=["plan's choice", "torch"])
def test_decode_attention_matches_ref(shape, lens, torch_path):
    """The plan's own path (the native decode op where kernels.cpu_decode.use_fused holds)
    and its torch SDPA path, forced (what CPUs without the native ops run)."""
    hkv, group, d, bs, fill = shape
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    kv = make_kv_cache(num_blocks, NUM_LAYERS, bs, hkv, d, torch.float32)
    tables = make_block_tables(lens, bs, num_blocks, -(-max(lens) // bs) + 2, fill)
    ctx = torch.tensor(lens, dtype=torch.int32)
    plan = _plan(kv, torch.zeros(0, dtype=torch.int64), len(lens), (tables, ctx))
    if torch_path:
        plan._native_decode = False
    g = torch.Generator().manual_seed(3)
    for layer in range(NUM_LAYERS):
        q = torch.randn(len(lens), hkv * group, d, generator=g)
        ref = paged_decode_attention_ref(q, kv[:, layer, 0], kv[:, layer, 1], tables, ctx, d**-0.5)
        out = plan.decode_attention(kv.view(-1, hkv, d), layer, q, d**-0.5)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_prefill_attention_matches_ref(shape):
    hkv, group, d, bs, fill = shape
    # (seq_len, q_len): fresh prompt, chunk over a cached prefix, one token, block-exact, q_len 0
    seqs = [(20, 20), (37, 5), (16, 1), (2 * bs, bs), (9, 0)]
    lens = [n for n, _ in seqs]
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    kv = make_kv_cache(num_blocks, NUM_LAYERS, bs, hkv, d, torch.float32)
    tables = make_block_tables(lens, bs, num_blocks, -(-max(lens) // bs) + 1, fill)
    q_lens = torch.tensor([q for _, q in seqs])
    start = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    plan = _plan(kv, torch.zeros(0, dtype=torch.int64), 0, pre=(tables, start, seq_lens))
    g = torch.Generator().manual_seed(4)
    for layer in range(NUM_LAYERS):
        q = torch.randn(int(q_lens.sum()), hkv * group, d, generator=g)
        ref = prefill_attention_ref(q, kv[:, layer, 0], kv[:, layer, 1], tables, start, seq_lens,
                                    d**-0.5)
        out = plan.prefill_attention(kv.view(-1, hkv, d), layer, q, d**-0.5)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("rows", [[(1, 1)], [(17, 3), (64, 1), (70, 9), (5, 5)], [(33, 2)] * 2],
                         ids=str)
def test_decode_attention_of_speculative_rows_matches_ref(shape, rows):
    """Decode rows of 1 + k query tokens (context length, query tokens): causal within a row."""
    hkv, group, d, bs, fill = shape
    lens = [n for n, _ in rows]
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    kv = make_kv_cache(num_blocks, NUM_LAYERS, bs, hkv, d, torch.float32)
    tables = make_block_tables(lens, bs, num_blocks, -(-max(lens) // bs) + 2, fill)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q_lens = torch.tensor([q for _, q in rows])
    start = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    td = int(q_lens.sum())
    plan = PagedAttentionPlan(tuple(kv.shape), torch.zeros(0, dtype=torch.int64), td, tables, ctx,
                              decode_query_start_loc=start)
    g = torch.Generator().manual_seed(3)
    for layer in range(NUM_LAYERS):
        q = torch.randn(td, hkv * group, d, generator=g)
        ref = paged_decode_attention_ref(q, kv[:, layer, 0], kv[:, layer, 1], tables, ctx, d**-0.5,
                                         start)
        out = plan.decode_attention(kv.view(-1, hkv, d), layer, q, d**-0.5)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
