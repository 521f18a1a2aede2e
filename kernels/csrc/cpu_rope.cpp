// Rotary embedding + KV-cache write for the rows of a prefill (or mixed) CPU step, fp32 or bf16
// (kernels/cpu_rope.py): what the torch path does per layer with ~8 ops (x·cos, roll, ·sin_signed,
// add, split, cat, index_copy_), in one pass over the step's q/k/v.
//
// rope_write_out(qkv [T, (Hq + 2·Hkv)·D], cos, sin_signed [max_pos, D], positions [T] int64,
//                kv_cache [NB, L, 2, BS, Hkv, D], layer, slot_mapping [T] int64, num_heads,
//                q_out [T, Hq·D])
//   q_out[t, h]          = rotate(q head h of token t)
//   cache K[slot_t, h]   = rotate(k head h of token t), cache V[slot_t, h] = v head h of token t
//                          (slot_t < 0: not written, as PagedAttentionPlan.write_kv)
//   rotate(x)[i] = x[i]·cos[i] + x[(i + D/2) % D]·sin_signed[i]   (decoder._rotate)
// Each product and the sum are rounded to the dtype as torch's ops round them (no FMA: the file
// is built with -ffp-contract=off), so q and the written K are bit-identical to the torch path.
// Every position and slot is checked before anything is written. Variants: AVX-512F (16 lanes
// at a time; needs D % 32 == 0 so each half-rotation is whole vectors) and scalar elsewhere.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "bf16.h"
#include "isa.h"
#include "release_gil.h"

namespace {

using baton::round_as;

template <typename T>
struct Rope {
  const T* qkv; int64_t ld;        // [T, (Hq + 2·Hkv)·D] rows
  const T* cos; const T* sin;      // [max_pos, D]
  const int64_t* pos; const int64_t* slots;
  T* cache; int64_t layer, L, BS, Hq, Hkv, D;
  T* q; int64_t ldq;               // [T, Hq·D]
};

template <typename T>
void rotate_scalar(const T* x, const T* c, const T* s, T* dst, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float a = round_as<T>(static_cast<float>(x[i]) * static_cast<float>(c[i]));
    const float b = round_as<T>(static_cast<float>(x[(i + half) % D]) * static_cast<float>(s[i]));
    dst[i] = static_cast<T>(round_as<T>(a + b));
  }
}

#ifdef BATON_X86
template <typename T>
__attribute__((target("avx512f"))) void rotate_avx512(const T* x, const T* c, const T* s, T* dst,
                                                      int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; i += 16) {
    const __m512 a = baton::round16<T>(_mm512_mul_ps(baton::load16(x + i), baton::load16(c + i)));
    const __m512 b = baton::round16<T>(
        _mm512_mul_ps(baton::load16(x + (i + half) % D), baton::load16(s + i)));
    baton::store16(dst + i, _mm512_add_ps(a, b));  // store16 rounds the sum to T
  }
}
#endif

template <typename T>
void rope_rows(const Rope<T>& a, int64_t t0, int64_t t1, bool simd) {
  const int64_t D = a.D;
  auto rotate = [&](const T* x, const T* c, const T* s, T* dst) {
#ifdef BATON_X86
    if (simd) return rotate_avx512(x, c, s, dst, D);
#endif
    rotate_scalar(x, c, s, dst, D);
  };
  for (int64_t t = t0; t < t1; ++t) {
    const T* row = a.qkv + t * a.ld;
    const T* c = a.cos + a.pos[t] * D;
    const T* s = a.sin + a.pos[t] * D;
    for (int64_t h = 0; h < a.Hq; ++h) rotate(row + h * D, c, s, a.q + t * a.ldq + h * D);
    const int64_t slot = a.slots[t];
    if (slot < 0) continue;
    const int64_t block = slot / a.BS, off = slot % a.BS;
    T* k = a.cache + (((block * a.L + a.layer) * 2 + 0) * a.BS + off) * a.Hkv * D;
    T* v = a.cache + (((block * a.L + a.layer) * 2 + 1) * a.BS + off) * a.Hkv * D;
    for (int64_t h = 0; h < a.Hkv; ++h) rotate(row + (a.Hq + h) * D, c, s, k + h * D);
    std::copy(row + (a.Hq + a.Hkv) * D, row + (a.Hq + 2 * a.Hkv) * D, v);
  }
}

template <typename T>
void launch(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
            const int64_t* pos, torch::Tensor& cache, int64_t layer, const int64_t* slots,
            int64_t Hq, torch::Tensor& q, bool simd) {
  const Rope<T> a{qkv.data_ptr<T>(), qkv.stride(0), cos.data_ptr<T>(), sin.data_ptr<T>(), pos,
                  slots, cache.data_ptr<T>(), layer, cache.size(1), cache.size(3), Hq,
                  cache.size(4), cache.size(5), q.data_ptr<T>(), q.stride(0)};
  // ~(Hq + Hkv)·D·3 flops a row: 32 rows a task keeps the fork cost below the work
  at::parallel_for(0, qkv.size(0), 32, [&](int64_t b, int64_t e) { rope_rows(a, b, e, simd); });
}

}  // namespace

// Shapes at the top of the file; kernels/cpu_rope.py documents the call. isa: 0 best, 1 scalar,
// 3 AVX-512F (RuntimeError where the CPU lacks it).
void rope_write_out(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                    const torch::Tensor& positions, torch::Tensor& kv_cache, int64_t layer,
                    const torch::Tensor& slot_mapping, int64_t num_heads, torch::Tensor& q_out,
                    int64_t isa) {
  const at::ScalarType dtype = kv_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "cpu_rope: fp32 or bf16 only");
  const torch::Tensor* tensors[] = {&qkv, &cos, &sin, &q_out, &kv_cache};
  for (const torch::Tensor* x : tensors)
    TORCH_CHECK(x->scalar_type() == dtype && x->device().is_cpu(),
                "cpu_rope: qkv, rope tables, cache and q_out must be CPU tensors of one dtype");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(),
              "cpu_rope: kv_cache must be a contiguous [NB, L, 2, BS, Hkv, D]");
  const int64_t T = qkv.size(0), Hkv = kv_cache.size(4), D = kv_cache.size(5), Hq = num_heads;
  TORCH_CHECK(Hq > 0 && D % 2 == 0, "cpu_rope: need num_heads > 0 and an even head size");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (Hq + 2 * Hkv) * D && qkv.stride(1) == 1,
              "cpu_rope: qkv must be [T, (Hq + 2·Hkv)·D] with unit inner stride");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) == D &&
              cos.is_contiguous() && sin.is_contiguous(), "cpu_rope: rope tables [max_pos, D]");
  TORCH_CHECK(q_out.dim() == 2 && q_out.size(0) == T && q_out.size(1) == Hq * D &&
              q_out.stride(1) == 1, "cpu_rope: q_out must be [T, Hq·D] with unit inner stride");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
              positions.is_contiguous() && slot_mapping.is_contiguous() &&
              positions.numel() == T && slot_mapping.numel() == T,
              "cpu_rope: positions and slot_mapping must be contiguous int64 [T]");
  TORCH_CHECK(0 <= layer && layer < kv_cache.size(1), "cpu_rope: layer out of range");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t slots_total = kv_cache.size(0) * kv_cache.size(3);
  for (int64_t t = 0; t < T; ++t) {  // every index this call follows, before any write
    TORCH_CHECK(0 <= pos[t] && pos[t] < cos.size(0), "cpu_rope: position past the rope table");
    TORCH_CHECK(slots[t] < slots_total, "cpu_rope: slot past the cache");
  }
  const bool simd = baton::use_avx512(isa, "cpu_rope") && D % 32 == 0;
  if (dtype == at::kFloat)
    launch<float>(qkv, cos, sin, pos, kv_cache, layer, slots, Hq, q_out, simd);
  else
    launch<baton::bf16>(qkv, cos, sin, pos, kv_cache, layer, slots, Hq, q_out, simd);
}

void register_cpu_rope(pybind11::module& m) {
  m.def("rope_write_out", &rope_write_out, BATON_RELEASE_GIL,
        "rotary + KV-cache write of a step's rows, fp32/bf16 CPU (kernels/cpu_rope.py)");
}
