"""Greedy sampling's row reductions on CPU in native code (kernels/csrc/cpu_sample.cpp).

    greedy_lse(logits [B, V] fp32 or bf16) → (ids [B] int64, lse [B] fp32)
    ids = logits.argmax(-1) (first maximum), lse = logits.float().logsumexp(-1)

One pass for the argmax and one for the sum of exponentials per row, reading bf16 logits in
place (torch: an fp32 copy, then five passes). Used by baton/engine/sampler.py for batches
that are all greedy, unprocessed and ask no top logprobs; lse then gives each chosen token's
logprob. A row's result does not depend on the batch or the thread count.
"""
from __future__ import annotations

import torch

from kernels import gemv as _gemv

ISA_BEST, ISA_SCALAR, ISA_AVX512 = 0, 1, 3


def available() -> bool:
    """Whether the native op runs here (the extension built; any x86-64 or other CPU)."""
    return _gemv._load() is not None


def greedy_lse_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: (argmax [B] int64, logsumexp [B] fp32) of logits [B, V]."""
    f = logits.float()
    return f.argmax(dim=-1), torch.logsumexp(f, dim=-1)


def greedy_lse(logits: torch.Tensor, isa: int = ISA_BEST) -> tuple[torch.Tensor, torch.Tensor]:
    """Native `greedy_lse_ref` for CPU logits [B, V] (fp32 or bf16, unit inner stride);
    isa forces a variant for tests. RuntimeError on a bad shape or dtype, a forced variant
    this CPU lacks, or without the extension."""
    ext = _gemv._load()
    if ext is None:
        raise RuntimeError("native CPU ops are unavailable (see the log)")
    ids = torch.empty(logits.shape[0], dtype=torch.int64)
    lse = torch.empty(logits.shape[0], dtype=torch.float32)
    ext.greedy_lse_out(logits, ids, lse, isa)
    return ids, lse
