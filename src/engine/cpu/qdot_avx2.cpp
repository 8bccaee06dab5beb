// AVX2 integer path (kernel_set.h): each 32-element weight block is unpacked to 32 int8 levels
// in one register, multiplied with the token's int8 activations by maddubs (u8 x s8 pairs, no
// saturation: |q| <= 128 and |xq| <= 127) and madd (pairs of pairs, times the int16 sub-scale
// for the formats that have one per 16 elements), which gives exactly the int32 lane sums S_j of
// the reference; the f32 steps are the reference's, lane by lane. Compiled with -mavx2 -mfma -mf16c (src/engine/CMakeLists.txt); runs
// only when cpu_has_avx2_kernels() is true.
#include "kernel_set.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cstring>

#include "cleave/model/quants.h"
#include "qdot_simd.h"

namespace cleave::cpu::detail {
namespace {

// maddubs + madd: int32 lane j = sum over k < 4 of a[4j+k] * b[4j+k]. `a` is the unsigned
// operand.
struct Avx2Dot {
  // 2 x 4 tiles: 8 accumulators of 16 ymm registers, and the eight lanes of tile_tab's scale
  // tables (measured faster than 2 x 3 for the legacy formats).
  static constexpr int kRows = 2, kTokens = 4;
  // The K-quants (simd::tile_k): 2 x 4, measured against 2 x 3, 3 x 3, 1 x 6 and 4 x 2 (the
  // best or level with it for Q4_K, Q5_K, Q6_K and Q2_K; 8 accumulators and 4 token vectors).
  static constexpr int kRowsK = 2, kTokensK = 4;
  // The legacy formats' decode: the rows in 4 runs read side by side (decode_runs, dot_simd.h):
  // kernel_bench --tokens 1 --threads 1, GB/s on 576x1536 and 2048x2048, one row at a time ->
  // 4 runs: Q4_1 8-12 -> 10-16, Q8_0 15-22 -> 22-26, Q4_0 9-12 -> 9-14, Q5_1 9-11 -> 14. The
  // K-quants, whose one-row tile splits its chain four ways, measured 0-30% slower in runs.
  static constexpr int kDecodeRuns = 4;
  static constexpr bool kFusedAcc = false;
  static constexpr bool kRowPairs = false;  // no 512-bit vectors
  static constexpr bool kWideK = false;
  static inline __m256i dot(__m256i a_u8, __m256i b_s8) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a_u8, b_s8), _mm256_set1_epi16(1));
  }
  static inline __m256i bit_bytes(uint32_t bits, int v) {
    return _mm256_and_si256(simd::bits_to_bytes(bits), simd::mask8(v));
  }
  // acc + the int32 lane sums of the int16 pairs of a times b (madd, exact here).
  static inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
  }
};

}  // namespace

void quantize_acts_avx2(const float* x, int64_t x_stride, int64_t n_tokens, int64_t n,
                        int64_t group, int8_t* q, float* d, int16_t* sum16, float* sum32) {
  simd::quantize_acts(x, x_stride, n_tokens, n, group, q, d, sum16, sum32);
}

void qdot_avx2(DType t, const std::byte* w, uint64_t row_bytes, int64_t nr, const QuantActs& x,
               int64_t nt, float* y, int64_t y_stride) {
  simd::qdot<Avx2Dot>(t, w, row_bytes, nr, x, nt, y, y_stride);
}

}  // namespace cleave::cpu::detail

#endif
