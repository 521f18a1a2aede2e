// Run-time ISA choice of the fused CPU decode ops, shared by cpu_decode.cpp and cpu_norm.cpp.
// isa: 0 = best the CPU supports, 1 = scalar, 3 = AVX-512F (tests force each).
#pragma once
#include <torch/extension.h>

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#define BATON_X86 1
#endif

namespace baton {

// True when the AVX-512F variant of `op` should run; raises when `isa` asks for one this CPU
// (or this architecture) lacks.
inline bool use_avx512(int64_t isa, const char* op) {
#ifdef BATON_X86
  static const bool has512 = __builtin_cpu_supports("avx512f");
  TORCH_CHECK(isa != 3 || has512, op, ": this CPU has no AVX-512F");
  return isa == 3 || (isa == 0 && has512);
#else
  TORCH_CHECK(isa <= 1, op, ": SIMD variants exist only on x86-64");
  return false;
#endif
}

}  // namespace baton
