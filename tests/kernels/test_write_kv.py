"""write_kv: Triton (interpreter) == torch reference == per-token oracle, on a real block-major cache."""
import pytest
import torch

from kernels import write_kv, write_kv_ref, write_kv_triton
from tests.kernels.util import make_kv_cache

NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, H, D = 6, 3, 4, 3, 24
LAYER = 1
# Slots at block starts and ends, a whole block (8..11), and skipped tokens (negative).
SLOTS = [0, 3, 4, -1, 8, 9, 10, 11, 23, -7, 17]


def _inputs(dtype):
    g = torch.Generator().manual_seed(1)
    kv_cache = make_kv_cache(NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, H, D, dtype)
    key = torch.randn(len(SLOTS), H, D, generator=g).to(dtype)
    value = torch.randn(len(SLOTS), H, D, generator=g).to(dtype)
    return kv_cache, key, value, torch.tensor(SLOTS, dtype=torch.int64)


def _oracle(kv_cache, key, value, slots):
    expected = kv_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // BLOCK_SIZE, LAYER, 0, slot % BLOCK_SIZE] = key[t]
            expected[slot // BLOCK_SIZE, LAYER, 1, slot % BLOCK_SIZE] = value[t]
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", [write_kv_ref, write_kv_triton, write_kv])
def test_write_kv_matches_per_token_oracle(impl, dtype):
    kv_cache, key, value, slots = _inputs(dtype)
    expected = _oracle(kv_cache, key, value, slots)
    impl(key, value, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], slots)
    # Exact: a copy; also proves other layers, skipped tokens and unused slots stay untouched.
    assert torch.equal(kv_cache, expected)


def test_write_kv_triton_rejects_bad_calls():
    kv_cache, key, value, slots = _inputs(torch.float32)
    k_cache, v_cache = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1]
    with pytest.raises(AssertionError, match="int64"):
        write_kv_triton(key, value, k_cache, v_cache, slots.to(torch.int32))
    with pytest.raises(AssertionError, match="dtype"):
        write_kv_triton(key.double(), value.double(), k_cache, v_cache, slots)
    with pytest.raises(AssertionError, match="slot_mapping"):
        write_kv_triton(key, value, k_cache, v_cache, slots[:-1])
    with pytest.raises(AssertionError, match="stride 1"):
        head_major = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, D, H).transpose(2, 3)  # [.., H, D], D strided
        write_kv_triton(key, value, head_major, head_major, slots)


def test_write_kv_no_tokens_is_a_no_op():
    kv_cache, key, value, slots = _inputs(torch.float32)
    before = kv_cache.clone()
    write_kv_triton(key[:0], value[:0], kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], slots[:0])
    assert torch.equal(kv_cache, before)
