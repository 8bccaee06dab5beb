// Test builds only (CLEAVE_AVX512_EMULATED, tests/avx512_emulated.cmake): the AVX-512 and VNNI
// intrinsics of dot_avx512.cpp and qdot_avx512.cpp through SIMDe (libsimde-dev), which computes
// them lane by lane with the host's AVX2, FMA and F16C, so that the AVX-512 kernel sets run,
// and are checked against the other sets, on hosts without AVX-512. The production build never
// includes this header; it compiles those files for AVX-512 through target pragmas.
#pragma once

#if !defined(CLEAVE_AVX512_EMULATED)
#error "avx512_emulated.h is for the emulated test build only"
#endif

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

// SIMDe 0.7.4 has simde_mm512_shuffle_f32x4 but no alias for it.
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4(a, b, imm8) simde_mm512_shuffle_f32x4(a, b, imm8)

// The conversions SIMDe 0.7.4 lacks, lane by lane on two 256-bit halves (the same rounding as
// the 512-bit instructions: nearest-even under the default MXCSR, exact widenings).
namespace cleave::cpu::detail::emulated {

inline simde__m512 join(__m256 lo, __m256 hi) {
  float f[16];
  _mm256_storeu_ps(f, lo);
  _mm256_storeu_ps(f + 8, hi);
  return simde_mm512_loadu_ps(f);
}
inline simde__m512i join(__m256i lo, __m256i hi) {
  int32_t v[16];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(v), lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + 8), hi);
  return simde_mm512_loadu_si512(v);
}
inline void split(simde__m256i a, __m128i& lo, __m128i& hi) {
  alignas(32) uint8_t b[32];
  simde_mm256_storeu_si256(reinterpret_cast<simde__m256i*>(b), a);
  lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16));
}
inline simde__m512 cvtph_ps(simde__m256i h) {
  __m128i lo, hi;
  split(h, lo, hi);
  return join(_mm256_cvtph_ps(lo), _mm256_cvtph_ps(hi));
}
inline simde__m512i cvtepu16_epi32(simde__m256i h) {
  __m128i lo, hi;
  split(h, lo, hi);
  return join(_mm256_cvtepu16_epi32(lo), _mm256_cvtepu16_epi32(hi));
}
inline simde__m512 cvtepi32_ps(simde__m512i a) {
  int32_t v[16];
  simde_mm512_storeu_si512(v, a);
  return join(_mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v))),
              _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 8))));
}
inline simde__m512i cvtps_epi32(simde__m512 a) {
  float f[16];
  simde_mm512_storeu_ps(f, a);
  return join(_mm256_cvtps_epi32(_mm256_loadu_ps(f)), _mm256_cvtps_epi32(_mm256_loadu_ps(f + 8)));
}

}  // namespace cleave::cpu::detail::emulated

#undef _mm512_cvtph_ps
#undef _mm512_cvtepu16_epi32
#undef _mm512_cvtepi32_ps
#undef _mm512_cvtps_epi32
#define _mm512_cvtph_ps(h) ::cleave::cpu::detail::emulated::cvtph_ps(h)
#define _mm512_cvtepu16_epi32(h) ::cleave::cpu::detail::emulated::cvtepu16_epi32(h)
#define _mm512_cvtepi32_ps(a) ::cleave::cpu::detail::emulated::cvtepi32_ps(a)
#define _mm512_cvtps_epi32(a) ::cleave::cpu::detail::emulated::cvtps_epi32(a)
