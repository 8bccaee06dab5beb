// Internal: the 8-lane pieces of the f32-path reduction order (kernel_set.h) that the AVX2 and
// AVX-512 sets share: the weight loaders of 8 elements, the fixed horizontal sum, the epilogue
// of one (row, token) pair and the 8-pair reduction of the multi-token matmul; and the decode
// row schedule that both paths' matrix-vector products use (decode_runs). Included by
// dot_avx2.cpp and dot_avx512.cpp under their own target flags; everything here has internal
// linkage (as vec_simd.h), so each includer gets code for its own instruction set. Both compute
// the same IEEE operations in the same order, which is why the two sets give the same bits.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernel_set.h"

namespace cleave::cpu::detail {
namespace {

inline uint16_t load_u16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// load8(row, i): elements [i, i + 8) of a row, widened exactly to f32; load1: element i.
struct F32Weights {
  static constexpr int64_t kBytesPer8 = 32;
  static inline __m256 load8(const std::byte* row, int64_t i) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  }
  static inline float load1(const std::byte* row, int64_t i) {
    float v;
    std::memcpy(&v, row + i * 4, 4);
    return v;
  }
};

struct F16Weights {
  static constexpr int64_t kBytesPer8 = 16;
  static inline __m256 load8(const std::byte* row, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i * 2)));
  }
  static inline float load1(const std::byte* row, int64_t i) {
    return _cvtsh_ss(load_u16(row + i * 2));
  }
};

struct BF16Weights {
  static constexpr int64_t kBytesPer8 = 16;
  static inline __m256 load8(const std::byte* row, int64_t i) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i * 2));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline float load1(const std::byte* row, int64_t i) {
    return bf16_to_f32(load_u16(row + i * 2));
  }
};

// The fixed horizontal sum of one accumulator: lane i + lane i + 4, then i + 2, then i + 1.
inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}

// One pair's result from its accumulator over the 8-element chunks of [0, i): the horizontal
// sum, then the elements of [i, n) (fewer than 8) one fused multiply-add each, in order.
template <typename W>
inline float finish_pair(__m256 a, const std::byte* row, const float* x, int64_t i, int64_t n) {
  float s = hsum(a);
  for (int64_t j = i; j < n; ++j) s = std::fma(W::load1(row, j), x[j], s);
  return s;
}

// dot(row, x) of one pair alone: the chain of 8-lane fused multiply-adds, then finish_pair.
template <typename W>
inline float dot_one(const std::byte* row, const float* x, int64_t n) {
  __m256 a = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) a = _mm256_fmadd_ps(W::load8(row, i), _mm256_loadu_ps(x + i), a);
  return finish_pair<W>(a, row, x, i, n);
}

// Lane j: hsum() of the accumulator at acc + j * stride: the same additions of the same lanes,
// for eight accumulators at once by transposing as the tree narrows.
inline __m256 hsum8(const float* acc, int64_t stride) {
  __m256 v[8];
  for (int j = 0; j < 8; ++j) v[j] = _mm256_loadu_ps(acc + j * stride);
  __m256 h[4];  // h[j] = [4 sums of accumulator j | 4 sums of accumulator j + 4]
  for (int j = 0; j < 4; ++j)
    h[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[j], v[j + 4], 0x20),
                         _mm256_permute2f128_ps(v[j], v[j + 4], 0x31));
  // g0 = [2 sums of accumulators 0, 1 | of 4, 5], g1 = [of 2, 3 | of 6, 7]
  const __m256 g0 = _mm256_add_ps(_mm256_shuffle_ps(h[0], h[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(h[0], h[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 g1 = _mm256_add_ps(_mm256_shuffle_ps(h[2], h[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(h[2], h[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(g0, g1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(g0, g1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// A matrix-vector product (one token) over nr rows: the rows cut into S equal runs, and row j
// of every run computed together by tile<S>(row j, the runs' distance, out) (S rows that
// distance apart; out[s] is run s's row j); the leftover rows by tile<1> one at a time. Each
// run is one long sequential stream, which the hardware prefetcher follows, and the S rows'
// accumulator chains hide each other's latency. A row's result does not depend on which rows
// share its tile. S = 1: one row at a time, in order.
template <int S, class Tile>
inline void decode_runs(const std::byte* w, uint64_t row_bytes, int64_t nr, float* y,
                        Tile&& tile) {
  const int64_t run = nr / S;
  const uint64_t apart = static_cast<uint64_t>(run) * row_bytes;
  if constexpr (S > 1) {
    for (int64_t j = 0; j < run; ++j) {
      float out[S];
      tile.template operator()<S>(w + static_cast<uint64_t>(j) * row_bytes, apart, out);
      for (int s = 0; s < S; ++s) y[j + s * run] = out[s];
    }
  }
  for (int64_t r = S > 1 ? S * run : 0; r < nr; ++r)
    tile.template operator()<1>(w + static_cast<uint64_t>(r) * row_bytes, row_bytes, y + r);
}

}  // namespace
}  // namespace cleave::cpu::detail
