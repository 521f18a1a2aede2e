// Small-batch bf16 GEMV on Intel AMX tiles for CPU decode steps: y[b, o] = bf16(sum_k x[b, k]
// w[o, k]), fp32 sums (TDPBF16PS), each result rounded to bf16 (nearest even) once.
//
// W is re-laid once at load (kernels/gemv_amx.py `pack`) into units of 16 outputs, each unit's
// k-chunks of 32 contiguous: wp [ceil(O/16)][ceil(K/32)][16][32] bf16, zero-padded. A unit's
// chunk is one A tile (16 rows × 64 bytes) loaded from one contiguous KiB; x is re-laid per call
// into the B operand's pair layout ([chunk][16 k-pairs][B][2], zero-padded), so each
// TDPBF16PS computes a 16-output × B-row block of the step: C[o][b] += W[o][32c..] · x[b][32c..].
//
// Why: VDPBF16PS (gemv_bf16.cpp) is compute-bound on this kind of CPU from ~5 rows of x (an
// 8-row decode step of SmolLM2-135M's 121 matrices 15.0 ms against 10.8 for one row); one
// TDPBF16PS does 16 × 16 × 32 products, so the step stays at the weight-read time up to 32
// rows (BENCHMARKS.md, thirteenth pass). W read in place (row stride K, not re-laid) was slower
// than the AVX512_BF16 kernel at 1–4 rows (12 vs 10 ms): the contiguous units are what let the
// hardware prefetcher stream them.
//
// Streaming (as gemv.cpp): each thread takes a contiguous range of units and walks four
// distant quarters of it at once (four sequential streams), each stream prefetched PF chunks
// ahead; rows of x beyond 16 use a second B/C tile pair on the same A tile (W read once).
//
// Batch and thread invariance: C[o][b] depends only on w[o] and x[b] (a tile's rows and
// columns do not mix), every result runs the same chunk sequence over k, and a unit is never
// split between threads, so a row's result does not depend on the other rows, B, or the
// thread count. AMX's internal rounding within one TDPBF16PS is not the order of VDPBF16PS
// (nor any sequential fp32 order, measured), so this kernel's bits differ from
// gemv_bf16.cpp's: a model uses one of the two for all its small steps (baton/models/linear.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "bf16.h"
#include "release_gil.h"

namespace {

constexpr int64_t KC = 32;     // k per chunk: one A tile row, 32 bf16
constexpr int64_t OU = 16;     // outputs per unit: one A tile's rows
constexpr int64_t UNIT = OU * KC;  // bf16 elements of one unit's chunk (1 KiB)
constexpr int64_t BX = 16;     // x rows per B tile (one C tile's fp32 columns)
constexpr int64_t MAX_B = 32;  // two B tiles
constexpr int64_t PF = 2;      // chunks ahead a stream prefetches (1, 2, 4: within 3 %)

struct Args {
  const uint16_t* w;   // packed units
  const uint32_t* xv;  // [chunks][16][B] bf16 pairs
  int64_t chunks, B;
  baton::bf16* y; int64_t ldy, O;
};

#if defined(__x86_64__) || defined(_M_X64)

// Tiles: C 0-3, A 4/6/7 (alternating so a load overlaps the previous product), B 5 (and 6 for
// x rows 16-31, whose A tiles are then 4/7). colsb of C and B = 4 bytes × x rows of the tile.
BATON_AMX_TARGET void configure(int64_t B) {
  baton_amx::TileConfig c;
  const int b0 = static_cast<int>(std::min<int64_t>(B, BX)), b1 = static_cast<int>(B - b0);
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64;
  for (int t = 0; t < 4; ++t) c.colsb[t] = static_cast<uint16_t>(4 * (b1 > 0 && t % 2 ? b1 : b0));
  c.colsb[5] = static_cast<uint16_t>(4 * b0);
  if (b1 > 0) c.colsb[6] = static_cast<uint16_t>(4 * b1);
  // GCC does not see that LDTILECFG reads *c: keep the stores above
  __asm__ volatile("" ::: "memory");
  _tile_loadconfig(&c);
}

BATON_AMX_TARGET inline void prefetch_unit(const uint16_t* p) {
  const char* b = reinterpret_cast<const char*>(p);
  for (int i = 0; i < 2 * UNIT; i += 64) _mm_prefetch(b + i, _MM_HINT_T0);
}

// NT (1-4) units, x rows < 16: C tile s = unit s.
template <int NT>
BATON_AMX_TARGET void units16(const uint16_t* const* a, const Args& g, float* c) {
  _tile_zero(0); if (NT > 1) _tile_zero(1); if (NT > 2) _tile_zero(2); if (NT > 3) _tile_zero(3);
  const int ldx = static_cast<int>(4 * g.B);
  for (int64_t k = 0; k < g.chunks; ++k) {
    for (int s = 0; s < NT; ++s) prefetch_unit(a[s] + (k + PF) * UNIT);
    _tile_loadd(5, g.xv + k * 16 * g.B, ldx);
    _tile_loadd(4, a[0] + k * UNIT, 64); _tile_dpbf16ps(0, 4, 5);
    if (NT > 1) { _tile_loadd(6, a[1] + k * UNIT, 64); _tile_dpbf16ps(1, 6, 5); }
    if (NT > 2) { _tile_loadd(7, a[2] + k * UNIT, 64); _tile_dpbf16ps(2, 7, 5); }
    if (NT > 3) { _tile_loadd(4, a[3] + k * UNIT, 64); _tile_dpbf16ps(3, 4, 5); }
  }
  _tile_stored(0, c, 64);
  if (NT > 1) _tile_stored(1, c + 256, 64);
  if (NT > 2) _tile_stored(2, c + 512, 64);
  if (NT > 3) _tile_stored(3, c + 768, 64);
}

// NT (1-2) units, x rows 17-32: C tile 2s + j = unit s × x rows 16j...
template <int NT>
BATON_AMX_TARGET void units32(const uint16_t* const* a, const Args& g, float* c) {
  _tile_zero(0); _tile_zero(1); if (NT > 1) { _tile_zero(2); _tile_zero(3); }
  const int ldx = static_cast<int>(4 * g.B);
  for (int64_t k = 0; k < g.chunks; ++k) {
    for (int s = 0; s < NT; ++s) prefetch_unit(a[s] + (k + PF) * UNIT);
    _tile_loadd(5, g.xv + k * 16 * g.B, ldx);
    _tile_loadd(6, g.xv + k * 16 * g.B + BX, ldx);
    _tile_loadd(4, a[0] + k * UNIT, 64); _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6);
    if (NT > 1) { _tile_loadd(7, a[1] + k * UNIT, 64); _tile_dpbf16ps(2, 7, 5); _tile_dpbf16ps(3, 7, 6); }
  }
  _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64);
  if (NT > 1) { _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64); }
}

// C tiles → y: tile (s, j) holds [16 outputs][x rows 16j..], fp32 rows of 64 bytes.
void store(const Args& g, const int64_t* us, int nt, int nx, const float* c) {
  for (int s = 0; s < nt; ++s)
    for (int j = 0; j < nx; ++j) {
      const float* t = c + (s * nx + j) * 256;
      const int64_t o0 = us[s] * OU, on = std::min<int64_t>(OU, g.O - o0);
      for (int64_t m = j * BX; m < std::min<int64_t>(g.B, (j + 1) * BX); ++m)
        for (int64_t n = 0; n < on; ++n)
          g.y[m * g.ldy + o0 + n] = baton::bf16(t[n * 16 + (m - j * BX)]);
    }
}

// Units [u0, u1) on this thread, four (x rows > 16: two) distant streams at a time.
BATON_AMX_TARGET void run_units(const Args& g, int64_t u0, int64_t u1) {
  const int nx = g.B > BX ? 2 : 1, streams = nx == 1 ? 4 : 2;
  const int64_t q = (u1 - u0 + streams - 1) / streams;
  configure(g.B);
  alignas(64) float c[4 * 256];
  for (int64_t i = 0; i < q; ++i) {
    const uint16_t* a[4];
    int64_t us[4];
    int nt = 0;
    for (int s = 0; s < streams; ++s)
      if (u0 + s * q + i < u1) {
        us[nt] = u0 + s * q + i;
        a[nt] = g.w + us[nt] * g.chunks * UNIT;
        ++nt;
      }
    if (nx == 1) {
      if (nt == 4) units16<4>(a, g, c); else if (nt == 3) units16<3>(a, g, c);
      else if (nt == 2) units16<2>(a, g, c); else units16<1>(a, g, c);
    } else {
      if (nt == 2) units32<2>(a, g, c); else units32<1>(a, g, c);
    }
    store(g, us, nt, nx, c);
  }
  _tile_release();
}

#endif

}  // namespace

// x [B, K] bf16 (B <= 32, unit stride in K), wp [ceil(O/16), ceil(K/32), 16, 32] bf16 contiguous
// (gemv_amx.py `pack`), out [B, O] bf16 (unit inner stride). RuntimeError without AMX.
void gemv_amx_out(const torch::Tensor& x, const torch::Tensor& wp, torch::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 4 && out.dim() == 2, "gemv_amx: x, out 2-D, wp 4-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "gemv_amx: bf16 only");
  TORCH_CHECK(x.device().is_cpu() && wp.device().is_cpu() && out.device().is_cpu(), "gemv_amx: CPU only");
  TORCH_CHECK(wp.is_contiguous() && wp.size(2) == OU && wp.size(3) == KC,
              "gemv_amx: wp must be contiguous [O/16, K/32, 16, 32]");
  const int64_t B = x.size(0), K = x.size(1), O = out.size(1);
  TORCH_CHECK(B <= MAX_B, "gemv_amx: at most 32 rows of x, got ", B);
  TORCH_CHECK(out.size(0) == B && wp.size(0) == (O + OU - 1) / OU && wp.size(1) == (K + KC - 1) / KC,
              "gemv_amx: x, wp and out disagree on the shape");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "gemv_amx: x and out need unit inner stride");
#if defined(__x86_64__) || defined(_M_X64)
  TORCH_CHECK(baton_amx::usable(), "gemv_amx: this CPU (or the OS) does not allow AMX");
  if (B == 0 || O == 0) return;
  const int64_t chunks = wp.size(1), units = wp.size(0);
  std::vector<uint32_t> xv(chunks * 16 * B, 0u);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t b = 0; b < B; ++b) {  // pair p of row b → xv[p * B + b] (p = 16 chunk + kp)
    const uint16_t* row = xb + b * x.stride(0);
    for (int64_t p = 0; p < K / 2; ++p) std::memcpy(&xv[p * B + b], row + 2 * p, 4);
    if (K % 2) xv[(K / 2) * B + b] = row[K - 1];  // odd K: the last pair's high half stays 0
  }
  Args g{reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>()), xv.data(), chunks, B,
         out.data_ptr<at::BFloat16>(), out.stride(0), O};
  // >= ~128 KiB of weights a thread: below that a fork/join costs more than it saves
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(
      at::get_num_threads(), units * chunks * 2 * UNIT / (int64_t(1) << 17)));
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) run_units(g, units * p / parts, units * (p + 1) / parts);
  });
#else
  TORCH_CHECK(false, "gemv_amx: x86-64 only");
#endif
}

void register_gemv_amx(pybind11::module& m) {
  m.def("gemv_amx_out", &gemv_amx_out, BATON_RELEASE_GIL,
        "out[B, O] = x[B, K] @ W.T, W packed in AMX units (bf16)");
  m.def("has_amx", [] {
#if defined(__x86_64__) || defined(_M_X64)
    return baton_amx::usable();
#else
    return false;
#endif
  }, "whether this CPU and OS allow AMX tiles (amx.h; the AMX GEMV and prefill attention item)");
}
