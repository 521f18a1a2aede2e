"""baton.models.linear: both weight storages compute x @ W.T; the decoder agrees with transformers
on either one (the torch storage is the fallback when the native GEMV does not build)."""
from __future__ import annotations

import pytest
import torch

import baton.models.decoder as decoder
from baton import LLM, SamplingParams
from baton.models.linear import Linear
from kernels import cpu_decode, gemv
from tests.reference import hf_greedy

U = 2.0**-24
STORAGES = [(False, False), (False, True)] + ([(True, False)] if gemv.gemv_available() else [])


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("native,split", STORAGES)
@pytest.mark.parametrize("rows", [1, 3, 16, 20, 65])  # 65 > max_rows(): the prefill GEMM path
def test_every_storage_is_x_times_w_transposed(native: bool, split: bool, rows: int) -> None:
    w, x = _rand(7, 45, seed=1), _rand(rows, 45, seed=2)  # odd out: a padded split half
    lin = Linear(w, native, split)
    y = lin(x)
    exact = x.double() @ w.double().t()
    bound = 45 * U / (1 - 45 * U) * (x.double().abs() @ w.double().abs().t())
    assert y.shape == (rows, 7) and y.dtype == torch.float32
    assert ((y.double() - exact).abs() <= bound).all()
    assert torch.equal(lin.matrix(), w) and (lin.in_features, lin.out_features) == (45, 7)


@pytest.mark.skipif(not gemv.gemv_available(), reason="native GEMV did not build here")
def test_native_storage_shares_a_contiguous_matrix() -> None:
    w = _rand(9, 16, seed=3)
    assert Linear(w, native=True).weight.data_ptr() == w.data_ptr()
    assert Linear(w, native=True).nbytes == w.numel() * 4


@pytest.mark.parametrize("native", [False, True] if gemv.gemv_available() else [False])
def test_decoder_greedy_matches_transformers_on_either_storage(monkeypatch, tiny_llama,
                                                                native: bool) -> None:
    monkeypatch.setattr(decoder, "use_native_gemv", lambda dtype: native)
    llm = LLM(str(tiny_llama), num_blocks=32, dtype="float32")
    assert llm.engine.model.native_gemv is native
    prompts = [[5, 6, 7, 8, 9], [11, 3, 200, 17, 4, 90, 31, 2, 8]]  # one step: 2 decode rows
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.output_token_ids == hf_greedy(tiny_llama, prompt, 8)


@pytest.mark.skipif(not cpu_decode.fast_available(),
                    reason="native extension did not build here, or no AVX-512")
@pytest.mark.parametrize("fused", [False, True])
def test_fused_cpu_decode_step_matches_transformers(monkeypatch, tiny_llama, fused: bool) -> None:
    """The all-decode CPU step through kernels.cpu_decode (rotary + KV write + attention,
    add+RMSNorm, SiLU·mul) and through torch ops both give transformers' greedy tokens, with
    decode rows of different context lengths in one step."""
    llm = LLM(str(tiny_llama), num_blocks=32, dtype="float32")
    model = llm.engine.model
    assert model.fused_decode, "fp32 llama with the AVX-512 extension takes the fused step"
    model.fused_decode = fused
    calls = []
    native_attention = cpu_decode.decode_attention
    monkeypatch.setattr(cpu_decode, "decode_attention",
                        lambda *a, **k: calls.append(1) or native_attention(*a, **k))
    prompts = [[5, 6, 7, 8, 9], [11, 3, 200, 17, 4, 90, 31, 2, 8, 60, 61, 62, 63, 64, 65, 66, 67]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.output_token_ids == hf_greedy(tiny_llama, prompt, 12)
    assert bool(calls) is fused  # the fused op ran in the fused case only


def test_bucket_rows_are_few_and_tight() -> None:
    from baton.models.linear import bucket_rows

    sizes = {bucket_rows(m) for m in range(1, 4097)}
    assert len(sizes) == 48
    for m in range(1, 8193):
        b = bucket_rows(m)
        assert m <= b < m + max(16, m / 8) and bucket_rows(b) == b


@pytest.mark.parametrize("native,split", STORAGES)
def test_bf16_rows_padded_to_a_bucket_give_the_unpadded_product(native: bool,
                                                                split: bool) -> None:
    """bf16 above the native kernel's rows: the product runs at `bucket_rows` rows; the rows
    asked for are torch's bf16 x @ W.T of those rows, bit for bit."""
    w = _rand(24, 64, seed=3).bfloat16()
    lin = Linear(w, native, split)
    for rows in (gemv.max_rows(torch.bfloat16) + 1, 37, 130, 300):
        x = _rand(rows, 64, seed=rows).bfloat16()
        y = lin(x)
        assert y.shape == (rows, 24) and y.dtype == torch.bfloat16 and y.is_contiguous()
        assert torch.equal(y, x @ w.t())


def test_bf16_products_of_many_row_counts_keep_memory_bounded() -> None:
    """oneDNN keeps ~0.4 MB per distinct row count of a bf16 GEMM (never returned): 400 row
    counts unpadded grew a process by ~170 MB; bucketed they are ~15 shapes."""
    psutil = pytest.importorskip("psutil")
    lin = Linear(_rand(192, 64, seed=4).bfloat16(), gemv.gemv_available())
    lin(_rand(17, 64, seed=5).bfloat16())
    before = psutil.Process().memory_info().rss
    for rows in range(17, 417):
        lin(_rand(rows, 64, seed=rows).bfloat16())
    assert psutil.Process().memory_info().rss - before < 60 * 2**20


@pytest.mark.parametrize("native,split", STORAGES)
def test_prepacked_bf16_weights_give_the_same_bits(native: bool, split: bool) -> None:
    """`prepack=True` (oneDNN's prepacked W for the bf16 GEMMs past the native rows): every
    row count the same bits as unpacked, the native rows untouched, memory bounded as before."""
    from baton.models.linear import prepack_bf16

    w = _rand(48, 64, seed=6).bfloat16()
    plain, packed = Linear(w, native, split), Linear(w, native, split, prepack=True)
    if prepack_bf16(w) is None:
        pytest.skip("oneDNN's weight prepack is unavailable in this torch build")
    assert packed._packed is not None and plain._packed is None
    for rows in (1, 5, gemv.max_rows(torch.bfloat16), gemv.max_rows(torch.bfloat16) + 1, 37,
                 130, 300):
        x = _rand(rows, 64, seed=rows + 100).bfloat16()
        assert torch.equal(packed(x), plain(x)), rows
    wide = _rand(40, 80, seed=7).bfloat16()  # rows strided past their 64 columns
    assert torch.equal(packed(wide[:, :64]), plain(wide[:, :64].contiguous()))


def test_prepack_only_where_a_second_copy_fits(tmp_path) -> None:
    from baton.models.linear import PREPACK_MAX_FRACTION, prepack_bf16, prepack_fits

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 32000000 kB\nMemAvailable: 8000000 kB\n")
    limit = int(PREPACK_MAX_FRACTION * 8000000 * 1024)
    assert prepack_fits(limit, str(meminfo)) and not prepack_fits(limit + 1, str(meminfo))
    assert not prepack_fits(1, str(tmp_path / "missing"))
    assert prepack_bf16(_rand(8, 16, seed=8)) is None  # fp32: never prepacked
    assert not Linear(_rand(8, 16, seed=8), False, prepack=True)._packed


def _cpuinfo(tmp_path, vendor: str, flags: str):
    path = tmp_path / f"cpuinfo-{vendor}-{len(flags)}"
    path.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: {flags}\n")
    return str(path)


def test_bf16_gemm_in_fp32_rule(tmp_path, monkeypatch) -> None:
    """fp32 prompt GEMMs only on an Intel CPU with AVX512_BF16 and no AMX (the kind where fp32
    was measured faster) whose total memory holds the fp32 copy, or where forced."""
    from baton.models.linear import PREPACK_MAX_FRACTION, bf16_gemm_in_fp32

    monkeypatch.delenv("BATON_BF16_GEMM", raising=False)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 16000000 kB\nMemAvailable: 100 kB\n")  # free: irrelevant
    mem, ok = str(meminfo), 1 << 20
    base = "fpu avx2 avx512f avx512bw"
    assert bf16_gemm_in_fp32(ok, _cpuinfo(tmp_path, "GenuineIntel", base + " avx512_bf16"), mem)
    assert not bf16_gemm_in_fp32(ok, _cpuinfo(tmp_path, "GenuineIntel",
                                              base + " avx512_bf16 amx_bf16 amx_tile"), mem)
    assert not bf16_gemm_in_fp32(ok, _cpuinfo(tmp_path, "AuthenticAMD", base + " avx512_bf16"),
                                 mem)
    assert not bf16_gemm_in_fp32(ok, _cpuinfo(tmp_path, "AuthenticAMD", "fpu avx2"), mem)
    assert not bf16_gemm_in_fp32(ok, str(tmp_path / "missing"), mem)
    intel = _cpuinfo(tmp_path, "GenuineIntel", base + " avx512_bf16")
    limit = int(PREPACK_MAX_FRACTION * 16000000 * 1024) // 2
    assert bf16_gemm_in_fp32(limit, intel, mem) and not bf16_gemm_in_fp32(limit + 1, intel, mem)
    amd = _cpuinfo(tmp_path, "AuthenticAMD", base + " avx512_bf16")
    monkeypatch.setenv("BATON_BF16_GEMM", "fp32")
    assert bf16_gemm_in_fp32(ok, amd, mem) and not bf16_gemm_in_fp32(limit + 1, amd, mem)
    monkeypatch.setenv("BATON_BF16_GEMM", "bf16")
    assert not bf16_gemm_in_fp32(ok, intel, mem)
    monkeypatch.setenv("BATON_BF16_GEMM", "fast")
    with pytest.raises(ValueError, match="BATON_BF16_GEMM"):
        bf16_gemm_in_fp32(ok, intel, mem)


@pytest.mark.parametrize("native,split", STORAGES)
def test_fp32_gemm_of_bf16_weights_rounds_the_fp32_product(native: bool, split: bool) -> None:
    """`gemm_fp32=True`: past the native rows, x @ W.T of bf16 x and W computed in fp32 and
    rounded once to bf16 (within one bf16 rounding of the exact product, the same bits on
    every call); the native rows keep their kernel's bits."""
    from baton.models.linear import prepack_weight

    w = _rand(48, 64, seed=9).bfloat16()
    plain, fp32 = Linear(w, native, split), Linear(w, native, split, gemm_fp32=True)
    if prepack_weight(w.float()) is None:
        pytest.skip("oneDNN's weight prepack is unavailable in this torch build")
    assert fp32._packed is not None and fp32._packed.dtype == torch.float32
    small = _rand(5, 64, seed=10).bfloat16()
    assert torch.equal(fp32(small), plain(small))
    for rows in (gemv.max_rows(torch.bfloat16) + 1, 37, 130, 300):
        x = _rand(rows, 64, seed=rows + 200).bfloat16()
        y = fp32(x)
        exact = x.double() @ w.double().t()
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 48)
        assert ((y.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-30).all(), rows
        assert torch.equal(y, fp32(x))


def test_amx_gemv_rule(tmp_path, monkeypatch) -> None:
    """The AMX GEMV and GEMM where AMX runs and MemTotal holds their two re-laid copies (the
    total, so every process of a machine answers the same), unless $BATON_BF16_GEMV=avx512."""
    from baton.models.linear import PREPACK_MAX_FRACTION, use_amx_gemv
    from kernels import gemv_amx

    monkeypatch.delenv("BATON_BF16_GEMV", raising=False)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 16000000 kB\nMemAvailable: 100 kB\n")
    limit = int(PREPACK_MAX_FRACTION * 16000000 * 1024) // 2  # two re-laid copies
    amx = gemv_amx.available()
    assert use_amx_gemv(limit, str(meminfo)) == amx
    assert not use_amx_gemv(limit + 1, str(meminfo))
    assert not use_amx_gemv(1, str(tmp_path / "missing"))
    monkeypatch.setenv("BATON_BF16_GEMV", "amx")
    assert use_amx_gemv(1, str(meminfo)) == amx  # asked for, still only where AMX runs
    monkeypatch.setenv("BATON_BF16_GEMV", "avx512")
    assert not use_amx_gemv(1, str(meminfo))
    monkeypatch.setenv("BATON_BF16_GEMV", "fast")
    with pytest.raises(ValueError, match="BATON_BF16_GEMV"):
        use_amx_gemv(1, str(meminfo))


@pytest.mark.skipif(not gemv.gemv_available(), reason="native GEMV did not build here")
def test_amx_storage_runs_the_amx_kernel_for_the_native_rows() -> None:
    """`amx=True` (where AMX runs): rows up to the native limit are the AMX kernel's bits,
    more rows torch's GEMM as without it; fp32 weights ignore the flag."""
    from kernels import gemv_amx

    if not gemv_amx.available():
        pytest.skip("AMX does not run on this CPU/OS")
    w = _rand(40, 70, seed=11).bfloat16()
    lin, plain = Linear(w, True, amx=True), Linear(w, True)
    assert lin._amx is not None and plain._amx is None
    for rows in (1, 7, 32):
        x = _rand(rows, 70, seed=rows).bfloat16()
        assert torch.equal(lin(x), gemv_amx.gemv_amx(x, gemv_amx.pack(w), 40)), rows
    x = _rand(33, 70, seed=33).bfloat16()
    assert torch.equal(lin(x), plain(x))
    assert Linear(w.float(), True, amx=True)._amx is None
    assert torch.equal(lin.matrix(), w)


@pytest.mark.skipif(not gemv.gemv_available(), reason="native GEMV did not build here")
@pytest.mark.parametrize("rows", [33, 48, 100, 513])
def test_amx_storage_runs_the_amx_gemm_past_the_native_rows(rows: int) -> None:
    """`amx=True` with inputs a multiple of 32: more rows than the GEMV takes run the AMX GEMM
    (no oneDNN copy kept), and every row is the AMX GEMV's bits for that row alone; also for
    the leading rows of a wider buffer (the decoder's padded outputs)."""
    from kernels import gemv_amx

    if not gemv_amx.available():
        pytest.skip("AMX does not run on this CPU/OS")
    w = _rand(72, 96, seed=12).bfloat16()
    lin = Linear(w, True, prepack=True, amx=True)
    assert lin._amx_b is not None and lin._packed is None
    buf = _rand(rows + 7, 96, seed=rows).bfloat16()
    x = buf[:rows]
    y = lin(x)
    assert y.shape == (rows, 72)
    single = torch.cat([gemv_amx.gemv_amx(x[r:r + 1], lin._amx, 72) for r in range(rows)])
    assert torch.equal(y, single)


@pytest.mark.skipif(not gemv.gemv_available(), reason="native GEMV did not build here")
def test_gemm_takes_a_buffer_that_holds_the_padded_rows() -> None:
    """bf16 past the native rows: x given as the first rows of a bigger contiguous buffer
    (`kernels.cpu_decode.rows_out`, the native ops' outputs) is multiplied from that buffer,
    not a padded copy, with the same bits as a fresh x, whatever the buffer's other rows hold."""
    from baton.models.linear import _padded, bucket_rows, padded_rows
    from kernels.cpu_decode import rows_out

    w = _rand(48, 64, seed=12).bfloat16()
    for prepack in (False, True):
        lin = Linear(w, True, prepack=prepack)
        for m in (37, 100, 130):
            b = bucket_rows(m)
            assert padded_rows(m, torch.bfloat16) == b > m
            x = rows_out(b, m, 64, torch.bfloat16)
            base = x.as_strided((b, 64), (64, 1))
            assert x.untyped_storage().nbytes() == b * 64 * 2 and base[m:].abs().sum() == 0
            x.copy_(_rand(m, 64, seed=m))
            padded, rows = _padded(x)
            assert rows == m and padded.data_ptr() == x.data_ptr() and padded.shape == (b, 64)
            fresh = x.clone()
            assert _padded(fresh)[0].data_ptr() != fresh.data_ptr()  # a copy, as before
            base[m:] = float("nan")  # other rows: no bit of x's rows depends on them
            assert torch.equal(lin(x), lin(fresh)), (prepack, m)
    assert padded_rows(20, torch.bfloat16) == 0 and padded_rows(100, torch.float32) == 0
