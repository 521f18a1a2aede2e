"""bf16 causal prefill attention on CPU (AVX512_BF16, or AMX), reading the paged cache in place.

    query [Tq, Hq, D] bf16 (heads contiguous; token stride free)
    kv_cache [NB, L, 2, BS, Hkv, D] bf16, contiguous; block_table [max_blocks] int32
    seq_len: the sequence's cached tokens, its Tq new ones included (K/V already written)
    → out [Tq, Hq, D] bf16: query token i (position seq_len − Tq + i) over positions
      [0, seq_len − Tq + i], softmax(q·kᵀ·scale)·v

Why: torch's bf16 SDPA on a CPU without AMX (the AMD EPYC of issue 24, AVX512_BF16) runs a
1,000-token causal layer in 12–17 ms, a third of a bf16 prefill (BENCHMARKS.md, "bf16 prefill
attention"), and the paged path first gathers every context's K/V per layer. The native op
(`kernels/csrc/cpu_prefill.cpp`) is FlashAttention's online softmax (Dao et al. 2022) over
32-key tiles with VDPBF16PS for q·k and p·v: scores, softmax and sums in fp32, p rounded to
bf16 before p·v (as torch's bf16 SDPA does), the output rounded once.

On a CPU with AMX (AMX-TILE, AMX-BF16, enabled by the OS) q·k and p·v run as TDPBF16PS tiles
of 16 rows (`kernels/csrc/prefill_amx.h`), the packed K/V being the tiles' operand layout
already, and the softmax code is the same: a 1,000-token layer of SmolLM2 on two cores of an AMX
Xeon 6.0 -> 2.1 ms, a cold 1,000-token prompt 380 -> 286 ms (BENCHMARKS.md). Its bits differ
from the AVX512_BF16 item's (another summation order); every process on one machine takes the
same item (`ISA_BEST`: from the CPU's flags and the head size, never from a timing).

A row's result depends only on its own query and the K/V up to its position, in a fixed order:
it is the same however the prompt is chunked or batched and on any thread count (tested), so a
prefill worker and a colocated engine that chunk a prompt differently write the same KV.
Where this op does not run (`available()` False: no AVX512_BF16, no extension, fp32, CUDA) the
callers keep torch's SDPA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import gemv as _gemv

ISA_BEST, ISA_AVX512_BF16, ISA_AMX = 0, 4, 5


def available() -> bool:
    """True when the extension is built and this CPU has AVX512_BF16 (with AVX-512F/BW/VL)."""
    ext = _gemv._load()
    return ext is not None and bool(ext.has_avx512_bf16_attention())


# whether the op's AMX item runs here (AMX-TILE and AMX-BF16, enabled by the OS for this
# process); `prefill_attention` then takes it for head sizes that are multiples of 32
amx_available = _gemv.amx_available


def supported(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the native op takes these tensors: bf16 CPU, contiguous cache, Hq = G·Hkv,
    D % 16 == 0, query heads contiguous."""
    hkv, d = kv_cache.shape[4], kv_cache.shape[5]
    return (query.dtype == kv_cache.dtype == torch.bfloat16 and not kv_cache.is_cuda
            and kv_cache.is_contiguous() and query.shape[1] % hkv == 0 and d % 16 == 0
            and query.stride(2) == 1 and query.stride(1) == d)


def prefill_attention_ref(query: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                          block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """Torch reference in fp32 (shapes in the module docstring): gather the context through the
    block table, causal SDPA aligned to the sequence's end; returns fp32 [Tq, Hq, D]."""
    bs, hkv = kv_cache.shape[3], kv_cache.shape[4]
    tq = query.shape[0]
    pos = torch.arange(seq_len)
    blocks = block_table.long()[pos // bs]
    k = kv_cache[blocks, layer, 0, pos % bs].float()  # [N, Hkv, D]
    v = kv_cache[blocks, layer, 1, pos % bs].float()
    mask = pos[None, :] <= torch.arange(seq_len - tq, seq_len)[:, None]
    out = F.scaled_dot_product_attention(
        query.float().transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != hkv)
    return out[0].transpose(0, 1)


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                      block_table: torch.Tensor, seq_len: int, scale: float,
                      isa: int = ISA_BEST) -> torch.Tensor:
    """Native op (module docstring) → bf16 [Tq, Hq, D]. isa: ISA_BEST (AMX where
    `amx_available()` and D % 32 == 0, else AVX512_BF16), ISA_AVX512_BF16 or ISA_AMX (tests
    force each). The extension checks every block id it follows and raises RuntimeError on a
    bad shape, dtype or index, on a CPU without AVX512_BF16 (or without AMX for ISA_AMX), or
    when the extension is unavailable."""
    ext = _gemv._load()
    if ext is None:
        raise RuntimeError("native CPU ops are unavailable (see the log)")
    out = torch.empty(query.shape, dtype=torch.bfloat16)
    ext.prefill_attention_bf16_out(query, kv_cache, layer, block_table.int().contiguous(),
                                   int(seq_len), float(scale), out, int(isa))
    return out
