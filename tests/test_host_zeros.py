"""The CPU KV pool is zero-filled without writing it at start (baton/engine/host_zeros.py)."""
from __future__ import annotations

import resource

import pytest
import torch

from baton.engine.host_zeros import host_zeros


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_writable_and_the_shape_asked(dtype):
    x = host_zeros((3, 2, 2, 16, 3, 8), dtype)
    assert x.shape == (3, 2, 2, 16, 3, 8) and x.dtype == dtype and x.is_contiguous()
    assert not x.any()
    x[1, 0, 1, 5] = 2.5
    assert x.sum().item() == 2.5 * 3 * 8 and x[1, 0, 1, 5].eq(2.5).all()


def test_pages_are_committed_only_when_written():
    before = _rss_bytes()
    x = host_zeros((256, 1 << 20), torch.uint8)  # 256 MiB
    assert _rss_bytes() - before < (32 << 20)
    x[:64].fill_(1)  # 64 MiB written
    grown = _rss_bytes() - before
    assert (64 << 20) <= grown < (128 << 20), grown
    assert x[:64].all() and not x[64:].any()


def test_zero_bytes_are_refused():
    with pytest.raises(ValueError):
        host_zeros((0, 4), torch.float32)


def test_the_engine_pool_is_zero_and_serves(tiny_llama):
    from baton.llm import LLM
    from baton.sampling_params import SamplingParams
    llm = LLM(str(tiny_llama), block_size=16, num_blocks=8, dtype="float32")
    pool = llm.engine.runner.kv_cache
    assert pool.shape[0] == 8 and not pool.any()
    out = llm.generate(["hello there"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4 and pool.any()  # written in place
