"""The decoder's weight matrices: `y = x @ W.T` for a W given (out, in), stored for the path used.

Two storages, chosen once at load for the whole model (`use_native_gemv`):

- native (fp32 or bf16 on CPU with the `kernels.gemv` extension built): W kept (out, in)
  contiguous, the layout the native GEMV streams (one contiguous dot product per output). Steps
  of at most `kernels.gemv.MAX_ROWS` tokens run the native kernel (bf16: fp32 sums, batch
  invariant); larger ones (prefill) torch's GEMM on `W.T` (same speed as (in, out) there; bf16
  goes to oneDNN, with AMX where the CPU has it). bf16 on a CPU with AMX (`use_amx_gemv`):
  the native rows run `kernels.gemv_amx` on a second copy of W re-laid into its tile units
  (faster at every row count there, 2× at 16 rows; other bits than the AVX512_BF16 kernel's,
  so the choice is the machine's, never the step's), and the larger products its GEMM
  (`gemm_amx`, a third copy as the tiles' B operand, instead of oneDNN's prepacked one): the
  GEMV's bits at every row count, and both cores busy on every shape.
- torch (every other case, and the fallback when the extension does not build): W stored
  (in, out) so `x @ W` streams rows (faster than `x @ W.T` for a GEMV on CPU, see
  shared/PLATFORM.md); with `split=True` as two column halves multiplied by one batched matmul
  (`_split_matmul`), which spreads a one-row GEMV over two cores where MKL's uses one.

bf16 products on CPU that go to torch's GEMM (more rows than the native kernel takes) pad x's
rows up to one of a few bucket sizes (`bucket_rows`): oneDNN keeps memory for every row count
it has seen, never returned (torch 2.13, measured on the Zen 4 VM: 0.4–1.2 MB per distinct row
count and weight shape, 856 MB after 2,048 row counts of one small matrix, unchanged by
ONEDNN_PRIMITIVE_CACHE_CAPACITY), so a server prefilling chunks of every length grew by
hundreds of MB (tests/test_soak.py); with buckets it is bounded by their number.

Those bf16 GEMMs take W prepacked once at load into oneDNN's blocked layout
(`prepack=True`: torch.ops.mkldnn._reorder_linear_weight, the weight prepack of torch's
Inductor CPU path and of vLLM's CPU GEMM), not reordered by oneDNN on every call as
`F.linear` does: the same bits (every SmolLM2 shape at 33-1,024 rows, 1 and 2 threads), and
a layer stack's GEMMs on the Zen 4 VM 1.29× faster at 33 rows, 1.26× at 64, 1.15× at 128,
1.11× at 256, 1.02× at 512 (BENCHMARKS.md, stop 37): a continuation turn's short suffix and a
decode batch beside a prompt chunk are such steps. It costs a second copy of the matrices,
so the model prepacks only when they are small beside the free memory (`prepack_fits`).

Where the CPU's bf16 dot products are slow, those GEMMs run in fp32 instead
(`bf16_gemm_in_fp32`): W prepacked once as fp32 (exact: a bf16 value is an fp32 one), x
widened, the fp32 result rounded to bf16 once, as oneDNN's bf16 GEMM rounds its fp32 sums; only
the summation order differs. On the Intel Xeon of BENCHMARKS.md's sixth pass (AVX512_BF16, no
AMX) oneDNN's bf16 GEMM ran at 139-151 GFLOP/s on SmolLM2's shapes (256 and 910 rows, both
cores) and the fp32 one, conversions included, at 175-226: 1.4-1.5×. Elsewhere bf16 stays: with
AMX it is several times fp32, and on AMD's Zen 4 oneDNN's bf16 ran at 380 GFLOP/s on two cores
(an earlier pass; fp32 was not measured there). The choice is made from
the CPU's flags and total memory, never timed, so every process on a machine computes the same
bits (a prompt prefilled on a prefill worker and one prefilled on a decode worker agree).
"""
from __future__ import annotations

import os

import torch

from baton.dtypes import cpu_flags, cpu_vendor
from kernels import gemv as native
from kernels import gemv_amx
from kernels.cpu_decode import rows_out
from kernels.gemv import extension as native_extension
from kernels.gemv import max_rows as native_max_rows


def use_native_gemv(dtype: torch.dtype) -> bool:
    """Whether a model of this dtype on CPU should store its matrices for the native GEMV
    (fp32 or bf16; builds the extension on the first call; False if it cannot be built)."""
    return dtype in (torch.float32, torch.bfloat16) and native.gemv_available()


PREPACK_MAX_FRACTION = 0.125  # prepacked copies may take this share of MemAvailable


def prepack_fits(weight_bytes: int, meminfo: str = "/proc/meminfo") -> bool:
    """Whether a second copy of `weight_bytes` of matrices (the prepacked bf16 GEMM weights)
    is at most PREPACK_MAX_FRACTION of the memory free now (MemAvailable; False when it
    cannot be read): SmolLM2-135M's 0.2 GB on a 24 GB host yes, an 8B model's 16 GB on a
    32 GB host no (its GEMMs then reorder per call, as before)."""
    available = _meminfo_bytes("MemAvailable", meminfo)
    return available is not None and weight_bytes <= PREPACK_MAX_FRACTION * available


GEMM_ENV = "BATON_BF16_GEMM"  # "fp32" / "bf16": override bf16_gemm_in_fp32's rule


def _meminfo_bytes(field: str, meminfo: str = "/proc/meminfo") -> int | None:
    """/proc/meminfo's `field` ("MemAvailable", "MemTotal") in bytes; None when unreadable."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _forced(env: str, choices: tuple[str, ...]) -> str:
    """$env lower-cased ("" when unset); ValueError when set to none of `choices`."""
    forced = os.environ.get(env, "").strip().lower()
    if forced and forced not in choices:
        raise ValueError(f"{env} must be {' or '.join(choices)}, got {forced!r}")
    return forced


def _total_holds(copy_bytes: int, meminfo: str) -> bool:
    """Whether a copy of `copy_bytes` is at most PREPACK_MAX_FRACTION of MemTotal (the total,
    not the free memory: the same answer in every process of the machine)."""
    return copy_bytes <= PREPACK_MAX_FRACTION * (_meminfo_bytes("MemTotal", meminfo) or 0)


def bf16_gemm_in_fp32(weight_bytes: int, cpuinfo: str = "/proc/cpuinfo",
                      meminfo: str = "/proc/meminfo") -> bool:
    """Whether a bf16 model's prompt GEMMs (`weight_bytes` of bf16 matrices) run in fp32 on
    fp32 prepacked copies (module docstring): on an Intel CPU with AVX512_BF16 and no AMX,
    the one kind where fp32 was measured faster (elsewhere bf16 stays, as before), and where
    the fp32 copy (2 × weight_bytes) is at most
    PREPACK_MAX_FRACTION of MemTotal (the total, not the free memory: the same answer in every
    process of the machine). $BATON_BF16_GEMM=fp32|bf16 overrides the CPU rule (not the
    memory bound); another value raises ValueError."""
    forced = _forced(GEMM_ENV, ("fp32", "bf16"))
    if forced == "bf16" or not torch.backends.mkldnn.is_available():
        return False
    if not _total_holds(2 * weight_bytes, meminfo):
        return False
    if forced == "fp32":
        return True
    flags = cpu_flags(cpuinfo)
    return (cpu_vendor(cpuinfo) == "GenuineIntel" and "avx512_bf16" in flags
            and "amx_bf16" not in flags)


GEMV_ENV = "BATON_BF16_GEMV"  # "amx" / "avx512": override use_amx_gemv's rule


def use_amx_gemv(weight_bytes: int, meminfo: str = "/proc/meminfo") -> bool:
    """Whether a bf16 model's products run on AMX tiles: small steps (decode, <= 32 rows) the
    AMX GEMV (`kernels.gemv_amx`, W re-laid into its units) instead of the AVX512_BF16 one, and
    larger ones (prefill) the AMX GEMM (`gemm_amx`, W re-laid once more as its B operand) instead
    of oneDNN's, with the GEMV's bits for every row count. Where AMX is allowed (CPU flags and
    the OS, never a timing) and the two re-laid copies of the `weight_bytes` of matrices are at
    most PREPACK_MAX_FRACTION of MemTotal (the same answer in every process of a machine: the
    kernels' bits differ from the others', and disaggregated = colocated needs one). On the AMX
    Xeon of BENCHMARKS.md's thirteenth pass SmolLM2-135M's 121 matrices took 10.5 ms at one row
    against 10.8, 11.4 against 15.0 at 8 rows, 12.8 against 26.3 at 16; its fourteenth pass has
    the GEMM. $BATON_BF16_GEMV=avx512 turns both off, =amx asks for them (still only where AMX
    runs); another value raises ValueError."""
    return (_forced(GEMV_ENV, ("amx", "avx512")) != "avx512" and gemv_amx.available()
            and _total_holds(2 * weight_bytes, meminfo))


def prepack_weight(w: torch.Tensor) -> torch.Tensor | None:
    """W (out, in) bf16 or fp32 on CPU → oneDNN's prepacked copy for `_linear_pointwise`
    (module docstring); None where oneDNN or the op is missing or refuses it."""
    if w.dtype not in (torch.bfloat16, torch.float32) or w.is_cuda \
            or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
    except (RuntimeError, AttributeError):
        return None


def prepack_bf16(w: torch.Tensor) -> torch.Tensor | None:
    """`prepack_weight` for a bf16 W; None for any other dtype (fp32 models keep F.linear)
    and where it returns None (the caller keeps F.linear)."""
    return prepack_weight(w) if w.dtype == torch.bfloat16 else None


def _split_columns(w: torch.Tensor) -> torch.Tensor:
    """(in, out) matrix → [2, in, ceil(out/2)]: its two column halves (the last zero-padded when
    `out` is odd), for `_split_matmul`."""
    n = -(-w.shape[1] // 2)
    w = torch.nn.functional.pad(w, (0, 2 * n - w.shape[1]))
    return w.view(w.shape[0], 2, n).transpose(0, 1).contiguous()


def _split_matmul(x: torch.Tensor, w2: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [T, in] @ W [in, out] with W stored as `_split_columns(W)`: one batched matmul over the
    two halves. Each output column is the same dot product as `x @ W` (no split sums); the gain
    is threading: MKL's GEMV for one row runs on one core here, a batch of two GEMVs on two."""
    y = torch.matmul(x, w2).transpose(0, 1).reshape(x.shape[0], -1)  # [T, 2·ceil(out/2)]
    return y if y.shape[1] == out_features else y[:, :out_features]


def bucket_rows(m: int) -> int:
    """The row count a bf16 GEMM of `m` rows runs at: m rounded up to a multiple of 16, or of
    1/8 of the power of two below it where that is larger (8 sizes per octave: 48 up to 4,096
    rows), so the extra rows are fewer than 16 and than m/8."""
    step = max(16, 1 << max(0, (m - 1).bit_length() - 4))
    return -(-m // step) * step


def padded_rows(m: int, dtype: torch.dtype) -> int:
    """The rows a bf16 CPU GEMM of m rows runs at (`bucket_rows`), 0 where none is padded
    (other dtypes, or rows the native GEMV takes)."""
    if dtype != torch.bfloat16 or m <= native.max_rows(dtype):
        return 0
    return bucket_rows(m)


def _padded(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x with its rows zero-padded to `bucket_rows`, its row count) for a bf16 CPU x that
    torch's GEMM will take; x itself otherwise. Where x is the leading rows of a contiguous
    buffer that holds the padded rows already (`kernels.cpu_decode.rows_out`: the native
    norm, SiLU·mul and prefill attention outputs), that buffer's rows, not a copy; a GEMM's
    row is computed from that row of x alone, so the other rows' values change no bit of it."""
    m = x.shape[0]
    b = 0 if x.is_cuda else padded_rows(m, x.dtype)
    if b <= m:
        return x, m
    width = x.shape[1]  # (the storage, not `x._base`: inference-mode views have no _base)
    if (x.is_contiguous() and x.storage_offset() == 0
            and x.untyped_storage().nbytes() >= b * width * x.element_size()):
        return x.as_strided((b, width), (width, 1)), m
    return torch.nn.functional.pad(x, (0, 0, 0, b - m)), m


class Linear:
    """One weight matrix W [out, in] (no bias) and its product `x [T, in] → x @ W.T [T, out]`.

    Args: w (out, in) of the model's dtype (not modified; the native storage may share its
    memory when it is already contiguous, e.g. a tied embedding reused as lm_head); native:
    store for `kernels.gemv`; split: in the torch storage, use `_split_matmul`; prepack: bf16
    on CPU, keep oneDNN's prepacked copy of W for the GEMMs past the native rows (module
    docstring; ignored where `prepack_bf16` returns None); gemm_fp32: those GEMMs in fp32 on
    a prepacked fp32 copy of a bf16 W (`bf16_gemm_in_fp32`; overrides prepack); amx: with
    native bf16, also keep W re-laid for the AMX GEMV and run the native rows there, and (where
    `in` % 32 == 0) re-laid for the AMX GEMM, which then runs every larger product instead of
    oneDNN (`use_amx_gemv`; two copies of W, no oneDNN one); gate_up: W is [gate; up] (two
    halves of I rows): with the AMX GEMM its copy has their 16-row units interleaved, so
    `silu_mul` can run the MLP's SiLU·mul inside that GEMM (I % 16 == 0; ignored otherwise).
    """

    def __init__(self, w: torch.Tensor, native: bool, split: bool = False,
                 prepack: bool = False, gemm_fp32: bool = False, amx: bool = False,
                 gate_up: bool = False) -> None:
        self.out_features, self.in_features = w.shape
        self.native = native
        ext = native_extension() if native and not w.is_cuda else None
        amx = amx and ext is not None and w.dtype == torch.bfloat16
        amx_gemm = amx and self.in_features % gemv_amx.IN_CHUNK == 0  # the GEMV's bits, all rows
        # bf16 CPU GEMMs past the native rows with W prepacked (module docstring; None: F.linear),
        # in fp32 with gemm_fp32 (then always prepacked: the bits must not depend on memory);
        # none where the AMX GEMM runs them
        self._packed = (prepack_weight(w.float()) if gemm_fp32 and w.dtype == torch.bfloat16
                        else prepack_bf16(w) if prepack and not amx_gemm else None)
        self.split = split and not native
        self._gemv_out = None  # the extension's kernel, called directly for small steps
        self._amx = None  # W as kernels.gemv_amx.pack lays it out, where that kernel runs
        self._amx_b = None  # W as gemv_amx.pack_b lays it out: the GEMM past the native rows
        self._paired = False  # _amx_b holds [gate; up] with units interleaved (gate_up)
        if native:
            self.weight = w.contiguous()
            if ext is not None:
                self._gemv_out = ext.gemv_out if w.dtype == torch.float32 else ext.gemv_bf16_out
                self._max_rows = native_max_rows(w.dtype)
                if amx:  # W re-laid for kernels.gemv_amx
                    self._amx = gemv_amx.pack(self.weight)
                    self._gemv_amx_out = ext.gemv_amx_out
                    self._max_rows = min(self._max_rows, gemv_amx.MAX_ROWS)
                if amx_gemm:
                    self._paired = gate_up and self.out_features % (2 * gemv_amx.OUT_UNIT) == 0
                    self._amx_b = gemv_amx.pack_b(gemv_amx.interleave_gate_up(self.weight)
                                                  if self._paired else self.weight)
                    self._gemm_amx_out = ext.gemm_amx_out
                    self._gemm_amx_silu_out = ext.gemm_amx_silu_out
        elif self.split:
            self.weight = _split_columns(w.t())
        else:
            self.weight = w.t().contiguous()

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def nbytes(self) -> int:
        """Bytes one product reads (the stored matrix, padding included)."""
        return self.weight.numel() * self.weight.element_size()

    def matrix(self) -> torch.Tensor:
        """W as given, (out, in) (a view of the storage; a copy for the split one)."""
        if self.native:
            return self.weight
        if self.split:
            w = self.weight.transpose(0, 1).reshape(self.in_features, -1)  # [in, 2·ceil(out/2)]
            return w[:, :self.out_features].t()
        return self.weight.t()

    def fuses_silu(self, t: int, dtype: torch.dtype) -> bool:
        """Whether `silu_mul` takes a [t, in] x of `dtype` (a gate_up W with the interleaved
        AMX GEMM copy, bf16, more rows than the GEMV takes): asked once a step, not a layer."""
        return self._paired and t > self._max_rows and dtype == torch.bfloat16

    def silu_mul(self, x: torch.Tensor, rows: int = 0) -> torch.Tensor | None:
        """For a gate_up W: silu(x @ gate.T) · (x @ up.T) [T, I] bf16 from the AMX GEMM with the
        SiLU·mul as its epilogue (`gemv_amx.gemm_amx_silu`: the bits of this product followed
        by `kernels.cpu_decode.silu_mul`), with rows > T inside a buffer of `rows` rows
        (`kernels.cpu_decode.rows_out`); None where that path does not take x (not
        `fuses_silu`, or not a 2-D x of unit inner stride): the caller runs the two ops."""
        if not self.fuses_silu(x.shape[0], x.dtype) or x.dim() != 2 or x.stride(1) != 1:
            return None
        y = rows_out(rows, x.shape[0], self.out_features // 2, x.dtype)
        self._gemm_amx_silu_out(x, self._amx_b, y)
        return y

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] → [T, out], x's dtype; bf16 GEMMs on CPU run at `bucket_rows(T)` rows.
        A decode step's few rows go straight to the native kernel, the AMX one where `amx`
        (`kernels.gemv.gemv`'s checks, which cost ~3.5 µs a call of ~120 a step, are the
        extension's own: it raises RuntimeError on a wrong dtype, shape or stride)."""
        if (self._gemv_out is not None and x.shape[0] <= self._max_rows
                and x.dtype == self.weight.dtype and x.dim() == 2 and x.stride(1) == 1):
            y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
            if self._amx is not None:
                self._gemv_amx_out(x, self._amx, y)
            else:
                self._gemv_out(x, self.weight, y, 0)
            return y
        if (self._amx_b is not None and x.dtype == torch.bfloat16 and x.dim() == 2
                and x.stride(1) == 1):  # no padded rows: the kernel takes any row count
            y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
            self._gemm_amx_out(x, self._amx_b, y)
            return gemv_amx.deinterleave_gate_up(y) if self._paired else y
        x, m = _padded(x)
        if (self._packed is not None and x.dtype == torch.bfloat16
                and x.shape[0] > native.max_rows(x.dtype)):
            if self._packed.dtype == torch.float32:  # bf16_gemm_in_fp32: one rounding at the end
                y = torch.ops.mkldnn._linear_pointwise(x.float(), self._packed, None, "none", [],
                                                       "").to(torch.bfloat16)
            else:
                y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, None, "none",
                                                       [], "")
        elif self.native:
            y = native.gemv(x, self.weight)
        elif self.split:
            y = _split_matmul(x, self.weight, self.out_features)
        else:
            y = x @ self.weight
        return y if y.shape[0] == m else y[:m]
