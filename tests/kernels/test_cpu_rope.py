"""kernels.cpu_rope: rotary + KV-cache write of a step's rows against the decoder's torch ops.

The rotated q and every written K/V must be bit-identical to the torch path's in fp32 and bf16
(each variant), slots < 0 write nothing, and a bad index raises before anything is written."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_rope as cr
from tests.kernels.test_cpu_decode_bf16 import VARIANTS

pytestmark = pytest.mark.skipif(not cr.available(), reason="native extension did not build here")


def _case(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    nb, layers, bs, max_pos = 12, 2, 16, 4096
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    cos = torch.randn(max_pos, d, generator=g).to(dtype)
    sin = torch.randn(max_pos, d, generator=g).to(dtype)
    positions = torch.randint(0, max_pos, (t,), generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[::5] = -1  # cached already: not written
    cache = torch.randn(nb, layers, 2, bs, hkv, d, generator=g).to(dtype)
    return qkv, cos, sin, positions, cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 9, 3, 64), (37, 9, 3, 64), (70, 4, 2, 16),
                                        (5, 8, 1, 128), (9, 4, 4, 6)])
@pytest.mark.parametrize("isa", VARIANTS)
def test_bit_identical_to_torch_ops(dtype, t, hq, hkv, d, isa):
    qkv, cos, sin, positions, cache, slots = _case(t, hq, hkv, d, dtype, seed=t + d)
    want_cache = cache.clone()
    want = cr.rope_write_ref(qkv, cos, sin, positions, want_cache, 1, slots, hq)
    got = cr.rope_write(qkv, cos, sin, positions, cache, 1, slots, hq, isa=isa)
    assert got.dtype == dtype and got.shape == (t, hq, d)
    assert torch.equal(got, want)
    assert torch.equal(cache, want_cache)  # written slots identical, the rest untouched


def test_strided_qkv_rows():
    """qkv as the decoder hands it: a view of a wider (row-padded) GEMM output."""
    qkv, cos, sin, positions, cache, slots = _case(20, 9, 3, 64, torch.bfloat16, seed=4)
    wide = torch.cat([qkv, qkv[:4]])[:20]
    want_cache = cache.clone()
    want = cr.rope_write_ref(qkv, cos, sin, positions, want_cache, 0, slots, 9)
    assert torch.equal(cr.rope_write(wide, cos, sin, positions, cache, 0, slots, 9), want)
    assert torch.equal(cache, want_cache)


@pytest.mark.parametrize("bad", ["position", "slot", "width", "dtype", "layer"])
def test_bad_input_raises_before_writing(bad):
    qkv, cos, sin, positions, cache, slots = _case(8, 4, 2, 32, torch.float32, seed=2)
    layer, heads = 1, 4
    if bad == "position":
        positions[3] = cos.shape[0]
    elif bad == "slot":
        slots[6] = cache.shape[0] * cache.shape[3]
    elif bad == "width":
        heads = 5
    elif bad == "dtype":
        qkv = qkv.bfloat16()
    else:
        layer = 2
    before = cache.clone()
    with pytest.raises(RuntimeError, match="cpu_rope"):
        cr.rope_write(qkv, cos, sin, positions, cache, layer, slots, heads)
    assert torch.equal(cache, before)


def test_decoder_prefill_step_takes_it_with_the_torch_ops_bits(monkeypatch, tiny_qwen2):
    """A bf16 prefill step of the decoder (q/k/v bias too) calls the native op, and gives the
    same hidden states and KV cache, bit for bit, as with the torch ops in its place."""
    from baton import LLM
    from baton.models.decoder import AttentionMetadata

    llm = LLM(str(tiny_qwen2), dtype="bfloat16", block_size=16, num_blocks=16)
    model = llm.engine.model
    n = 40
    meta = AttentionMetadata(
        slot_mapping=torch.arange(16, 16 + n), num_decode_tokens=0,
        prefill_block_tables=torch.tensor([[1, 2, 3]], dtype=torch.int32),
        prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([n], dtype=torch.int32))
    ids = torch.randint(3, model.shape.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    shape = llm.engine.runner.kv_cache.shape
    calls = []
    native = cr.rope_write
    monkeypatch.setattr(cr, "rope_write", lambda *a, **k: calls.append(1) or native(*a, **k))
    kv_native = torch.zeros(shape, dtype=torch.bfloat16)
    h_native = model.forward(ids, torch.arange(n), meta, kv_native)
    assert len(calls) == model.shape.num_layers
    monkeypatch.setattr(cr, "rope_write", lambda *a, **k: cr.rope_write_ref(*a[:8]))
    kv_torch = torch.zeros(shape, dtype=torch.bfloat16)
    h_torch = model.forward(ids, torch.arange(n), meta, kv_torch)
    assert torch.equal(h_native, h_torch) and torch.equal(kv_native, kv_torch)
    assert kv_native[1:4].abs().sum() > 0  # the step wrote its blocks
