// bf16 prefill attention on CPU with AVX512_BF16, and AMX where present (kernels/cpu_prefill.py):
// causal attention of one sequence's new query tokens over its whole context, read in place
// through its block table.
//
// prefill_attention_bf16_out(query [Tq, Hq, D], kv_cache [NB, L, 2, BS, Hkv, D], layer,
//                            block_table [max_blocks] int32, seq_len, scale, out [Tq, Hq, D], isa)
//   query token i sits at position seq_len − Tq + i and sees positions [0, seq_len − Tq + i].
//   isa 0 takes the AMX item (prefill_amx.h: q·k and p·v as TDPBF16PS tiles, the softmax over
//   256-key blocks) where the CPU and OS allow it and D % 32 == 0, else the AVX512_BF16 item
//   below; a 1,000-token layer (9 heads, 3 KV heads, D = 64) on two cores of an AMX Xeon:
//   6.0 -> 2.1 ms, 1.9 with the blocks.
//
// Flash-attention's online softmax (Dao et al. 2022, "FlashAttention", Algorithm 1) over key
// tiles of 64 positions aligned at position 0, in the base-2 domain; per query row (token i,
// head g of KV head h):
//   x = (q · k)·scale·log2(e)   fp32 sums of exact bf16 products (VDPBF16PS over d pairs), the
//                               product and the subtraction of m' one FMA
//   m' = max(m, max x)          α = 2^(m − m'),  p = 2^(x − m') (0 past the row's last position)
//   l = l·α + Σ p               o = o·α + bf16(p) · v (VDPBF16PS over key pairs)
//   out = bf16(o / l)           rounded to nearest even once
// 2^x is a degree-6 polynomial (simd_exp.h, < 2e-7 relative); p is rounded to bf16 (nearest
// even, VCVTNE2PS2BF16, which also flushes p < 2^-126 to 0) before p·v, as torch's bf16 SDPA on
// CPU rounds it; everything else is fp32.
//
// A row's arithmetic depends only on its own q and position and the K/V of positions up to it,
// in one fixed order (tiles from position 0, lanes and pairs fixed): its result does not depend
// on the other rows, how the prompt was chunked, or the thread count, so chunked prefill on a
// prefill worker and a colocated one give the same bits. (Key vectors and key pairs that no row
// of a 4-row group sees are skipped: their p is 0 and adding 0·v changes no bit.)
//
// Work: pass 1 packs each KV head's K as [tile][d pair][64 keys] and V as [tile][key pair][D]
// 32-bit words (bf16 pairs, the operand layout VDPBF16PS wants; positions past seq_len zero;
// kv_pack.h). Pass 2 splits items (KV head, tile of 16 query tokens; 8 or 4 when 16 would
// leave a thread idle) over threads, in an order that gives each contiguous share a like
// amount of causal work; an item keeps its G·16 rows' o, m, l in
// a thread-local scratch and runs 4 rows at a time against each key tile: 16 score accumulators
// (4 rows × 4 vectors of 16 keys), the 4 rows' max and sum in one reduction tree each, then the
// p·v sums with 4 × D/16 accumulators in registers. Against the 32-key tiles, per-row horizontal
// reductions, e^x and o kept in memory of the first version: a 1,000-token layer (9 heads, 3 KV
// heads, D = 64) on one Zen 4 core 11.9 -> 7.3 ms (~97 -> ~156 GFLOP/s; VDPBF16PS peak ~232).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "bf16.h"
#include "isa.h"
#include "kv_pack.h"
#include "release_gil.h"
#include "simd_exp.h"

namespace {

using baton::bf16;
constexpr int64_t KT = baton::PACK_KEYS;  // keys per tile
constexpr int64_t QT = 16;  // query tokens per item (fewer when that leaves threads idle)
constexpr int64_t KW = KT / 2;  // 32-bit words (bf16 pairs) of one row's p per tile

struct Args {
  const uint16_t* q; int64_t ldq;  // [Tq, Hq·D] rows (token stride ldq, heads contiguous)
  const uint16_t* cache;           // [NB, L, 2, BS, Hkv, D]
  int64_t layer, L, BS, Hq, Hkv, D, G;
  const int32_t* table;
  int64_t N, Tq, base;             // seq_len, query tokens, position of query token 0
  float scale;
  uint16_t* out; int64_t ldo;      // [Tq, Hq·D]
  int64_t tiles;                   // key tiles = ceil(N / KT)
  int64_t qt;                      // query tokens per item, ≤ QT
  uint32_t* kp; uint32_t* vp;      // packed K, V: per head tiles · KT·D/2 words each
};

inline const uint16_t* kv_row(const Args& a, int64_t kv, int64_t n, int64_t h) {
  const int64_t block = a.table[n / a.BS];
  return a.cache + ((((block * a.L + a.layer) * 2 + kv) * a.BS + n % a.BS) * a.Hkv + h) * a.D;
}

// Tile t of KV head h packed (kv_pack.h: K words [d pair][KT keys], V words [key pair][D];
// positions past N zero), by AVX-512 where D % 32 == 0.
inline void pack(const Args& a, int64_t h, int64_t t, bool vector) {
  const int64_t n0 = t * KT, words = KT * a.D / 2;
  const uint16_t* k[KT];
  const uint16_t* v[KT];
  for (int64_t j = 0; j < KT; ++j) {
    k[j] = n0 + j < a.N ? kv_row(a, 0, n0 + j, h) : nullptr;
    v[j] = n0 + j < a.N ? kv_row(a, 1, n0 + j, h) : nullptr;
  }
  uint32_t* kp = a.kp + (h * a.tiles + t) * words;
  uint32_t* vp = a.vp + (h * a.tiles + t) * words;
#ifdef BATON_X86
  if (vector) return baton::pack_tile_avx512(k, v, a.D, kp, vp);
#endif
  baton::pack_tile(k, v, a.D, kp, vp);
}

struct Scratch {
  std::vector<uint32_t> q;   // [R4][D/2] words
  std::vector<uint32_t> p;   // [4][KW] words: the current group's bf16 p pairs
  std::vector<float> o, m, l, alpha;
  std::vector<int64_t> last;
  std::vector<float> scores, pv;  // the AMX item's tile stores (prefill_amx.h)
};

#ifdef BATON_X86
#define BATON_BF16_TARGET __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
BATON_BF16_TARGET inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
BATON_BF16_TARGET inline __m512i bcast(const uint32_t* w) {
  return _mm512_set1_epi32(static_cast<int>(*w));
}

// acc[u][c] = q_u · k for 4 rows u and the keys of vector c < NK (16 keys each) of a packed K
// tile; vectors c >= NK are set to 0 (their keys are masked by the caller).
template <int NK>
BATON_BF16_TARGET inline void qk(const uint32_t* kt, const uint32_t* qr, int64_t DP,
                                 __m512 (&acc)[4][4]) {
  for (int u = 0; u < 4; ++u)
    for (int c = 0; c < 4; ++c) acc[u][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < DP; ++d) {
    const uint32_t* kd = kt + d * KT;
    __m512i k[NK];
    for (int c = 0; c < NK; ++c) k[c] = _mm512_loadu_si512(kd + 16 * c);
    for (int u = 0; u < 4; ++u) {
      const __m512i qw = bcast(qr + u * DP + d);
      for (int c = 0; c < NK; ++c) acc[u][c] = dp(acc[u][c], qw, k[c]);
    }
  }
}

// o[u] = o[u]·alpha[u] + Σ_m p[u][m] · v[m] for 4 rows over d in [d0, d0 + 16·NV), key pairs
// [0, mpn).
template <int NV>
BATON_BF16_TARGET inline void pv(const uint32_t* vt, int64_t D, int64_t d0, const uint32_t* p,
                                 float* o, const float* alpha, int64_t mpn) {
  __m512 acc[4][NV];
  for (int u = 0; u < 4; ++u) {
    const __m512 av = _mm512_set1_ps(alpha[u]);
    for (int c = 0; c < NV; ++c)
      acc[u][c] = _mm512_mul_ps(_mm512_loadu_ps(o + u * D + d0 + 16 * c), av);
  }
  for (int64_t mp = 0; mp < mpn; ++mp) {
    const uint32_t* vm = vt + mp * D + d0;
    __m512i v[NV];
    for (int c = 0; c < NV; ++c) v[c] = _mm512_loadu_si512(vm + 16 * c);
    for (int u = 0; u < 4; ++u) {
      const __m512i pw = bcast(p + u * KW + mp);
      for (int c = 0; c < NV; ++c) acc[u][c] = dp(acc[u][c], pw, v[c]);
    }
  }
  for (int u = 0; u < 4; ++u)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + u * D + d0 + 16 * c, acc[u][c]);
}

// The online-softmax bookkeeping of rows r0..r0+3, shared by softmax4 and prefill_amx.h's
// softmax_block. new_maxes: each row's running max m' = max(m, mx·scale·log2 e) from its score
// maxima mx[u] (lanes reduced here) into mn[u]. rescale_rows, once the rows' p are summed per
// lane in ps[u]: α = 2^(m − m') (1 when unchanged) into alpha[u], m = m', l = l·α + Σ p.
BATON_BF16_TARGET inline void new_maxes(const Scratch& s, int64_t r0, __m512 (&mx)[4],
                                        __m512 sl2, float* mn) {
  alignas(16) float mt[4];
  _mm_store_ps(mt, _mm_mul_ps(reduce4<true>(mx), _mm512_castps512_ps128(sl2)));
  for (int u = 0; u < 4; ++u) mn[u] = std::max(s.m[r0 + u], mt[u]);
}

BATON_BF16_TARGET inline void rescale_rows(Scratch& s, int64_t r0, const float* mn,
                                           __m512 (&ps)[4], float* alpha) {
  alignas(16) float ls[4];
  _mm_store_ps(ls, reduce4<false>(ps));
  for (int u = 0; u < 4; ++u) {
    const int64_t r = r0 + u;
    alpha[u] = s.m[r] == mn[u] ? 1.0f : std::exp2(s.m[r] - mn[u]);
    s.m[r] = mn[u];
    s.l[r] = s.l[r] * alpha[u] + ls[u];
  }
}

// The online-softmax step of rows r0..r0+3 (file comment) over key tile n0, given their scores
// acc[u][c] (keys n0 + 16c + lane; keys past a row's last position are masked here): updates
// s.m and s.l, writes each row's α to alpha[u] and its bf16 p pairs to p_out[u·KW ..] (word m =
// keys 2m, 2m + 1). The AVX512_BF16 item's (the AMX item has softmax_block, prefill_amx.h).
BATON_BF16_TARGET inline void softmax4(Scratch& s, int64_t r0, int64_t n0, __m512 (&acc)[4][4],
                                       __m512 sl2, uint32_t* p_out, float* alpha) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 km[4][4];
  bool diag = false;
  __m512 mx[4];
  for (int u = 0; u < 4; ++u) {
    const int64_t vis = s.last[r0 + u] - n0;  // last visible key of the tile (may be < 0)
    if (vis < KT - 1) {
      diag = true;
      const __m512i lim = _mm512_set1_epi32(static_cast<int>(std::max<int64_t>(vis, -1)));
      for (int c = 0; c < 4; ++c) {
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * c));
        km[u][c] = _mm512_cmple_epi32_mask(key, lim);
        acc[u][c] = _mm512_mask_mov_ps(ninf, km[u][c], acc[u][c]);
      }
    } else {
      for (int c = 0; c < 4; ++c) km[u][c] = 0xFFFF;
    }
    mx[u] = _mm512_max_ps(_mm512_max_ps(acc[u][0], acc[u][1]),
                          _mm512_max_ps(acc[u][2], acc[u][3]));
  }
  float mn[4];
  new_maxes(s, r0, mx, sl2, mn);
  __m512 ps[4];
  for (int u = 0; u < 4; ++u) {
    const __m512 mv = _mm512_set1_ps(mn[u]);
    __m512 p[4];
    for (int c = 0; c < 4; ++c) p[c] = exp2_512(_mm512_fmsub_ps(acc[u][c], sl2, mv));
    if (diag)
      for (int c = 0; c < 4; ++c) p[c] = _mm512_maskz_mov_ps(km[u][c], p[c]);
    ps[u] = _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3]));
    // bf16 pairs in key order: word m = (p[2m], p[2m+1])
    _mm512_storeu_si512(&p_out[u * KW], (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
    _mm512_storeu_si512(&p_out[u * KW + 16], (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
  }
  rescale_rows(s, r0, mn, ps, alpha);
}

// An item's rows: query tokens [i0, i0 + ti) of KV head h, R = ti·G rows (token-major, head g of
// token i is row (i − i0)·G + g), padded to RP rows, a multiple of the group the item runs at once.
// An item's rows (query tokens i0 .. i0 + ti, R = ti·G rows padded to RP) and what it reads:
// the key tiles up to its last token's position, of head h's packed K and V.
struct ItemRows {
  int64_t i0, ti, R, RP, tiles;
  const uint32_t* kp;
  const uint32_t* vp;
};

// Sets up s for an item run `group` rows at a time: each row's q (bf16 pairs; padding rows 0),
// o = 0, m = −inf, l = 0, and its last visible position (padding rows repeat the last row's).
inline ItemRows begin_item(const Args& a, int64_t h, int64_t qt, int64_t group, Scratch& s) {
  const int64_t D = a.D, DP = D / 2, G = a.G, i0 = qt * a.qt;
  const int64_t ti = std::min(a.qt, a.Tq - i0), R = ti * G, RP = (R + group - 1) / group * group;
  s.q.assign(RP * DP, 0u);
  s.o.assign(RP * D, 0.0f);
  s.m.assign(RP, -std::numeric_limits<float>::infinity());
  s.l.assign(RP, 0.0f);
  s.last.resize(RP);
  for (int64_t r = 0; r < RP; ++r) {
    const int64_t rr = std::min(r, R - 1), i = i0 + rr / G, g = rr % G;
    s.last[r] = a.base + i;
    if (r < R) std::memcpy(&s.q[r * DP], a.q + i * a.ldq + (h * G + g) * D, D * 2);
  }
  const int64_t end = a.base + i0 + ti, head = h * a.tiles * KT * DP;
  return {i0, ti, R, RP, (end + KT - 1) / KT, a.kp + head, a.vp + head};
}

// out rows of the item: bf16(o / l), rounded to nearest even once.
BATON_BF16_TARGET inline void finish_item(const Args& a, int64_t h, const ItemRows& it,
                                          const Scratch& s) {
  const int64_t D = a.D, G = a.G;
  for (int64_t r = 0; r < it.R; ++r) {
    const int64_t i = it.i0 + r / G, g = r % G;
    const __m512 inv = _mm512_set1_ps(1.0f / s.l[r]);
    uint16_t* dst = a.out + i * a.ldo + (h * G + g) * D;
    for (int64_t d = 0; d < D; d += 16)
      baton::store16(reinterpret_cast<bf16*>(dst + d),
                     _mm512_mul_ps(_mm512_loadu_ps(&s.o[r * D + d]), inv));
  }
}

BATON_BF16_TARGET void item(const Args& a, int64_t h, int64_t qt, Scratch& s) {
  const int64_t D = a.D, DP = D / 2;
  const ItemRows it = begin_item(a, h, qt, 4, s);
  const int64_t R4 = it.RP;
  s.p.resize(4 * KW);
  s.alpha.resize(4);
  const __m512 sl2 = _mm512_set1_ps(a.scale * 1.4426950408889634f);  // scale·log2(e)
  for (int64_t t = 0; t < it.tiles; ++t) {
    const uint32_t* kt = it.kp + t * KT * DP;
    const uint32_t* vt = it.vp + t * KT * DP;
    const int64_t n0 = t * KT;
    for (int64_t r0 = 0; r0 < R4; r0 += 4) {
      if (s.last[r0 + 3] < n0) continue;  // no row of the group sees this tile
      __m512 acc[4][4];
      // key vectors past the group's last visible key are all masked: not computed
      switch (std::min<int64_t>(4, (s.last[r0 + 3] - n0) / 16 + 1)) {
        case 1: qk<1>(kt, &s.q[r0 * DP], DP, acc); break;
        case 2: qk<2>(kt, &s.q[r0 * DP], DP, acc); break;
        case 3: qk<3>(kt, &s.q[r0 * DP], DP, acc); break;
        default: qk<4>(kt, &s.q[r0 * DP], DP, acc); break;
      }
      softmax4(s, r0, n0, acc, sl2, &s.p[0], s.alpha.data());
      // key pairs past the group's last visible key have p = 0 for every row: skipped
      const int64_t mpn = std::min<int64_t>(KW, (s.last[r0 + 3] - n0) / 2 + 1);
      float* o = &s.o[r0 * D];
      int64_t d0 = 0;
      for (; d0 + 64 <= D; d0 += 64) pv<4>(vt, D, d0, s.p.data(), o, s.alpha.data(), mpn);
      switch ((D - d0) / 16) {
        case 1: pv<1>(vt, D, d0, s.p.data(), o, s.alpha.data(), mpn); break;
        case 2: pv<2>(vt, D, d0, s.p.data(), o, s.alpha.data(), mpn); break;
        case 3: pv<3>(vt, D, d0, s.p.data(), o, s.alpha.data(), mpn); break;
        default: break;
      }
    }
  }
  finish_item(a, h, it, s);
}
#include "prefill_amx.h"
#endif

bool has_bf16_isa() {
#ifdef BATON_X86
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16")
                          && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}

bool has_amx_isa() {
#ifdef BATON_X86
  return baton_amx::usable();  // implies has_bf16_isa()
#else
  return false;
#endif
}

}  // namespace

// Shapes at the top of the file; kernels/cpu_prefill.py checks them and documents the call.
// isa: 0 = the best this CPU has for these shapes (AMX where usable and D % 32 == 0), 4 = the
// AVX512_BF16 item, 5 = the AMX item (prefill_amx.h).
void prefill_attention_bf16_out(const torch::Tensor& query, const torch::Tensor& kv_cache,
                                int64_t layer, const torch::Tensor& block_table, int64_t seq_len,
                                double scale, torch::Tensor& out, int64_t isa) {
  TORCH_CHECK(has_bf16_isa(), "cpu_prefill: this CPU has no AVX512_BF16");
  TORCH_CHECK(isa == 0 || isa == 4 || isa == 5, "cpu_prefill: isa must be 0, 4 or 5");
  TORCH_CHECK(isa != 5 || has_amx_isa(), "cpu_prefill: this CPU (or OS) has no usable AMX");
  TORCH_CHECK(isa != 5 || kv_cache.size(5) % 32 == 0, "cpu_prefill: the AMX item needs D % 32 == 0");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "cpu_prefill: bf16 tensors only");
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu() && out.device().is_cpu(),
              "cpu_prefill: CPU tensors only");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(),
              "cpu_prefill: kv_cache must be a contiguous [NB, L, 2, BS, Hkv, D]");
  const int64_t Hkv = kv_cache.size(4), D = kv_cache.size(5);
  TORCH_CHECK(query.dim() == 3 && query.size(2) == D && query.stride(2) == 1 &&
              query.stride(1) == D, "cpu_prefill: query must be [Tq, Hq, D], heads contiguous");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.stride(1) == D,
              "cpu_prefill: out must be [Tq, Hq, D], heads contiguous");
  const int64_t Tq = query.size(0), Hq = query.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && D % 16 == 0, "cpu_prefill: need Hq = G·Hkv and D % 16 == 0");
  TORCH_CHECK(0 <= layer && layer < kv_cache.size(1), "cpu_prefill: layer out of range");
  TORCH_CHECK(1 <= Tq && Tq <= seq_len, "cpu_prefill: need 1 <= query tokens <= seq_len");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() &&
              block_table.dim() == 1, "cpu_prefill: block_table must be a contiguous int32 [max_blocks]");
  const int64_t BS = kv_cache.size(3), NB = kv_cache.size(0);
  const int64_t nblocks = (seq_len + BS - 1) / BS;
  TORCH_CHECK(nblocks <= block_table.numel(), "cpu_prefill: seq_len past the block table");
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < nblocks; ++b)
    TORCH_CHECK(0 <= table[b] && table[b] < NB, "cpu_prefill: block id out of range");
#ifdef BATON_X86
  const int64_t tiles = (seq_len + KT - 1) / KT, words = KT * D / 2;
  // every word is written by the pack (zeros past seq_len): no zero-filled allocation
  std::unique_ptr<uint32_t[]> kp(new uint32_t[Hkv * tiles * words]);
  std::unique_ptr<uint32_t[]> vp(new uint32_t[Hkv * tiles * words]);
  Args a{reinterpret_cast<const uint16_t*>(query.data_ptr()), query.stride(0),
         reinterpret_cast<const uint16_t*>(kv_cache.data_ptr()), layer, kv_cache.size(1), BS, Hq,
         Hkv, D, Hq / Hkv, table, seq_len, Tq, seq_len - Tq, static_cast<float>(scale),
         reinterpret_cast<uint16_t*>(out.data_ptr()), out.stride(0), tiles, QT, kp.get(),
         vp.get()};
  // A short suffix over a long context (an agent's next turn) is few items of long walks: 16
  // query tokens of 3 KV heads are 3 items for 2 threads. Items of 8 or 4 tokens then, so
  // each thread gets at least two. A row's bits do not depend on its item (file comment).
  const int64_t threads = at::get_num_threads();
  while (a.qt > 4 && Hkv * ((Tq + a.qt - 1) / a.qt) < 2 * threads) a.qt /= 2;
  const bool vector_pack = D % 32 == 0;
  at::parallel_for(0, Hkv * tiles, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) pack(a, i / tiles, i % tiles, vector_pack);
  });
  // items in the order tile 0, n−1, 1, n−2, ... (per head): contiguous shares get like work
  const int64_t nq = (Tq + a.qt - 1) / a.qt;
  const bool amx = D % 32 == 0 && (isa == 5 || (isa == 0 && has_amx_isa()));
  at::parallel_for(0, Hkv * nq, 1, [&](int64_t b, int64_t e) {
    Scratch s;
    if (amx) {
      TileScope tiles_configured;
      for (int64_t i = b; i < e; ++i) {
        const int64_t k = i / Hkv;
        item_amx(a, i % Hkv, k % 2 == 0 ? k / 2 : nq - 1 - k / 2, s);
      }
      return;
    }
    for (int64_t i = b; i < e; ++i) {
      const int64_t k = i / Hkv, h = i % Hkv;
      item(a, h, k % 2 == 0 ? k / 2 : nq - 1 - k / 2, s);
    }
  });
#endif
}

void register_cpu_prefill(pybind11::module& m) {
  m.def("prefill_attention_bf16_out", &prefill_attention_bf16_out, BATON_RELEASE_GIL,
        "causal bf16 prefill attention over a paged cache, AVX512_BF16 (kernels/cpu_prefill.py)");
  m.def("has_avx512_bf16_attention", &has_bf16_isa,
        "whether prefill_attention_bf16_out runs on this CPU");
}
