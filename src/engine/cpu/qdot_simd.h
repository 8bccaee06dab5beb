// Internal: the integer path's SIMD body, shared by qdot_avx2.cpp and qdot_avx512.cpp, which
// include it with their own target flags and their own `Dot` (how 32 u8 x s8 products become the
// eight int32 lane sums). Everything here has internal linkage, so each includer gets code for
// its own instruction set. The arithmetic is the reference's (kernel_set.h), lane by lane.
//
// Per format, a traits struct describes a "unit" of blocks that share their scale storage (one
// 32-element block for the legacy formats, a 256-element super-block of eight for the K-quants):
//   scales(unit, Scales&)  the float multipliers and integer sub-scales of each block of the unit
//   levels(unit, jb)       the 32 int8 levels of block jb, in element order
#pragma once

#include <immintrin.h>

#include <cstring>

#include "cleave/model/quants.h"
#include "kernel_set.h"

namespace cleave::cpu::detail::simd {
namespace {

inline uint16_t load_u16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline float f16(const std::byte* p) { return _cvtsh_ss(load_u16(p)); }
inline __m256i load256(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline __m256i srl16(__m256i v, int s) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(s)); }
inline __m256i mask8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }

// Byte j of the result is 0xFF when bit j of `bits` is set, else 0.
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                         0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// Two nibbles per byte, 16 bytes: elements 0-15 from the low nibbles, 16-31 from the high ones.
inline __m256i nibbles32(const std::byte* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
  return _mm256_setr_m128i(lo, hi);
}

struct Scales {
  float d[8];
  float m[8];
  int16_t sc[8][2];
  int16_t mn[8][2];
};

// --- legacy formats: one block a unit, no sub-scales -------------------------------------------

struct Q4_0 {
  static constexpr int kBlocks = 1, kBytes = sizeof(BlockQ4_0);
  static constexpr bool kSigned = true, kMin = false, kSubScales = false;
  static inline void scales(const std::byte* u, Scales& s) { s.d[0] = f16(u); }
  static inline __m256i levels(const std::byte* u, int) {
    return _mm256_sub_epi8(nibbles32(u + 2), mask8(8));
  }
};
struct Q4_1 {
  static constexpr int kBlocks = 1, kBytes = sizeof(BlockQ4_1);
  static constexpr bool kSigned = false, kMin = true, kSubScales = false;
  static inline void scales(const std::byte* u, Scales& s) {
    s.d[0] = f16(u);
    s.m[0] = f16(u + 2);
    s.mn[0][0] = s.mn[0][1] = 1;
  }
  static inline __m256i levels(const std::byte* u, int) { return nibbles32(u + 4); }
};
inline __m256i fifth_bits(const std::byte* qh) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  return _mm256_and_si256(bits_to_bytes(h), mask8(0x10));
}
struct Q5_0 {
  static constexpr int kBlocks = 1, kBytes = sizeof(BlockQ5_0);
  static constexpr bool kSigned = true, kMin = false, kSubScales = false;
  static inline void scales(const std::byte* u, Scales& s) { s.d[0] = f16(u); }
  static inline __m256i levels(const std::byte* u, int) {
    return _mm256_sub_epi8(_mm256_or_si256(nibbles32(u + 6), fifth_bits(u + 2)), mask8(16));
  }
};
struct Q5_1 {
  static constexpr int kBlocks = 1, kBytes = sizeof(BlockQ5_1);
  static constexpr bool kSigned = false, kMin = true, kSubScales = false;
  static inline void scales(const std::byte* u, Scales& s) {
    s.d[0] = f16(u);
    s.m[0] = f16(u + 2);
    s.mn[0][0] = s.mn[0][1] = 1;
  }
  static inline __m256i levels(const std::byte* u, int) {
    return _mm256_or_si256(nibbles32(u + 8), fifth_bits(u + 4));
  }
};
struct Q8_0 {
  static constexpr int kBlocks = 1, kBytes = sizeof(BlockQ8_0);
  static constexpr bool kSigned = true, kMin = false, kSubScales = false;
  static inline void scales(const std::byte* u, Scales& s) { s.d[0] = f16(u); }
  static inline __m256i levels(const std::byte* u, int) { return load256(u + 2); }
};

// --- K-quants: a 256-element super-block a unit -------------------------------------------------

struct Q2_K {  // scales[16] @0, qs[64] @16, d @80, dmin @82
  static constexpr int kBlocks = 8, kBytes = sizeof(BlockQ2_K);
  static constexpr bool kSigned = false, kMin = true, kSubScales = true;
  static inline void scales(const std::byte* u, Scales& s) {
    const float d = f16(u + 80), dmin = -f16(u + 82);
    for (int jb = 0; jb < 8; ++jb) {
      s.d[jb] = d;
      s.m[jb] = dmin;
      for (int h = 0; h < 2; ++h) {
        const auto v = static_cast<uint8_t>(u[2 * jb + h]);
        s.sc[jb][h] = static_cast<int16_t>(v & 0x0F);
        s.mn[jb][h] = static_cast<int16_t>(v >> 4);
      }
    }
  }
  static inline __m256i levels(const std::byte* u, int jb) {
    return _mm256_and_si256(srl16(load256(u + 16 + 32 * (jb / 4)), 2 * (jb % 4)), mask8(3));
  }
};
struct Q3_K {  // hmask[32] @0, qs[64] @32, scales[12] @96, d @108
  static constexpr int kBlocks = 8, kBytes = sizeof(BlockQ3_K);
  static constexpr bool kSigned = true, kMin = false, kSubScales = true;
  static inline void scales(const std::byte* u, Scales& s) {
    const auto* sc = reinterpret_cast<const uint8_t*>(u + 96);
    const float d = f16(u + 108);
    for (int jb = 0; jb < 8; ++jb) {
      s.d[jb] = d;
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * jb + h;
        const int low = j < 8 ? sc[j] & 0x0F : sc[j - 8] >> 4;
        const int high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
        s.sc[jb][h] = static_cast<int16_t>((low | (high << 4)) - 32);
      }
    }
  }
  static inline __m256i levels(const std::byte* u, int jb) {
    const __m256i low =
        _mm256_and_si256(srl16(load256(u + 32 + 32 * (jb / 4)), 2 * (jb % 4)), mask8(3));
    const __m256i high = _mm256_and_si256(srl16(load256(u), jb), mask8(1));
    return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 2)), mask8(4));
  }
};
// Q4_K and Q5_K: d @0, dmin @2, scales[12] @4 (as ggml's get_scale_min_k4).
inline void scales_k4(const std::byte* u, Scales& s) {
  const auto* q = reinterpret_cast<const uint8_t*>(u + 4);
  const float d = f16(u), dmin = -f16(u + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    if (j < 4) {
      sc = q[j] & 63;
      m = q[j + 4] & 63;
    } else {
      sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
      m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
    s.d[j] = d;
    s.m[j] = dmin;
    s.sc[j][0] = s.sc[j][1] = static_cast<int16_t>(sc);
    s.mn[j][0] = s.mn[j][1] = static_cast<int16_t>(m);
  }
}
struct Q4_K {  // qs[128] @16
  static constexpr int kBlocks = 8, kBytes = sizeof(BlockQ4_K);
  static constexpr bool kSigned = false, kMin = true, kSubScales = true;
  static inline void scales(const std::byte* u, Scales& s) { scales_k4(u, s); }
  static inline __m256i levels(const std::byte* u, int jb) {
    return _mm256_and_si256(srl16(load256(u + 16 + 32 * (jb / 2)), 4 * (jb % 2)), mask8(0x0F));
  }
};
struct Q5_K {  // qh[32] @16, qs[128] @48
  static constexpr int kBlocks = 8, kBytes = sizeof(BlockQ5_K);
  static constexpr bool kSigned = false, kMin = true, kSubScales = true;
  static inline void scales(const std::byte* u, Scales& s) { scales_k4(u, s); }
  static inline __m256i levels(const std::byte* u, int jb) {
    const __m256i low =
        _mm256_and_si256(srl16(load256(u + 48 + 32 * (jb / 2)), 4 * (jb % 2)), mask8(0x0F));
    const __m256i high = _mm256_and_si256(srl16(load256(u + 16), jb), mask8(1));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
  }
};
struct Q6_K {  // ql[128] @0, qh[64] @128, scales[16] @192, d @208
  static constexpr int kBlocks = 8, kBytes = sizeof(BlockQ6_K);
  static constexpr bool kSigned = true, kMin = false, kSubScales = true;
  static inline void scales(const std::byte* u, Scales& s) {
    const auto* sc = reinterpret_cast<const int8_t*>(u + 192);
    const float d = f16(u + 208);
    for (int jb = 0; jb < 8; ++jb) {
      const int half = jb / 4, k = jb % 4;
      s.d[jb] = d;
      for (int h = 0; h < 2; ++h) s.sc[jb][h] = sc[8 * half + 2 * k + h];
    }
  }
  static inline __m256i levels(const std::byte* u, int jb) {
    const int half = jb / 4, k = jb % 4;
    const __m256i low = _mm256_and_si256(
        srl16(load256(u + 64 * half + 32 * (k & 1)), 4 * (k >> 1)), mask8(0x0F));
    const __m256i high =
        _mm256_and_si256(srl16(load256(u + 128 + 32 * half), 2 * k), mask8(3));
    return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), mask8(32));
  }
};

// The fixed horizontal sum of (a + b): 8 -> 4 -> 2 -> 1 lanes.
inline float hsum(__m256 a, __m256 b) {
  const __m256 v = _mm256_add_ps(a, b);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}

// int16 lanes 0-7 = a, 8-15 = b: the multipliers of madd for the first and second 16 elements.
inline __m256i sub_scales(int a, int b) {
  return _mm256_setr_m128i(_mm_set1_epi16(static_cast<int16_t>(a)),
                           _mm_set1_epi16(static_cast<int16_t>(b)));
}

// Weight blocks are streamed from memory once per decode step; prefetch this far ahead of each
// row so that enough misses stay in flight.
constexpr int64_t kPrefetchBytes = 1024;

// R rows x T tokens; tokens t0 .. t0 + T of x.
template <class Dot, class W, int R, int T>
inline void tile(const std::byte* w, uint64_t row_bytes, const QuantActs& x, int64_t t0,
                 float* y, int64_t y_stride) {
  const int64_t nb = x.n / kQK, nu = nb / W::kBlocks;
  __m256 as[R][T], am[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) as[r][t] = am[r][t] = _mm256_setzero_ps();
  for (int64_t u = 0; u < nu; ++u) {
    Scales sc[R];
    for (int r = 0; r < R; ++r) {
      const std::byte* unit = w + r * row_bytes + u * W::kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes, _MM_HINT_T0);
      if constexpr (W::kBytes > 64)
        _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes + 64, _MM_HINT_T0);
      if constexpr (W::kBytes > 128)
        _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes + 128, _MM_HINT_T0);
      W::scales(unit, sc[r]);
    }
    for (int jb = 0; jb < W::kBlocks; ++jb) {
      const int64_t b = u * W::kBlocks + jb;
      for (int r = 0; r < R; ++r) {
        const __m256i qv = W::levels(w + r * row_bytes + u * W::kBytes, jb);
        const __m256i au = W::kSigned ? _mm256_abs_epi8(qv) : qv;
        __m256i scv = _mm256_setzero_si256();
        if constexpr (W::kSubScales) scv = Dot::scales(sc[r].sc[jb][0], sc[r].sc[jb][1]);
        __m256i mnv = _mm256_setzero_si256();
        if constexpr (W::kMin) mnv = sub_scales(sc[r].mn[jb][0], sc[r].mn[jb][1]);
        for (int t = 0; t < T; ++t) {
          const int64_t tok = t0 + t;
          const __m256i xv = load256(x.q + tok * x.n + b * kQK);
          const __m256i bv = W::kSigned ? _mm256_sign_epi8(xv, qv) : xv;
          const __m256i s = W::kSubScales ? Dot::dot_scaled(au, bv, scv) : Dot::dot(au, bv);
          const float dx = x.d[tok * nb + b];
          as[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(sc[r].d[jb] * dx), _mm256_cvtepi32_ps(s),
                                     as[r][t]);
          if constexpr (W::kMin) {
            const __m256i ps = load256(x.psum + tok * (x.n / 2) + b * (kQK / 2));
            const __m256i tv = _mm256_madd_epi16(ps, mnv);
            am[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(sc[r].m[jb] * dx), _mm256_cvtepi32_ps(tv),
                                       am[r][t]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) y[t * y_stride + r] = hsum(as[r][t], am[r][t]);
}

template <class Dot, class W>
void qdot_format(const std::byte* w, uint64_t row_bytes, int64_t nr, const QuantActs& x,
                 int64_t nt, float* y, int64_t y_stride) {
  if (nt == 1) {
    int64_t r = 0;
    for (; r + 4 <= nr; r += 4) tile<Dot, W, 4, 1>(w + r * row_bytes, row_bytes, x, 0, y + r, y_stride);
    for (; r < nr; ++r) tile<Dot, W, 1, 1>(w + r * row_bytes, row_bytes, x, 0, y + r, y_stride);
    return;
  }
  for (int64_t r = 0; r < nr; r += 2) {
    const std::byte* wr = w + r * row_bytes;
    const bool pair = r + 1 < nr;
    int64_t t = 0;
    for (; t + 3 <= nt; t += 3) {
      float* yt = y + t * y_stride + r;
      if (pair) {
        tile<Dot, W, 2, 3>(wr, row_bytes, x, t, yt, y_stride);
      } else {
        tile<Dot, W, 1, 3>(wr, row_bytes, x, t, yt, y_stride);
      }
    }
    for (; t < nt; ++t) {
      float* yt = y + t * y_stride + r;
      if (pair) {
        tile<Dot, W, 2, 1>(wr, row_bytes, x, t, yt, y_stride);
      } else {
        tile<Dot, W, 1, 1>(wr, row_bytes, x, t, yt, y_stride);
      }
    }
  }
}

template <class Dot>
void qdot(DType t, const std::byte* w, uint64_t row_bytes, int64_t nr, const QuantActs& x,
          int64_t nt, float* y, int64_t y_stride) {
  switch (t) {
    case DType::kQ4_0: return qdot_format<Dot, Q4_0>(w, row_bytes, nr, x, nt, y, y_stride);
    case DType::kQ4_1: return qdot_format<Dot, Q4_1>(w, row_bytes, nr, x, nt, y, y_stride);
    case DType::kQ5_0: return qdot_format<Dot, Q5_0>(w, row_bytes, nr, x, nt, y, y_stride);
    case DType::kQ5_1: return qdot_format<Dot, Q5_1>(w, row_bytes, nr, x, nt, y, y_stride);
    case DType::kQ8_0: return qdot_format<Dot, Q8_0>(w, row_bytes, nr, x, nt, y, y_stride);
    case DType::kQ2_K: return qdot_format<Dot, Q2_K>(w, row_bytes, nr, x, nt, y, y_stride);
    case DType::kQ3_K: return qdot_format<Dot, Q3_K>(w, row_bytes, nr, x, nt, y, y_stride);
    case DType::kQ4_K: return qdot_format<Dot, Q4_K>(w, row_bytes, nr, x, nt, y, y_stride);
    case DType::kQ5_K: return qdot_format<Dot, Q5_K>(w, row_bytes, nr, x, nt, y, y_stride);
    case DType::kQ6_K: return qdot_format<Dot, Q6_K>(w, row_bytes, nr, x, nt, y, y_stride);
    default: return;
  }
}

// Activation quantisation (kernel_set.h): the same operations as quantize_acts_generic, eight
// lanes at a time. max is exact whatever the order; _mm256_cvtps_epi32 rounds half to even in
// the default rounding mode, as nearbyint does.
inline void quantize_acts(const float* x, int64_t x_stride, int64_t n_tokens, int64_t n,
                          int8_t* q, float* d, int16_t* psum) {
  const int64_t nb = n / kQK;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* xt = x + t * x_stride;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = xt + b * kQK;
      __m256 v[4];
      __m256 mx = _mm256_setzero_ps();
      for (int k = 0; k < 4; ++k) {
        v[k] = _mm256_loadu_ps(xb + 8 * k);
        mx = _mm256_max_ps(mx, _mm256_and_ps(v[k], abs_mask));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 0x55));
      const float amax = _mm_cvtss_f32(m4);
      const float db = amax / 127.0f;
      const float id = db != 0.0f ? 1.0f / db : 0.0f;
      d[t * nb + b] = db;
      const __m256 vid = _mm256_set1_ps(id);
      __m256i i32[4];
      for (int k = 0; k < 4; ++k) i32[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], vid));
      // packs work within 128-bit lanes: fix the order with one permute at the end.
      const __m256i p01 = _mm256_packs_epi32(i32[0], i32[1]);
      const __m256i p23 = _mm256_packs_epi32(i32[2], i32[3]);
      __m256i p = _mm256_packs_epi16(p01, p23);
      p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + t * n + b * kQK), p);
      const __m256i ps = _mm256_maddubs_epi16(mask8(1), p);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(psum + t * (n / 2) + b * (kQK / 2)), ps);
    }
  }
}

}  // namespace
}  // namespace cleave::cpu::detail::simd
