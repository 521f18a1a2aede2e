"""Write new tokens' keys and values into their slots of the paged KV cache.

    key/value [T, H, D]             key_cache / value_cache [num_blocks, block_size, H, D]
    slot_mapping [T] int64          (strided views kv_cache[:, layer, 0] / [:, layer, 1])

    token t ──▶ slot = slot_mapping[t] = block_id * block_size + offset_in_block
             ──▶ key_cache[block_id, offset_in_block] = key[t]       (slot < 0: token skipped)

Negative slots mark padding tokens and tokens whose KV is already cached (for example a prefix
that another worker computed); they are left out without a branch on the host.
Same contract as vLLM's `reshape_and_cache_flash` (NHD layout).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_kv_cache_pair, on_device, pow2_at_least, same_device


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch reference and CPU path of `write_kv` (in place, one vectorized scatter).

    Shapes: key/value `[T, H, D]`; caches `[num_blocks, block_size, H, D]` (strided views of the
    block-major cache are written through); `slot_mapping` `[T]` int64, negative = skip.
    Dtypes: key/value must have the cache's dtype. Raises IndexError for a slot past the cache.
    """
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep]
    value_cache[blocks, offsets] = value[keep]


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kco, stride_kch,
    stride_vcb, stride_vco, stride_vch,
    block_size,
    H: tl.constexpr, D: tl.constexpr, H_P: tl.constexpr, D_P: tl.constexpr,
):
    # One program per token: its [H, D] rows for all KV heads, one masked store each for K and V.
    # A pure copy needs no fp32 upcast (no arithmetic; bit-exact in the interpreter too).
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding or already-cached token
        return
    block = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, H_P)[:, None]
    d = tl.arange(0, D_P)[None, :]
    mask = (h < H) & (d < D)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(key_cache_ptr + block * stride_kcb + offset * stride_kco + h * stride_kch + d, k, mask=mask)
    tl.store(value_cache_ptr + block * stride_vcb + offset * stride_vco + h * stride_vch + d, v, mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton launcher of `write_kv`: asserts the contract of `write_kv_ref`, then one program per token.

    Out-of-range slots are not checked (that would need a device sync): they are undefined behaviour.
    """
    _, _, num_kv_heads, head_size = check_kv_cache_pair(key_cache, value_cache)
    assert key.dim() == 3 and key.shape == value.shape, f"key {tuple(key.shape)} / value {tuple(value.shape)}"
    num_tokens = key.shape[0]
    assert key.shape[1:] == (num_kv_heads, head_size), (
        f"key is [T, {key.shape[1]}, {key.shape[2]}], cache holds [.., {num_kv_heads}, {head_size}]"
    )
    assert key.dtype == value.dtype == key_cache.dtype, f"dtype {key.dtype}/{value.dtype} vs cache {key_cache.dtype}"
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "key/value head_size dim must have stride 1"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}"
    assert slot_mapping.dtype == torch.int64, f"slot_mapping must be int64, got {slot_mapping.dtype}"
    same_device(key, value, key_cache, value_cache, slot_mapping)
    if num_tokens == 0:
        return
    with on_device(key):
        _write_kv_kernel[(num_tokens,)](
            key, value, key_cache, value_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            key_cache.shape[1],
            H=num_kv_heads, D=head_size, H_P=pow2_at_least(num_kv_heads), D_P=pow2_at_least(head_size),
        )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter `key`/`value` `[T, H, D]` into the caches at `slot_mapping` (in place; slot < 0 skips).

    CUDA tensors run the Triton kernel, CPU tensors the torch reference.
    """
    if key.is_cuda:
        write_kv_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        write_kv_ref(key, value, key_cache, value_cache, slot_mapping)
