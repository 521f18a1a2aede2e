// The next work item's K/V lines asked into L2 a few at a time while this item computes, for
// cpu_decode.cpp's attention (shared with scores_bf16.h's loops, which call `advance`).
//
// A decode step's K/V is cold: the GEMVs between two visits of a layer stream megabytes of
// weights. Asking for the whole next item's context in one burst (thousands of PREFETCHT1)
// stalls the thread until most of it has arrived (a prefetch that finds no free fill buffer
// waits for one), so the burst and the compute ran one after the other. Spread over the
// current item's positions (`per_pos` line pairs per position visited, by the score pass and
// the p·v pass alike), the requests overlap its compute. Measured on the 2-core AMX Xeon, bf16,
// SmolLM2-135M's heads, 8 rows of 306 positions, a 30-layer cache and ~10 MB of weights read
// between two layers' calls: 194-198 -> 143-150 µs a layer on two threads, 357-363 -> 252-258
// on one; an offline 8-row decode step 19.7-19.9 -> 17.8-18.0 ms (BENCHMARKS.md, fifteenth
// pass). Prefetches change no result: only timing.
//
// KvPacer: a cursor over one item's lines (position by position, `span` bytes of each K row and the
// same of its V row). cache: the pool's bytes; table: the token's block ids (int32); block_bytes:
// bytes of one block id (all layers); layer_off: this layer's K within a block; head_off: the
// item's first head within a row; N: context positions; BS: block size; row_bytes: one position's K
// row (all heads); vstride: K row to V row. start(calls): per_pos for `calls` advance-per-position
// calls; finish(): the rest.
#pragma once
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace baton {

struct KvPacer {
  // the context being asked for: position n's K row at cache + table[n / BS]·block_bytes +
  // layer_off + (n % BS)·row_bytes + head_off, its V row vstride bytes further; `span` bytes
  // of each (the item's heads)
  const char* cache = nullptr;
  const int32_t* table = nullptr;  // the token's block ids
  int64_t block_bytes = 0, layer_off = 0, head_off = 0;  // per block id; this layer's K; heads
  int64_t N = 0, BS = 1, row_bytes = 0, span = 0, vstride = 0;
  int64_t per_pos = 0;  // line pairs to ask for per position of the current item
  // cursor: position n of the context, byte offset within its row span
  int64_t n = 0, off = 0;
  const char* k = nullptr;  // this position's K row (+ head_off)

  void start(int64_t calls) {
    n = 0, off = 0, k = nullptr;
    const int64_t pairs = N * ((span + 63) / 64);
    per_pos = calls > 0 ? (pairs + calls - 1) / calls : pairs;
  }

  // Up to `pairs` more (K line, V line) pairs, in position order.
  inline void advance(int64_t pairs) {
#if defined(__x86_64__) || defined(_M_X64)
    for (; pairs > 0 && n < N; --pairs) {
      if (off == 0)
        k = cache + table[n / BS] * block_bytes + layer_off + (n % BS) * row_bytes + head_off;
      _mm_prefetch(k + off, _MM_HINT_T1);
      _mm_prefetch(k + vstride + off, _MM_HINT_T1);
      off += 64;
      if (off >= span) off = 0, ++n;
    }
#else
    (void)pairs;
#endif
  }

  void finish() { advance(INT64_MAX); }
};

}  // namespace baton
