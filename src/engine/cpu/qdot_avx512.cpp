// AVX-512 VNNI integer path (kernel_set.h): vpdpbusd on 256-bit vectors sums the four u8 x s8
// products of each int32 lane in one instruction, the lane sums maddubs + madd give in the AVX2
// set (no saturation in either). The formats with a sub-scale per 16 elements keep the AVX2
// set's maddubs + madd, which applies the sub-scale for free. The same exact integers, then the
// same f32 steps, so this set's results equal the AVX2 set's bit for bit. Compiled for AVX-512
// VNNI through a target pragma; runs only when cpu_has_avx512_vnni() is true.
#include "kernel_set.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

// Every header with inline functions of external linkage comes before the target pragma, so
// that no AVX-512 copy of them can be the one the linker keeps for the rest of the program.
#include <immintrin.h>

#include <cstring>

#include "cleave/model/quants.h"

#if defined(__clang__)
#pragma clang attribute push(                                                        \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "qdot_simd.h"  // internal linkage only

namespace cleave::cpu::detail {
namespace {

struct VnniDot {
  static constexpr int kRows = 4, kTokens = 4, kTokensK = 4;  // 16 accumulators of 32 ymm
  static constexpr bool kFusedAcc = true;  // vpdpbusd: no intermediate saturation
  static inline __m256i dot(__m256i a_u8, __m256i b_s8) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a_u8, b_s8);
  }
  static inline __m256i dot_acc(__m256i c, __m256i a_u8, __m256i b_s8) {
    return _mm256_dpbusd_epi32(c, a_u8, b_s8);
  }
  // A mask register selects the bytes (AVX512BW/VL): two instructions for the AVX2 set's five.
  static inline __m256i bit_bytes(uint32_t bits, int v) {
    return _mm256_maskz_mov_epi8(static_cast<__mmask32>(bits), simd::mask8(v));
  }
};

}  // namespace

void qdot_avx512_vnni(DType t, const std::byte* w, uint64_t row_bytes, int64_t nr,
                      const QuantActs& x, int64_t nt, float* y, int64_t y_stride) {
  simd::qdot<VnniDot>(t, w, row_bytes, nr, x, nt, y, y_stride);
}

}  // namespace cleave::cpu::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#else

namespace cleave::cpu::detail {
void qdot_avx512_vnni(DType t, const std::byte* w, uint64_t row_bytes, int64_t nr,
                      const QuantActs& x, int64_t nt, float* y, int64_t y_stride) {
  qdot_generic(t, w, row_bytes, nr, x, nt, y, y_stride);
}
}  // namespace cleave::cpu::detail

#endif
