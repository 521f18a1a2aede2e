// bf16 prefill attention on CPU with AVX512_BF16, and AMX where present (kernels/cpu_prefill.py):
// causal attention of one sequence's new query tokens over its whole context, read in place
// through its block table.
//
// prefill_attention_bf16_out(query [Tq, Hq, D], kv_cache [NB, L, 2, BS, Hkv, D], layer,
//                            block_table [max_blocks] int32, seq_len, scale, out [Tq, Hq, D], isa)
//   query token i sits at position seq_len − Tq + i and sees positions [0, seq_len − Tq + i].
//   isa 0 takes the AMX item (prefill_amx.h: q·k and p·v as TDPBF16PS tiles, the same softmax
//   code) where the CPU and OS allow it and D % 32 == 0, else the AVX512_BF16 item below; a
//   1,000-token layer (9 heads, 3 KV heads, D = 64) on two cores of an AMX Xeon: 6.0 -> 2.1 ms.
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
#include "prefill_amx.h"
#include "release_gil.h"
#include "simd_exp.h"
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
  return has_bf16_isa() && baton_amx::usable();
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
  m.def("has_amx_attention", &has_amx_isa,
        "whether prefill_attention_bf16_out's AMX item (isa 5) runs on this CPU and OS");
}
