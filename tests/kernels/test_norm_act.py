"""kernels/norm_act.py: the Triton residual add + RMSNorm and SiLU·mul (interpreted here) against
their torch references, and the decoder's CUDA path taking them.

The interpreter converts fp32 → bf16 by truncation where a GPU rounds to nearest even, so in
the interpreter fp16 (whose conversion rounds) is the tight check of each kernel's arithmetic
and roundings: the residual sum bit-exact, the output within one unit in the last place (the
sum of squares runs in another order than torch's mean) and nearly all of it equal; bf16 is
checked to a few units in the last place. Compiled bf16 is compared on a GPU by
benchmarks/gpu_check.py's kernels section."""
from __future__ import annotations

import pytest
import torch

import kernels
from baton import LLM, SamplingParams

SHAPES = [(1, 576), (5, 2048), (3, 100), (0, 64)]


def _inputs(T, H, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype)
    r = torch.randn(T, H, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    return h, r, w


@pytest.mark.parametrize("T, H", SHAPES)
@pytest.mark.parametrize("with_r", [True, False])
def test_add_rms_norm_fp16(T, H, with_r):
    h, r, w = _inputs(T, H, torch.float16)
    h_ref, h_tri = h.clone(), h.clone()
    want = kernels.add_rms_norm_ref(h_ref, r if with_r else None, w, 1e-5)
    got = kernels.add_rms_norm_triton(h_tri, r if with_r else None, w, 1e-5)
    assert torch.equal(h_tri, h_ref)  # the residual stream, updated in place (or left alone)
    torch.testing.assert_close(got, want, rtol=2.0 ** -10, atol=2.0 ** -24)
    assert (got == want).float().mean() >= 0.99 if T else got.shape == want.shape


@pytest.mark.parametrize("T, H", SHAPES[:3])
def test_add_rms_norm_bf16_and_fp32_close(T, H):
    for dtype, rtol in ((torch.bfloat16, 3 * 2.0 ** -7), (torch.float32, 1e-6)):
        h, r, w = _inputs(T, H, dtype, seed=1)
        h_ref, h_tri = h.clone(), h.clone()
        want = kernels.add_rms_norm_ref(h_ref, r, w, 1e-6)
        got = kernels.add_rms_norm_triton(h_tri, r, w, 1e-6)
        torch.testing.assert_close(h_tri, h_ref, rtol=rtol, atol=0)
        torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("T, I", [(1, 1536), (4, 1000), (2, 16), (0, 8)])
def test_silu_mul(T, I):
    x = torch.randn(T, 2 * I, generator=torch.Generator().manual_seed(2)) * 4
    torch.testing.assert_close(kernels.silu_mul_triton(x.half()), kernels.silu_mul_ref(x.half()),
                               rtol=2.0 ** -10, atol=2.0 ** -24)
    torch.testing.assert_close(kernels.silu_mul_triton(x.bfloat16()),
                               kernels.silu_mul_ref(x.bfloat16()), rtol=3 * 2.0 ** -7, atol=1e-6)
    torch.testing.assert_close(kernels.silu_mul_triton(x), kernels.silu_mul_ref(x),
                               rtol=1e-6, atol=1e-7)


def test_launchers_refuse_bad_input():
    h, r, w = _inputs(2, 64, torch.float16)
    with pytest.raises(AssertionError, match="w must be"):
        kernels.add_rms_norm_triton(h, r, w[:32], 1e-5)
    with pytest.raises(AssertionError, match="w dtype"):
        kernels.add_rms_norm_triton(h, r, w.float(), 1e-5)
    with pytest.raises(AssertionError, match="r must be"):
        kernels.add_rms_norm_triton(h, r.float(), w, 1e-5)
    with pytest.raises(AssertionError, match="contiguous"):
        kernels.add_rms_norm_triton(h.t(), None, w, 1e-5)
    with pytest.raises(AssertionError, match="gate_up"):
        kernels.silu_mul_triton(torch.randn(2, 7))


def _greedy(folder, dtype: str, fused: bool, triton: bool, monkeypatch) -> list:
    """Prefill + 3 greedy decode steps of two prompts on a tiny model on the CUDA path
    (cpu_attention off) → per prompt (token ids, each step's top-5 logprobs); `triton`: the
    norm/act dispatchers go to the interpreted launchers (as on a GPU)."""
    llm = LLM(str(folder), num_blocks=32, dtype=dtype, max_num_seqs=2)
    model = llm.engine.runner.model
    model.fused_decode = model.cpu_attention = False
    model.fused_norm_act = fused
    calls = []
    if triton:
        for name in ("add_rms_norm", "silu_mul"):
            launcher = getattr(kernels, f"{name}_triton")
            monkeypatch.setattr(kernels, name,
                                lambda *a, _f=launcher, _n=name: calls.append(_n) or _f(*a))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    out = llm.generate([[5, 9, 14, 3, 7], list(range(3, 30))], params)
    assert bool(calls) == triton
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out]


def test_decoder_cuda_path_fused_ops_keep_the_torch_path(tiny_llama, monkeypatch):
    # on CPU the dispatchers run the references: the same ops as the unfused torch path
    assert _greedy(tiny_llama, "bfloat16", True, False, monkeypatch) == \
        _greedy(tiny_llama, "bfloat16", False, False, monkeypatch)
    # the Triton kernels (interpreted) in fp16, where the interpreter rounds as a GPU does:
    # the same tokens, every top-5 logprob within a rounding
    fused = _greedy(tiny_llama, "float16", True, True, monkeypatch)
    torch_ops = _greedy(tiny_llama, "float16", False, False, monkeypatch)
    for (ids, lps), (ids_t, lps_t) in zip(fused, torch_ops):
        assert ids == ids_t
        for step, step_t in zip(lps, lps_t):
            assert step.top.keys() == step_t.top.keys()
            for tok, lp in step.top.items():
                assert lp == pytest.approx(step_t.top[tok], abs=2e-2)
