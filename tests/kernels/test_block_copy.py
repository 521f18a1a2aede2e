"""pack_blocks / unpack_blocks: Triton (interpreter) == torch reference == per-block loop, bit-exact."""
import pytest
import torch

from kernels import pack_blocks, pack_blocks_ref, pack_blocks_triton, unpack_blocks, unpack_blocks_ref
from kernels import unpack_blocks_triton
from tests.kernels.util import make_kv_cache

NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, H, D = 8, 2, 4, 3, 24  # 1152 elements per block
BLOCK_IDS = [6, 0, 3, 7]

PACKS = [pack_blocks_ref, pack_blocks_triton, pack_blocks]
UNPACKS = [unpack_blocks_ref, unpack_blocks_triton, unpack_blocks]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pack", PACKS)
def test_pack_matches_per_block_loop(pack, dtype):
    kv_cache = make_kv_cache(NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, H, D, dtype)
    before = kv_cache.clone()
    buffer = pack(kv_cache, torch.tensor(BLOCK_IDS))
    assert buffer.shape == (len(BLOCK_IDS), *kv_cache.shape[1:]) and buffer.is_contiguous()
    assert torch.equal(buffer, torch.stack([kv_cache[i] for i in BLOCK_IDS]))
    assert torch.equal(kv_cache, before)


@pytest.mark.parametrize("pack", PACKS)
def test_pack_into_staging_buffer(pack):
    kv_cache = make_kv_cache(NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, H, D, torch.bfloat16)
    staging = torch.zeros(6, *kv_cache.shape[1:], dtype=torch.bfloat16)
    out = staging[1:3]  # a slice of a larger registered buffer
    assert pack(kv_cache, torch.tensor([5, 2]), out=out) is out
    assert torch.equal(staging[1], kv_cache[5]) and torch.equal(staging[2], kv_cache[2])
    assert not staging[0].any() and not staging[3:].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unpack", UNPACKS)
def test_round_trip_leaves_other_blocks_untouched(unpack, dtype):
    src = make_kv_cache(NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, H, D, dtype, seed=1)
    dst = make_kv_cache(NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, H, D, dtype, seed=2)
    expected = dst.clone()
    dst_ids = [1, 5, 2, 4]  # prefill's blocks 6, 0, 3, 7 land in decode's blocks 1, 5, 2, 4
    for s, d in zip(BLOCK_IDS, dst_ids):
        expected[d] = src[s]
    buffer = pack_blocks_triton(src, torch.tensor(BLOCK_IDS))
    unpack(buffer, dst, torch.tensor(dst_ids))
    assert torch.equal(dst, expected)


def test_empty_block_list():
    kv_cache = make_kv_cache(NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, H, D, torch.float32)
    none = torch.empty(0, dtype=torch.int64)
    assert pack_blocks_triton(kv_cache, none).shape == (0, *kv_cache.shape[1:])
    unpack_blocks_triton(kv_cache[:0], kv_cache, none)


def test_launchers_reject_bad_calls():
    kv_cache = make_kv_cache(NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, H, D, torch.float32)
    with pytest.raises(AssertionError, match="int64"):
        pack_blocks_triton(kv_cache, torch.tensor(BLOCK_IDS, dtype=torch.int32))
    with pytest.raises(AssertionError, match="dtype"):
        pack_blocks_triton(kv_cache, torch.tensor(BLOCK_IDS), out=torch.empty(4, *kv_cache.shape[1:]).double())
    with pytest.raises(AssertionError, match="rows"):
        unpack_blocks_triton(kv_cache[:4, :1], kv_cache, torch.tensor(BLOCK_IDS))
    with pytest.raises(AssertionError, match="contiguous"):
        layer_major = kv_cache[:4].transpose(0, 1).contiguous().transpose(0, 1)  # blocks not contiguous
        unpack_blocks_triton(layer_major, kv_cache, torch.tensor(BLOCK_IDS))
