"""The AMX gate/up GEMM with SiLU·mul as its epilogue (kernels/gemv_amx.py `gemm_amx_silu`,
csrc/gemm_amx.cpp) and the gate_up `Linear` that uses it (baton/models/linear.py).

The reference is the two ops it replaces, bit for bit: `gemm_amx` into [M, 2·I] (itself held to
the fp64 bound and to the GEMV's bits in test_gemv_amx.py), then the native bf16 `silu_mul`
(held to torch's ops in test_cpu_decode_bf16.py), and torch's own silu(gate)·up for closeness.
"""
from __future__ import annotations

import pytest
import torch

from baton.models.linear import Linear
from kernels import cpu_decode
from kernels import gemv_amx as ga

pytestmark = pytest.mark.skipif(not ga.available(), reason="AMX does not run on this CPU/OS")


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _two_ops(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return cpu_decode.silu_mul(ga.gemm_amx(x, ga.pack_b(w), w.shape[0]))


@pytest.mark.parametrize("k", [32, 576])
@pytest.mark.parametrize("inter", [16, 48, 1536])
@pytest.mark.parametrize("m", [1, 17, 33, 100, 300])
def test_fused_is_the_two_ops_bit_for_bit(k: int, inter: int, m: int) -> None:
    x, w = _rand(m, k, seed=k + m, scale=1.5), _rand(2 * inter, k, seed=inter, scale=0.1)
    y = ga.gemm_amx_silu(x, ga.pack_b(ga.interleave_gate_up(w)), inter)
    assert y.shape == (m, inter) and y.dtype == torch.bfloat16
    assert torch.equal(y.view(torch.int16), _two_ops(x, w).view(torch.int16))
    g, u = (x.float() @ w.float().t()).chunk(2, dim=1)
    ref = torch.nn.functional.silu(g) * u
    assert torch.allclose(y.float(), ref, rtol=0.03, atol=0.03 * ref.abs().max().item())


def test_threads_strides_and_special_values() -> None:
    inter, k = 96, 576
    w = _rand(2 * inter, k, seed=1, scale=0.1)
    x = _rand(70, 700, seed=2, scale=2.0)[:, 64:640]  # rows at a stride
    x[3, 0] = float("nan")
    x[4, :] = 60.0  # products far past exp's clamp, both signs
    x[5, :] = -60.0
    pb = ga.pack_b(ga.interleave_gate_up(w))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ga.gemm_amx_silu(x, pb, inter)
        torch.set_num_threads(max(2, threads))
        many = ga.gemm_amx_silu(x, pb, inter)
    finally:
        torch.set_num_threads(threads)
    two = _two_ops(x.contiguous(), w)
    assert torch.equal(one.view(torch.int16), many.view(torch.int16))
    assert torch.equal(one.view(torch.int16), two.view(torch.int16))
    out = torch.zeros(70, 100, dtype=torch.bfloat16)  # a column slice of a wider buffer
    ga.gemm_amx_silu(x, pb, inter, out=out[:, 2:98])
    assert torch.equal(out[:, 2:98].view(torch.int16), two.view(torch.int16))
    assert out[:, :2].abs().sum() == 0 and out[:, 98:].abs().sum() == 0


def test_interleave_round_trip_and_bad_input() -> None:
    w = _rand(64, 32, seed=3)
    wi = ga.interleave_gate_up(w)
    assert torch.equal(wi[16:32], w[32:48]) and torch.equal(wi[32:48], w[16:32])
    y = ga.gemm_amx(_rand(40, 32, seed=4), ga.pack_b(wi), 64)
    assert torch.equal(ga.deinterleave_gate_up(y), ga.gemm_amx(_rand(40, 32, seed=4),
                                                               ga.pack_b(w), 64))
    with pytest.raises(ValueError, match="I % 16"):
        ga.interleave_gate_up(_rand(48, 32, seed=5))
    pb = ga.pack_b(wi)
    with pytest.raises(RuntimeError, match="I % 16 == 0"):
        ga.gemm_amx_silu(_rand(40, 32, seed=6), pb, 24)
    with pytest.raises(RuntimeError, match="2·I/16 units"):
        ga.gemm_amx_silu(_rand(40, 32, seed=6), pb, 48)
    with pytest.raises(RuntimeError, match="bf16 only"):
        ga.gemm_amx_silu(torch.randn(40, 32), pb, 32)


def test_gate_up_linear_fuses_only_past_the_gemv_rows() -> None:
    inter, k = 64, 96
    w = _rand(2 * inter, k, seed=7, scale=0.1)
    paired = Linear(w, native=True, amx=True, gate_up=True)
    plain = Linear(w, native=True, amx=True)
    x = _rand(45, k, seed=8)
    assert torch.equal(paired(x), plain(x))  # the interleaved copy, columns put back
    y = paired.silu_mul(x, rows=64)
    assert torch.equal(y, cpu_decode.silu_mul(plain(x)))
    base = y.as_strided((64, inter), (inter, 1))  # rows_out's buffer: the tail is zeros
    assert base[45:].abs().sum() == 0
    assert paired.fuses_silu(45, torch.bfloat16) and not paired.fuses_silu(8, torch.bfloat16)
    assert not plain.fuses_silu(45, torch.bfloat16)
    assert paired.silu_mul(x[:8]) is None  # the GEMV's rows: the caller runs two ops
    assert plain.silu_mul(x) is None
    assert paired.silu_mul(x.float()) is None


def test_a_prompt_gets_the_two_op_bits_through_the_model(tiny_llama, monkeypatch) -> None:
    """A bf16 model on AMX prefills a prompt past the GEMV's rows through the fused gate/up
    GEMM (prefill steps, and a decode-only step of that many rows): the logprobs are the bits
    of the same model with the fusion refused (`Linear.silu_mul` None: GEMM, then silu_mul)."""
    from baton import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    prompts = [[3 + (7 * i + j) % 300 for j in range(n)] for i, n in enumerate((33, 70, 150))]

    def run() -> list:
        llm = LLM(str(tiny_llama), dtype="bfloat16", block_size=16, num_blocks=64)
        assert llm.engine.model.layers[0].gate_up._paired
        outs = llm.generate(prompts, params)
        return [[(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs] for o in outs]

    calls = []
    real = Linear.silu_mul
    monkeypatch.setattr(Linear, "silu_mul", lambda self, x, rows=0: calls.append(x.shape[0])
                        or real(self, x, rows))
    fused = run()
    assert max(calls) >= 150  # the fused GEMM ran on the prompt rows
    monkeypatch.setattr(Linear, "silu_mul", lambda self, x, rows=0: None)
    assert run() == fused
