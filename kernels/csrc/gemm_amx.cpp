// bf16 GEMM on Intel AMX tiles for CPU prefill steps (kernels/gemv_amx.py `gemm_amx`):
// y[m, o] = bf16(sum_k x[m, k] w[o, k]), fp32 sums (TDPBF16PS), each result rounded once.
//
// W is re-laid once at load (kernels/gemv_amx.py `pack_b`) into units of 16 outputs whose
// 32-input chunks are the B operand's pair layout: wv [ceil(O/16)][K/32][16 k-pairs][16][2]
// bf16 (outputs zero-padded), one KiB a chunk. x is the A operand, read in place: a tile is 16
// rows × 32 inputs at x's row stride (K % 32 == 0). C tiles are [16 rows][16 outputs] fp32.
//
// Blocking: 2 × 2 tiles, C = 32 rows × 32 outputs (C 0-3, A 4/5 = x rows 0-15 / 16-31, B 6/7 =
// units u, u+1). Each thread takes a contiguous, equal share of the units (oneDNN's GEMM left
// one of the two cores idle for some of SmolLM2's shapes: 512 × 576 × 576 as slow on two
// threads as on one, BENCHMARKS.md) and walks them in groups of GROUP units, every row block
// per group (the group's W stays in L2). A block's C tiles are rounded while the next block's
// products run: the rounding is issued after that block's TDPBF16PS, which do not depend on it.
//
// Rounding: one VCVTNE2PS2BF16 per row of two tiles (32 outputs); a row holding a subnormal or
// NaN lane, where that instruction differs from c10's round-to-nearest-even (it flushes
// subnormals, keeps NaN payloads), and partial units take bf16.h's integer rounding instead:
// the bits of c10::BFloat16(float) always.
//
// SiLU·mul epilogue (gemm_amx_silu_out, the MLP's gate/up product): W = [gate; up] packed with
// their units interleaved (gate unit j, up unit j), threads and groups split at even units, so
// each 2-unit block is one (gate, up) pair; its C tiles are rounded to bf16 as above and
// turned into 16 outputs of silu(g)·u as cpu_norm.cpp computes it from those bf16 values. The
// [M, 2I] product is never written or read back (a 500-token step: 1.0 ms a layer against
// 1.17 for the GEMM then the separate op, BENCHMARKS.md sixteenth pass).
//
// Bits: every C element starts at 0 and takes one TDPBF16PS per 32-input chunk in order, as
// gemv_amx.cpp does with the operands' roles swapped (the same products, the same order: equal
// outputs, tests/kernels/test_gemv_amx.py). A row's result depends on its x row and W only:
// the same for any row count, thread count, and as the AMX GEMV's ≤ 32 rows, so a prompt's
// GEMMs agree bit for bit however a step batches or chunks it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "amx.h"
#include "bf16.h"
#include "release_gil.h"
#include "simd_exp.h"

namespace {

constexpr int64_t KC = 32;     // inputs per chunk: one A tile row
constexpr int64_t OU = 16;     // outputs per unit: one B tile row of pairs
constexpr int64_t UNIT = 512;  // bf16 of one unit chunk: 16 k-pairs × 16 outputs × 2
constexpr int64_t GROUP = 8;   // units a thread walks all row blocks with (8-16: within noise)

struct Gemm {
  const uint16_t* x; int64_t ldx, M;  // [M, K] rows at stride ldx (elements)
  const uint16_t* w; int64_t chunks, O;
  baton::bf16* y; int64_t ldy;        // [M, O]; with silu [M, O / 2]
  bool silu;                          // units paired (gate j, up j): y = silu(gate) · up
};

#if defined(__x86_64__) || defined(_M_X64)

// A 4 / C 0-1 hold r0 rows, A 5 / C 2-3 r1 (r1 0: one A tile); B 6-7 16 pairs of 16 outputs.
BATON_AMX_TARGET void configure(int r0, int r1) {
  baton_amx::TileConfig c;
  const uint8_t q = static_cast<uint8_t>(r1 > 0 ? r1 : r0);
  c.rows[0] = c.rows[1] = c.rows[4] = static_cast<uint8_t>(r0);
  c.rows[2] = c.rows[3] = c.rows[5] = q;
  __asm__ volatile("" ::: "memory");  // LDTILECFG reads *c: keep the stores above
  _tile_loadconfig(&c);
}

// C tiles of NR × 16 rows by NU units over all chunks (left in the tiles).
template <int NU, int NR>
BATON_AMX_TARGET inline void products(const uint16_t* x, int64_t ldx, const uint16_t* w0,
                                      const uint16_t* w1, int64_t chunks) {
  _tile_zero(0);
  if (NU > 1) _tile_zero(1);
  if (NR > 1) _tile_zero(2);
  if (NU > 1 && NR > 1) _tile_zero(3);
  const int ld = static_cast<int>(2 * ldx);
  for (int64_t k = 0; k < chunks; ++k) {
    _tile_loadd(6, w0 + k * UNIT, 64);
    _tile_loadd(4, x + k * KC, ld);
    _tile_dpbf16ps(0, 4, 6);
    if (NU > 1) { _tile_loadd(7, w1 + k * UNIT, 64); _tile_dpbf16ps(1, 4, 7); }
    if (NR > 1) {
      _tile_loadd(5, x + 16 * ldx + k * KC, ld);
      _tile_dpbf16ps(2, 5, 6);
      if (NU > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

template <int NU, int NR>
BATON_AMX_TARGET inline void store_tiles(float* c) {
  _tile_stored(0, c, 64);
  if (NU > 1) _tile_stored(1, c + 256, 64);
  if (NR > 1) _tile_stored(2, c + 512, 64);
  if (NU > 1 && NR > 1) _tile_stored(3, c + 768, 64);
}

// Lanes VCVTNE2PS2BF16 rounds unlike c10::BFloat16: subnormals and NaNs.
BATON_AMX_TARGET inline __mmask16 odd_lanes(__m512 v) {
  const __m512i a = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF));
  return _mm512_cmplt_epu32_mask(_mm512_sub_epi32(a, _mm512_set1_epi32(1)),
                                 _mm512_set1_epi32(0x007FFFFF)) |
         _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
}

// Rows of one tile (on < 16 outputs: masked) into y, c10's rounding.
BATON_AMX_TARGET inline void round_tile(const float* t, int rows, baton::bf16* y, int64_t ldy,
                                        int on) {
  const __mmask16 m = on >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << on) - 1u);
  for (int r = 0; r < rows; ++r)
    _mm256_mask_storeu_epi16(y + r * ldy, m,
                             _mm512_cvtepi32_epi16(baton::bf16_bits(_mm512_loadu_ps(t + 16 * r))));
}

// Rows of two tiles (32 outputs) into y: one VCVTNE2PS2BF16 a row unless a lane is odd.
BATON_AMX_TARGET inline void round_pair(const float* t0, const float* t1, int rows,
                                        baton::bf16* y, int64_t ldy) {
  for (int r = 0; r < rows; ++r) {
    const __m512 a = _mm512_loadu_ps(t0 + 16 * r), b = _mm512_loadu_ps(t1 + 16 * r);
    if (__builtin_expect((odd_lanes(a) | odd_lanes(b)) != 0, 0)) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy),
                          _mm512_cvtepi32_epi16(baton::bf16_bits(a)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + 16),
                          _mm512_cvtepi32_epi16(baton::bf16_bits(b)));
    } else {
      _mm512_storeu_si512(y + r * ldy, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

// A block whose C tiles sit in a buffer, waiting to be rounded into y.
struct Pending {
  int64_t row = 0, unit = 0;
  int r0 = 0, r1 = 0, units = 0;  // units 0: none
};

// Rows of a (gate, up) tile pair into 16 outputs of y: each product rounded to bf16 as the plain
// GEMM stores it (bf16_bits: c10's rounding, the bits VCVTNE2PS2BF16 gives on other lanes),
// then cpu_norm.cpp's bf16 silu_mul on those values: bf16(bf16(g / (1 + e^-g)) · u).
BATON_AMX_TARGET inline void silu_rows(const float* gate, const float* up, int rows,
                                       baton::bf16* y, int64_t ldy) {
  for (int r = 0; r < rows; ++r) {
    const __m512 gv = baton::round16<baton::bf16>(_mm512_loadu_ps(gate + 16 * r));
    const __m512 uv = baton::round16<baton::bf16>(_mm512_loadu_ps(up + 16 * r));
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    const __m512 sv = baton::round16<baton::bf16>(
        _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    baton::store16(y + r * ldy, _mm512_mul_ps(sv, uv));
  }
}

BATON_AMX_TARGET void round_block(const Gemm& g, const Pending& p, const float* c) {
  if (p.units == 0) return;
  if (g.silu) {  // p.unit even, p.units 2 (threads and groups split at even units)
    baton::bf16* y = g.y + p.row * g.ldy + (p.unit / 2) * OU;
    silu_rows(c, c + 256, p.r0, y, g.ldy);
    if (p.r1) silu_rows(c + 512, c + 768, p.r1, y + 16 * g.ldy, g.ldy);
    return;
  }
  const int64_t o0 = p.unit * OU;
  baton::bf16* y = g.y + p.row * g.ldy + o0;
  if (p.units == 2 && o0 + 2 * OU <= g.O) {
    round_pair(c, c + 256, p.r0, y, g.ldy);
    if (p.r1) round_pair(c + 512, c + 768, p.r1, y + 16 * g.ldy, g.ldy);
    return;
  }
  for (int s = 0; s < p.units; ++s) {
    const int on = static_cast<int>(std::min<int64_t>(OU, g.O - o0 - s * OU));
    round_tile(c + 256 * s, p.r0, y + s * OU, g.ldy, on);
    if (p.r1) round_tile(c + 512 + 256 * s, p.r1, y + 16 * g.ldy + s * OU, g.ldy, on);
  }
}

// Units [u0, u1) of every row on this thread.
BATON_AMX_TARGET void run_units(const Gemm& g, int64_t u0, int64_t u1) {
  alignas(64) float buf[2][1024];
  int config = -1, cur = 0;
  Pending pending;
  for (int64_t ub = u0; ub < u1; ub += GROUP) {
    const int64_t ue = std::min(u1, ub + GROUP);
    for (int64_t row = 0; row < g.M; row += 32) {
      const int rows = static_cast<int>(std::min<int64_t>(32, g.M - row));
      const int r0 = std::min(16, rows), r1 = rows - r0;
      if (r0 * 64 + r1 != config) {  // the tail rows: a new configuration, after the last block
        round_block(g, pending, buf[1 - cur]);
        pending.units = 0;
        configure(r0, r1);
        config = r0 * 64 + r1;
      }
      const uint16_t* x = g.x + row * g.ldx;
      for (int64_t u = ub; u < ue; u += 2) {
        const uint16_t* w0 = g.w + u * g.chunks * UNIT;
        const int units = u + 1 < ue ? 2 : 1;
        const uint16_t* w1 = units == 2 ? w0 + g.chunks * UNIT : w0;
        float* c = buf[cur];
        if (units == 2) {
          if (r1) products<2, 2>(x, g.ldx, w0, w1, g.chunks);
          else products<2, 1>(x, g.ldx, w0, w1, g.chunks);
        } else {
          if (r1) products<1, 2>(x, g.ldx, w0, w1, g.chunks);
          else products<1, 1>(x, g.ldx, w0, w1, g.chunks);
        }
        round_block(g, pending, buf[1 - cur]);  // overlaps the products above
        if (units == 2) { if (r1) store_tiles<2, 2>(c); else store_tiles<2, 1>(c); }
        else { if (r1) store_tiles<1, 2>(c); else store_tiles<1, 1>(c); }
        pending = Pending{row, u, r0, r1, units};
        cur = 1 - cur;
      }
    }
  }
  round_block(g, pending, buf[1 - cur]);
  _tile_release();
}

#endif

}  // namespace

namespace {

void check_gemm(const torch::Tensor& x, const torch::Tensor& wv, const torch::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && wv.dim() == 4 && out.dim() == 2, "gemm_amx: x, out 2-D, wv 4-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wv.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "gemm_amx: bf16 only");
  TORCH_CHECK(x.device().is_cpu() && wv.device().is_cpu() && out.device().is_cpu(),
              "gemm_amx: CPU only");
  TORCH_CHECK(wv.is_contiguous() && wv.size(2) == 16 && wv.size(3) == 32,
              "gemm_amx: wv must be contiguous [O/16, K/32, 16, 32]");
  TORCH_CHECK(x.size(1) % KC == 0, "gemm_amx: the inputs must be a multiple of 32, got ",
              x.size(1));
  TORCH_CHECK(out.size(0) == x.size(0) && wv.size(1) == x.size(1) / KC,
              "gemm_amx: x, wv and out disagree on the shape");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "gemm_amx: x and out need unit inner stride");
#if defined(__x86_64__) || defined(_M_X64)
  TORCH_CHECK(baton_amx::usable(), "gemm_amx: this CPU (or the OS) does not allow AMX");
#else
  TORCH_CHECK(false, "gemm_amx: x86-64 only");
#endif
}

// `units` of wv over the threads in equal contiguous shares of `step` units each.
void run(const Gemm& g, int64_t units, int64_t step) {
#if defined(__x86_64__) || defined(_M_X64)
  if (g.M == 0 || units == 0) return;
  const int64_t steps = units / step;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), steps));
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      run_units(g, step * (steps * p / parts), step * (steps * (p + 1) / parts));
  });
#endif
}

Gemm make(const torch::Tensor& x, const torch::Tensor& wv, torch::Tensor& out, int64_t O,
          bool silu) {
  return Gemm{reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0),
              x.size(0), reinterpret_cast<const uint16_t*>(wv.data_ptr<at::BFloat16>()),
              x.size(1) / KC, O, out.data_ptr<at::BFloat16>(), out.stride(0), silu};
}

}  // namespace

// x [M, K] bf16 (K % 32 == 0, unit inner stride), wv [ceil(O/16), K/32, 16, 32] bf16 contiguous
// (gemv_amx.py `pack_b`), out [M, O] bf16 (unit inner stride). RuntimeError without AMX.
void gemm_amx_out(const torch::Tensor& x, const torch::Tensor& wv, torch::Tensor& out) {
  check_gemm(x, wv, out);
  const int64_t O = out.size(1);
  TORCH_CHECK(wv.size(0) == (O + OU - 1) / OU, "gemm_amx: x, wv and out disagree on the shape");
  run(make(x, wv, out, O, false), wv.size(0), 1);
}

// The gate/up GEMM with SiLU·mul as its epilogue: wv = gemv_amx.py's pack_b of
// interleave_gate_up([gate; up]) (gate unit j, then up unit j), out [M, I] bf16 =
// silu(x @ gate.T) · (x @ up.T), bit for bit gemm_amx_out into [M, 2I] then cpu_norm.cpp's
// silu_mul_out (I % 16 == 0: every unit whole). RuntimeError without AVX-512/AMX or on a shape.
void gemm_amx_silu_out(const torch::Tensor& x, const torch::Tensor& wv, torch::Tensor& out) {
  check_gemm(x, wv, out);
  const int64_t I = out.size(1);
  TORCH_CHECK(I % OU == 0 && wv.size(0) == 2 * (I / OU),
              "gemm_amx_silu: out [M, I] with I % 16 == 0 and wv of 2·I/16 units expected");
  run(make(x, wv, out, 2 * I, true), wv.size(0), 2);
}

void register_gemm_amx(pybind11::module& m) {
  m.def("gemm_amx_out", &gemm_amx_out, BATON_RELEASE_GIL,
        "out[M, O] = x[M, K] @ W.T, W packed as AMX B units (bf16)");
  m.def("gemm_amx_silu_out", &gemm_amx_silu_out, BATON_RELEASE_GIL,
        "out[M, I] = silu(x @ gate.T) * (x @ up.T), [gate; up] packed with units interleaved");
}
