// Greedy sampling's reductions over a row of logits, in one native pass each (kernels/cpu_sample.py):
//   ids[b] = argmax_v x[b, v]   (the first index of the maximum, as torch.argmax)
//   lse[b] = m + log Σ_v e^(x[b, v] − m),  m = max_v x[b, v]   (torch.logsumexp)
// x [B, V] fp32 or bf16 (bf16 widened exactly), ids [B] int64, lse [B] fp32. The sum runs in
// fp32 over 16 lanes in index order then a fixed lane tree (e^ by simd_exp.h's exp512, ~1 ulp),
// so a row's result does not depend on the other rows or the thread count. torch spends five
// passes (amax, sub, exp, sum, log) plus an fp32 copy of bf16 logits: ~0.4 ms per step at
// batch 1 over SmolLM2's 49,152-token vocabulary on the Zen 4 VM. Rows over threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "bf16.h"
#include "isa.h"
#include "release_gil.h"
#include "simd_exp.h"

namespace {

template <typename T>
inline float widen1(const T* x, int64_t v) { return static_cast<float>(x[v]); }

template <typename T>
void row_scalar(const T* x, int64_t V, int64_t* id, float* lse) {
  float m = widen1(x, 0);
  int64_t best = 0;
  for (int64_t v = 1; v < V; ++v)
    if (widen1(x, v) > m) { m = widen1(x, v); best = v; }
  float l[16] = {0};
  for (int64_t v = 0; v < V; ++v) l[v % 16] += std::exp(widen1(x, v) - m);
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) l[j] += l[j + w];
  *id = best;
  *lse = m + std::log(l[0]);
}

#ifdef BATON_X86
template <typename T>
__attribute__((target("avx512f"))) void row_avx512(const T* x, int64_t V, int64_t* id, float* lse) {
  using baton::load16;
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 mv = ninf;
  __m512i iv = _mm512_set1_epi32(0);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  const int64_t V16 = V / 16 * 16;
  for (int64_t v = 0; v < V16; v += 16, idx = _mm512_add_epi32(idx, step)) {
    const __m512 xv = load16(x + v);
    const __mmask16 gt = _mm512_cmp_ps_mask(xv, mv, _CMP_GT_OQ);  // strict: a lane keeps its first max
    mv = _mm512_mask_mov_ps(mv, gt, xv);
    iv = _mm512_mask_mov_epi32(iv, gt, idx);
  }
  alignas(64) float ms[16];
  alignas(64) int32_t is[16];
  _mm512_store_ps(ms, mv);
  _mm512_store_si512(is, iv);
  float m = -INFINITY;
  int64_t best = V;
  for (int j = 0; j < 16; ++j)
    if (ms[j] > m || (ms[j] == m && is[j] < best)) { m = ms[j]; best = is[j]; }
  for (int64_t v = V16; v < V; ++v)  // the tail's indices are all larger
    if (widen1(x, v) > m) { m = widen1(x, v); best = v; }
  if (best == V) best = 0;  // every value -inf or NaN: torch's argmax picks index 0 for -inf
  const __m512 mb = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t v = 0; v < V16; v += 16)
    acc = _mm512_add_ps(acc, exp512(_mm512_sub_ps(load16(x + v), mb)));
  alignas(64) float l[16];
  _mm512_store_ps(l, acc);
  for (int64_t v = V16; v < V; ++v) l[v % 16] += std::exp(widen1(x, v) - m);
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) l[j] += l[j + w];
  *id = best;
  *lse = m + std::log(l[0]);
}
#endif

template <typename T>
void run(const torch::Tensor& logits, torch::Tensor& ids, torch::Tensor& lse, bool simd) {
  const int64_t B = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  const T* x = logits.data_ptr<T>();
  int64_t* id = ids.data_ptr<int64_t>();
  float* out = lse.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
#ifdef BATON_X86
      if (simd) { row_avx512<T>(x + b * ld, V, id + b, out + b); continue; }
#endif
      row_scalar<T>(x + b * ld, V, id + b, out + b);
    }
  });
}

}  // namespace

// logits [B, V] fp32 or bf16 (unit inner stride, V >= 1), ids [B] int64, lse [B] fp32, CPU.
// isa: 0 = best (AVX-512F where present), 1 = scalar, 3 = AVX-512F (isa.h; tests force each).
void greedy_lse_out(const torch::Tensor& logits, torch::Tensor& ids, torch::Tensor& lse, int64_t isa) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1 && logits.stride(1) == 1,
              "greedy_lse: logits must be [B, V >= 1] with unit inner stride");
  TORCH_CHECK(logits.device().is_cpu() && ids.device().is_cpu() && lse.device().is_cpu(),
              "greedy_lse: CPU tensors only");
  TORCH_CHECK(ids.scalar_type() == at::kLong && lse.scalar_type() == at::kFloat &&
              ids.is_contiguous() && lse.is_contiguous() && ids.numel() == logits.size(0) &&
              lse.numel() == logits.size(0), "greedy_lse: ids [B] int64 and lse [B] fp32");
  const bool simd = baton::use_avx512(isa, "greedy_lse");
  if (logits.scalar_type() == at::kFloat) {
    run<float>(logits, ids, lse, simd);
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kBFloat16, "greedy_lse: fp32 or bf16 logits");
    run<baton::bf16>(logits, ids, lse, simd);
  }
}

void register_cpu_sample(pybind11::module& m) {
  m.def("greedy_lse_out", &greedy_lse_out, BATON_RELEASE_GIL,
        "argmax and logsumexp per row of [B, V] logits");
}
