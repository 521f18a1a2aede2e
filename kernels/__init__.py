"""Baton's attention and KV-cache kernels: Triton on CUDA tensors, the torch reference on CPU.

Each module holds `<name>_ref` (plain torch, also the CPU path), the Triton kernel, an asserting
launcher `<name>_triton` and the dispatcher `<name>`. KV cache layout (block-major, so one block
is contiguous across layers for transfer):

    kv_cache [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]
    layer l:  key_cache = kv_cache[:, l, 0]   value_cache = kv_cache[:, l, 1]   (strided views)
    slot = block_id * block_size + offset_in_block

`kernels/norm_act.py` holds the CUDA decoder's residual add + RMSNorm and SiLU·mul, one Triton
kernel each (same dispatcher pattern).

`kernels/gemv.py` is the CPU side: a native small-batch fp32 / bf16 GEMV (a torch C++ extension
from `kernels/csrc/gemv.cpp` and `gemv_bf16.cpp`, built on first use) beside its torch reference;
import it as the module `kernels.gemv` (it is not re-exported here, so the name stays the
module's). The same extension holds the fused fp32 / bf16 CPU decode ops of
`kernels/cpu_decode.py` (rotary + KV write + paged attention over the block table, a bf16 cache
read in place; add+RMSNorm; SiLU·mul), of `kernels/cpu_verify.py` (the same attention for
decode rows of several query tokens), of `kernels/cpu_prefill.py` (bf16 causal prefill
attention over the paged cache, AVX512_BF16), of `kernels/cpu_rope.py` (rotary + KV write of
a prefill step's rows) and of `kernels/cpu_sample.py` (greedy argmax and logsumexp per row of
logits), each beside its torch reference.

This is a leaf package: it imports nothing of Baton's. Hugging Face has an unrelated optional
package also imported as `kernels`; transformers accepts it only at versions in [0.18.2, 0.19.0),
so the `baton` distribution's version must stay outside that range.
"""
from kernels.block_copy import (
    pack_blocks,
    pack_blocks_ref,
    pack_blocks_triton,
    unpack_blocks,
    unpack_blocks_ref,
    unpack_blocks_triton,
)
from kernels.norm_act import (
    add_rms_norm,
    add_rms_norm_ref,
    add_rms_norm_triton,
    silu_mul,
    silu_mul_ref,
    silu_mul_triton,
)
from kernels.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from kernels.prefill_attention import prefill_attention, prefill_attention_ref, prefill_attention_triton
from kernels.write_kv import write_kv, write_kv_ref, write_kv_triton

__all__ = [
    "add_rms_norm",
    "add_rms_norm_ref",
    "add_rms_norm_triton",
    "pack_blocks",
    "pack_blocks_ref",
    "pack_blocks_triton",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_decode_attention_triton",
    "prefill_attention",
    "prefill_attention_ref",
    "prefill_attention_triton",
    "silu_mul",
    "silu_mul_ref",
    "silu_mul_triton",
    "unpack_blocks",
    "unpack_blocks_ref",
    "unpack_blocks_triton",
    "write_kv",
    "write_kv_ref",
    "write_kv_triton",
]
