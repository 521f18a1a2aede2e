// Intel AMX on CPU (Linux) for the native ops (prefill_amx.h): whether it may be used, and the
// tile configuration they load.
//
// References: Intel SDM vol. 1 ch. 18 ("Programming with Intel AMX") and vol. 2 (TILELOADD,
// TDPBF16PS); Linux Documentation/arch/x86/xstate.rst (ARCH_REQ_XCOMP_PERM).
#pragma once
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#define BATON_AMX_TARGET \
  __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl,amx-tile,amx-bf16")))

namespace baton_amx {

// Whether this CPU has AMX-TILE and AMX-BF16 (CPUID.7.0:EDX[24, 22]) and the AVX-512 subsets
// BATON_AMX_TARGET compiles for (F, BF16, BW, VL), the OS saves tile state (XCR0 bits 17, 18),
// and Linux lets this process use tile data (arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA)). Decided once per process; the one check of every AMX op (the Python
// side asks it through the extension's `has_amx`).
inline bool usable() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16") ||
        !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl"))
      return false;
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 24) & 1) || !((d >> 22) & 1)) return false;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (!((c >> 27) & 1)) return false;  // OSXSAVE: xgetbv is available
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

// Palette 1, tiles 0-7 all 16 rows × 64 bytes (16 fp32, or 16 bf16 pairs, a row).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Loads TileConfig for this thread and releases the tiles when the scope ends (tile state is
// per thread; oneDNN's GEMMs load their own configuration).
struct TileScope {
  BATON_AMX_TARGET TileScope() {
    static const TileConfig config;
    _tile_loadconfig(&config);
  }
  BATON_AMX_TARGET ~TileScope() { _tile_release(); }
};

}  // namespace baton_amx
#endif
