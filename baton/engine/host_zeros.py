"""Zero-filled host tensors whose pages the kernel supplies on first touch: the KV pool.

`torch.zeros` writes every byte of the pool at start. On one host `baton up` starts a prefill
and a decode worker at once, each zeroing gigabytes with its own OpenMP team on the same two
cores: the two teams' barriers spin against each other, and the default cluster took 60-74 s
to be ready, ~45 s of it in this fill (py-spy on the decode worker: `ModelRunner.__init__`;
two processes zeroing 4.9 GB each, two threads apiece: 11.5 s against 1.6 s alone). An
anonymous private mapping is zero by definition (POSIX mmap, MAP_ANONYMOUS) and costs nothing
until a page is first written, when the kernel zeroes that page: the same work, spread over the
pages KV is really written to, with no thread team and none for blocks never used.
"""
from __future__ import annotations

import math
import mmap

import torch


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of `shape` and `dtype`, every element zero, backed by an
    anonymous mapping (pages committed lazily, on first write; the tensor keeps the mapping
    alive). Raises ValueError for an empty shape's zero bytes (mmap cannot map 0 bytes: the
    caller's torch.zeros covers that) and OSError when the mapping fails."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        raise ValueError("host_zeros: zero bytes")
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)
