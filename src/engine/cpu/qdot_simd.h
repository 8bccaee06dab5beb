// Internal: the integer path's SIMD body, shared by qdot_avx2.cpp and qdot_avx512.cpp, which
// include it with their own target flags and their own `Dot` (how 32 u8 x s8 products become the
// eight int32 lane sums). Everything here has internal linkage, so each includer gets code for
// its own instruction set. The arithmetic is the reference's (kernel_set.h), lane by lane.
//
// Per format, a traits struct describes a "unit" of blocks that share their scale storage (one
// 32-element block for the legacy formats, a 256-element super-block of eight for the K-quants):
//   scales(unit, Scales&, r)  (K-quants) each block's multipliers for row r of a tile: dsc = d *
//                          sc (d for kSub16 formats, whose 16 int16 sub-scales go to sc16[r] in
//                          element order), m and mn
//   levels(unit, jb)       the 32 levels of block jb in element order, as int8
//   ulevels(unit, jb)      the same as unsigned bytes: level + kOffset for the signed formats
//                          (the offset form; levels is then ulevels - kOffset)
// Each format has the ones its kernels call: the unsigned legacy formats ulevels, the unsigned
// K-quants levels, the signed formats both. The legacy formats' take the unit alone (one block)
// and the Dot that unpacks their fifth bits: ulevels<Dot>(unit), levels<Dot>(unit).
// `Dot` supplies dot(a_u8, b_s8) (the eight int32 lane sums), bit_bytes(bits, v) (byte j = v
// where bit j of bits is set, else 0) and kFusedAcc; where that is true, also dot_acc(c, a_u8,
// b_s8) = c + dot in one instruction, exact for any unsigned a.
#pragma once

#include <immintrin.h>

#include <cstring>
#include <vector>

#include "cleave/model/quants.h"
#include "kernel_set.h"

namespace cleave::cpu::detail::simd {
namespace {

inline uint16_t load_u16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline uint32_t load_u32(const std::byte* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
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

// Two nibbles per byte, 16 bytes: elements 0-15 from the low nibbles, 16-31 from the high ones
// (the 16 bytes in both halves, the upper half shifted right by 4: a load and two operations).
inline __m256i nibbles32(const std::byte* qs) {
  const __m256i v =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4)), mask8(0x0F));
}

// A K-quant unit's multipliers for the (up to four) rows of a tile, each block's values of
// every row side by side, so that one vector operation scales all rows for a token.
struct Scales {
  alignas(16) float dsc[8][4];
  alignas(16) float m[8][4];
  alignas(16) float mnf[8][4];  // float(mn), the same for both halves (not Q2_K)
  int mn[8][4][2];              // Q2_K: the mins of both halves
  __m256i sc16[4];  // kSub16 formats: sub-scale i (of elements [16 i, 16 i + 16)) in int16 lane i
};

// One row's multipliers for a K-quant unit, block jb in lane jb (tile_k1): the same values as
// Scales holds, vector by vector.
struct UnitVec {
  __m256 dsc;    // d * sc (d for the kSub16 formats)
  __m256 m;      // with a min: m, the same in every lane
  __m256 mnf;    // Q4_K, Q5_K: float(mn)
  __m256i sc16;  // kSub16: the 16 int16 sub-scales in element order
  __m256i mn16;  // Q2_K: the 16 int16 mins in element order
};

// --- legacy formats: one block a unit, no sub-scales -------------------------------------------

struct Q4_0 {
  static constexpr int kBlocks = 1, kBytes = sizeof(BlockQ4_0), kOffset = 8;
  static constexpr bool kSigned = true, kMin = false, kSub16 = false;
  template <class Dot>
  static inline __m256i ulevels(const std::byte* u) { return nibbles32(u + 2); }
  template <class Dot>
  static inline __m256i levels(const std::byte* u) {
    return _mm256_sub_epi8(ulevels<Dot>(u), mask8(kOffset));
  }
};
struct Q4_1 {
  static constexpr int kBlocks = 1, kBytes = sizeof(BlockQ4_1);
  static constexpr bool kSigned = false, kMin = true, kSub16 = false;
  template <class Dot>
  static inline __m256i ulevels(const std::byte* u) { return nibbles32(u + 4); }
};
struct Q5_0 {
  static constexpr int kBlocks = 1, kBytes = sizeof(BlockQ5_0), kOffset = 16;
  static constexpr bool kSigned = true, kMin = false, kSub16 = false;
  template <class Dot>
  static inline __m256i ulevels(const std::byte* u) {
    return _mm256_or_si256(nibbles32(u + 6), Dot::bit_bytes(load_u32(u + 2), 0x10));
  }
  template <class Dot>
  static inline __m256i levels(const std::byte* u) {
    return _mm256_sub_epi8(ulevels<Dot>(u), mask8(kOffset));
  }
};
struct Q5_1 {
  static constexpr int kBlocks = 1, kBytes = sizeof(BlockQ5_1);
  static constexpr bool kSigned = false, kMin = true, kSub16 = false;
  template <class Dot>
  static inline __m256i ulevels(const std::byte* u) {
    return _mm256_or_si256(nibbles32(u + 8), Dot::bit_bytes(load_u32(u + 4), 0x10));
  }
};
struct Q8_0 {
  static constexpr int kBlocks = 1, kBytes = sizeof(BlockQ8_0), kOffset = 128;
  static constexpr bool kSigned = true, kMin = false, kSub16 = false;
  template <class Dot>
  static inline __m256i ulevels(const std::byte* u) {
    return _mm256_xor_si256(load256(u + 2), mask8(0x80));  // level + 128 as an unsigned byte
  }
  template <class Dot>
  static inline __m256i levels(const std::byte* u) { return load256(u + 2); }
};

// --- K-quants: a 256-element super-block a unit -------------------------------------------------

struct Q2_K {  // scales[16] @0, qs[64] @16, d @80, dmin @82
  static constexpr int kBlocks = 8, kBytes = sizeof(BlockQ2_K);
  static constexpr bool kSigned = false, kMin = true, kSub16 = true;
  static inline void scales(const std::byte* u, Scales& s, int r) {
    const float d = f16(u + 80), dmin = -f16(u + 82);
    for (int jb = 0; jb < 8; ++jb) {
      s.dsc[jb][r] = d;
      s.m[jb][r] = dmin;
      for (int h = 0; h < 2; ++h) s.mn[jb][r][h] = static_cast<uint8_t>(u[2 * jb + h]) >> 4;
    }
    s.sc16[r] = _mm256_and_si256(
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u))),
        _mm256_set1_epi16(0x0F));
  }
  static inline void unit(const std::byte* u, UnitVec& v) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u)));
    v.dsc = _mm256_set1_ps(f16(u + 80));
    v.m = _mm256_set1_ps(-f16(u + 82));
    v.sc16 = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
    v.mn16 = _mm256_srli_epi16(bytes, 4);
  }
  static inline __m256i levels(const std::byte* u, int jb) {
    return _mm256_and_si256(srl16(load256(u + 16 + 32 * (jb / 4)), 2 * (jb % 4)), mask8(3));
  }
};
struct Q3_K {  // hmask[32] @0, qs[64] @32, scales[12] @96, d @108
  static constexpr int kBlocks = 8, kBytes = sizeof(BlockQ3_K), kOffset = 4;
  static constexpr bool kSigned = true, kMin = false, kSub16 = true;
  // The 16 6-bit sub-scales, minus 32, as int16: four 32-bit words, each four scales' low
  // nibbles (bytes 0-7, low then high nibbles) with their two high bits from bytes 8-11.
  static inline __m256i sub_scales(const std::byte* u) {
    uint32_t a[3];
    std::memcpy(a, u + 96, 12);
    constexpr uint32_t k2 = 0x03030303u, k4 = 0x0f0f0f0fu;
    const uint32_t s0 = (a[0] & k4) | ((a[2] & k2) << 4);
    const uint32_t s1 = (a[1] & k4) | (((a[2] >> 2) & k2) << 4);
    const uint32_t s2 = ((a[0] >> 4) & k4) | (((a[2] >> 4) & k2) << 4);
    const uint32_t s3 = ((a[1] >> 4) & k4) | (((a[2] >> 6) & k2) << 4);
    const __m128i b = _mm_setr_epi32(static_cast<int>(s0), static_cast<int>(s1),
                                     static_cast<int>(s2), static_cast<int>(s3));
    return _mm256_sub_epi16(_mm256_cvtepu8_epi16(b), _mm256_set1_epi16(32));
  }
  static inline void scales(const std::byte* u, Scales& s, int r) {
    const float d = f16(u + 108);
    for (int jb = 0; jb < 8; ++jb) s.dsc[jb][r] = d;
    s.sc16[r] = sub_scales(u);
  }
  static inline void unit(const std::byte* u, UnitVec& v) {
    v.dsc = _mm256_set1_ps(f16(u + 108));
    v.sc16 = sub_scales(u);
  }
  static inline __m256i ulevels(const std::byte* u, int jb) {
    const __m256i low =
        _mm256_and_si256(srl16(load256(u + 32 + 32 * (jb / 4)), 2 * (jb % 4)), mask8(3));
    const __m256i high = _mm256_and_si256(srl16(load256(u), jb), mask8(1));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
  }
  static inline __m256i levels(const std::byte* u, int jb) {
    return _mm256_sub_epi8(ulevels(u, jb), mask8(kOffset));
  }
};
// Q4_K and Q5_K: d @0, dmin @2, scales[12] @4 (as ggml's get_scale_min_k4).
inline void scales_k4(const std::byte* u, Scales& s, int r) {
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
    s.dsc[j][r] = d * static_cast<float>(sc);
    s.m[j][r] = dmin;
    s.mnf[j][r] = static_cast<float>(m);
  }
}
// The same multipliers for one row, eight blocks at once: the 6-bit scales and mins of blocks
// 0-3 and 4-7 gathered into four 32-bit words (bytes q[0..11] as three little-endian words).
inline void unit_k4(const std::byte* u, UnitVec& v) {
  uint32_t a[3];
  std::memcpy(a, u + 4, 12);
  const uint32_t sc_lo = a[0] & 0x3f3f3f3fu, mn_lo = a[1] & 0x3f3f3f3fu;
  const uint32_t sc_hi = (a[2] & 0x0f0f0f0fu) | (((a[0] >> 6) & 0x03030303u) << 4);
  const uint32_t mn_hi = ((a[2] >> 4) & 0x0f0f0f0fu) | (((a[1] >> 6) & 0x03030303u) << 4);
  const __m128i b = _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi),
                                   static_cast<int>(mn_lo), static_cast<int>(mn_hi));
  v.dsc = _mm256_mul_ps(_mm256_set1_ps(f16(u)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
  v.m = _mm256_set1_ps(-f16(u + 2));
  v.mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
}
struct Q4_K {  // qs[128] @16
  static constexpr int kBlocks = 8, kBytes = sizeof(BlockQ4_K);
  static constexpr bool kSigned = false, kMin = true, kSub16 = false;
  static inline void scales(const std::byte* u, Scales& s, int r) { scales_k4(u, s, r); }
  static inline void unit(const std::byte* u, UnitVec& v) { unit_k4(u, v); }
  static inline __m256i levels(const std::byte* u, int jb) {
    return _mm256_and_si256(srl16(load256(u + 16 + 32 * (jb / 2)), 4 * (jb % 2)), mask8(0x0F));
  }
};
struct Q5_K {  // qh[32] @16, qs[128] @48
  static constexpr int kBlocks = 8, kBytes = sizeof(BlockQ5_K);
  static constexpr bool kSigned = false, kMin = true, kSub16 = false;
  static inline void scales(const std::byte* u, Scales& s, int r) { scales_k4(u, s, r); }
  static inline void unit(const std::byte* u, UnitVec& v) { unit_k4(u, v); }
  static inline __m256i levels(const std::byte* u, int jb) {
    const __m256i low =
        _mm256_and_si256(srl16(load256(u + 48 + 32 * (jb / 2)), 4 * (jb % 2)), mask8(0x0F));
    const __m256i high = _mm256_and_si256(srl16(load256(u + 16), jb), mask8(1));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
  }
};
struct Q6_K {  // ql[128] @0, qh[64] @128, scales[16] @192, d @208
  static constexpr int kBlocks = 8, kBytes = sizeof(BlockQ6_K), kOffset = 32;
  static constexpr bool kSigned = true, kMin = false, kSub16 = true;
  static inline void scales(const std::byte* u, Scales& s, int r) {
    const float d = f16(u + 208);
    for (int jb = 0; jb < 8; ++jb) s.dsc[jb][r] = d;
    // Block jb = 4 half + k uses scales 8 half + 2 k + {0, 1} = 2 jb + {0, 1}: element order.
    s.sc16[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 192)));
  }
  static inline void unit(const std::byte* u, UnitVec& v) {
    v.dsc = _mm256_set1_ps(f16(u + 208));
    v.sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 192)));
  }
  static inline __m256i ulevels(const std::byte* u, int jb) {
    const int half = jb / 4, k = jb % 4;
    const __m256i low = _mm256_and_si256(
        srl16(load256(u + 64 * half + 32 * (k & 1)), 4 * (k >> 1)), mask8(0x0F));
    const __m256i high =
        _mm256_and_si256(srl16(load256(u + 128 + 32 * half), 2 * k), mask8(3));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
  }
  static inline __m256i levels(const std::byte* u, int jb) {
    return _mm256_sub_epi8(ulevels(u, jb), mask8(kOffset));
  }
};

// The offset form's start value: lane j = -offset * (the sum of xq's four elements 4j .. 4j + 3),
// exact (offset <= 128, |xq| <= 127), so that dot_acc(it, level + offset, xq) is the lane sum of
// level * xq.
template <class Dot>
inline __m256i neg_offset_sums(int offset, __m256i xq) {
  return _mm256_sub_epi32(_mm256_setzero_si256(), Dot::dot(mask8(offset), xq));
}

// The fixed horizontal sum: 8 -> 4 -> 2 -> 1 lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}

// fma(a, float(i), c), converting i in a vector register (a scalar cvtsi2ss would merge into, and
// wait for, an unrelated register).
inline float fma_int(float a, int i, float c) {
  const __m128 f = _mm_cvtepi32_ps(_mm_cvtsi32_si128(i));
  return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), f, _mm_set_ss(c)));
}

// The int16 multipliers of madd for block jb of a kSub16 unit: lanes 0-7 = sub-scale 2 jb,
// lanes 8-15 = sub-scale 2 jb + 1 (dword jb of sc16 holds the pair).
inline __m256i block_sub_scales(__m256i sc16, int jb) {
  const __m256i pair = _mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(jb));
  return _mm256_shuffle_epi8(pair, _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                                    2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3));
}

// Weight blocks are streamed from memory once per decode step; prefetch this far ahead of each
// row so that enough misses stay in flight (decode reads one row at a time, so this is the
// distance ahead in one sequential stream: 2 KiB measured 0-10% faster than 1 or 4 KiB).
constexpr int64_t kPrefetchBytes = 2048;

// The legacy formats keep their f16 d at byte 0 of a block and, with a min, their f16 m at
// byte 2: the first four bytes of R <= 4 rows' blocks convert in one instruction, lane 2 r = d
// and lane 2 r + 1 = m of row r (two bytes of levels, unused, for the formats without a min).
template <int R>
inline __m256 dm_of(const std::byte* unit, uint64_t row_bytes) {
  static_assert(R >= 1 && R <= 4);
  __m128i v = _mm_cvtsi32_si128(static_cast<int>(load_u32(unit)));
  if constexpr (R > 1) v = _mm_insert_epi32(v, static_cast<int>(load_u32(unit + row_bytes)), 1);
  if constexpr (R > 2) v = _mm_insert_epi32(v, static_cast<int>(load_u32(unit + 2 * row_bytes)), 2);
  if constexpr (R > 3) v = _mm_insert_epi32(v, static_cast<int>(load_u32(unit + 3 * row_bytes)), 3);
  return _mm256_cvtph_ps(v);
}

// tile() for the legacy formats: the same f32 operations lane by lane, with the scale work done
// for all R rows together. Lane 2 r of dmx[t] is d_r * dx and lane 2 r + 1 is m_r * dx (the
// products the reference rounds); the min sum of row r runs in lane 2 r + 1 of am[t], the same
// fma(m * dx, X, am) block after block (mn = 1 here, so mn * X is X).
// Where Dot accumulates for free (VNNI) the signed formats take the offset form: S_j = sum
// (q + o) * xq - o * sum xq over the lane's four elements, the second term once per token and
// block (dot(o, xq), exact) and the first one dot_acc on the unsigned levels (q + o <= 255), so
// the exact lane sums come without a sign or abs per row and token. Elsewhere (AVX2, where the
// extra add costs what the sign saves, and 255 would saturate maddubs) the sign of q moves onto
// xq.
template <class Dot, class W, int R, int T>
inline void tile_legacy(const std::byte* w, uint64_t row_bytes, const QuantActs& x, int64_t t0,
                        float* y, int64_t y_stride) {
  constexpr bool kOffsetForm = W::kSigned && Dot::kFusedAcc;
  const int64_t nb = x.n / kQK;
  __m256 as[R][T], am[T];
  for (int t = 0; t < T; ++t) {
    am[t] = _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) as[r][t] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const std::byte* unit = w + b * W::kBytes;  // row 0's block b
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(unit + r * row_bytes) + kPrefetchBytes,
                   _MM_HINT_T0);
    }
    const __m256 dm = dm_of<R>(unit, row_bytes);
    __m256i xv[T], corr[T];
    // Through memory: the multiply-adds below broadcast their scale with a load, which keeps
    // registers for the accumulators and the vector ports for the dot products.
    alignas(32) float dmx[T][8];
    for (int t = 0; t < T; ++t) {
      xv[t] = load256(x.q + (t0 + t) * x.n + b * kQK);
      if constexpr (kOffsetForm) {
        corr[t] = neg_offset_sums<Dot>(W::kOffset, xv[t]);
      }
      const __m256 dmxt = _mm256_mul_ps(dm, _mm256_set1_ps(x.d[(t0 + t) * nb + b]));
      _mm256_store_ps(dmx[t], dmxt);
      if constexpr (W::kMin) {
        am[t] = _mm256_fmadd_ps(dmxt, _mm256_set1_ps(x.sum32[(t0 + t) * nb + b]), am[t]);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256i s[T];
      if constexpr (kOffsetForm || !W::kSigned) {
        const __m256i qu = W::template ulevels<Dot>(unit + r * row_bytes);
        for (int t = 0; t < T; ++t) {
          if constexpr (kOffsetForm) s[t] = Dot::dot_acc(corr[t], qu, xv[t]);
          else s[t] = Dot::dot(qu, xv[t]);
        }
      } else {
        const __m256i qv = W::template levels<Dot>(unit + r * row_bytes);
        const __m256i au = _mm256_abs_epi8(qv);
        for (int t = 0; t < T; ++t) s[t] = Dot::dot(au, _mm256_sign_epi8(xv[t], qv));
      }
      for (int t = 0; t < T; ++t) {
        as[r][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&dmx[t][2 * r]),
                                   _mm256_cvtepi32_ps(s[t]), as[r][t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    alignas(32) float mins[8];
    _mm256_store_ps(mins, am[t]);
    for (int r = 0; r < R; ++r) {
      const float min_sum = W::kMin ? mins[2 * r + 1] : 0.0f;
      y[t * y_stride + r] = hsum(as[r][t]) + min_sum;
    }
  }
}

// On a set without fused accumulation (AVX2), every format but Q2_K runs its multi-token tiles
// with the scale work done once per block for the whole R x T tile (R * T <= 8), from tables in
// which lane t * R + r of a block's entry belongs to row r and token t:
//   per row group (RowTabs): d (the block's d, or d * sc for the K-quants without sub-scales),
//     with a min m and, for the K-quants, mn (float(mn); the legacy formats' min term is
//     m * dx * X),
//     and for the sub-16 formats each unit's int16 sub-scales per row;
//   per token tile, built once per call: dx and, with a min, X (the block's level sum).
// A block's products d_r * dx_t are then one multiply and its min terms one fma, the same f32
// operations as tile() lane by lane. The per-token multiplies and the rows' scale decoding had
// been done once per tile: Q8_0 ran 2.5 instead of 2.9 cycles per (row, token, block) without
// them in a standalone loop on Zen 4.
template <class Dot, class W>
constexpr bool kScaleTables = !Dot::kFusedAcc && !(W::kMin && W::kSub16);

// A thread's scratch table of at least n elements, 32-byte aligned for vector loads and stores;
// its contents are whatever the last call left.
template <class E>
E* aligned_scratch(std::vector<E>& buf, int64_t n) {
  const size_t need = static_cast<size_t>(n) + 32 / sizeof(E);
  if (buf.size() < need) buf.resize(need);
  return reinterpret_cast<E*>((reinterpret_cast<uintptr_t>(buf.data()) + 31) & ~uintptr_t{31});
}

struct RowTabs {
  const float* d;
  const float* m;
  const float* mn;
  const int16_t* sc16;  // [unit][row][16], 32-byte aligned
};

template <class Dot, class W>
inline __m256i block_levels(const std::byte* unit, int jb) {
  if constexpr (W::kBlocks == 1) {
    if constexpr (W::kSigned) return W::template levels<Dot>(unit);
    else return W::template ulevels<Dot>(unit);
  } else {
    return W::levels(unit, jb);
  }
}

template <class Dot, class W, int R, int T>
inline void tile_tab(const std::byte* w, uint64_t row_bytes, const QuantActs& x, int64_t t0,
                     const RowTabs& rt, const float* xd, const float* xs, float* y,
                     int64_t y_stride) {
  static_assert(R * T <= 8 && kScaleTables<Dot, W>);
  const int64_t nu = x.n / kQK / W::kBlocks;
  __m256 as[R][T];
  __m256 am = _mm256_setzero_ps();
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) as[r][t] = _mm256_setzero_ps();
  for (int64_t u = 0; u < nu; ++u) {
    // Unrolled: the shifts and offsets of each block of a super-block become constants.
#pragma GCC unroll 8
    for (int jb = 0; jb < W::kBlocks; ++jb) {
      const int64_t b = u * W::kBlocks + jb;
      const __m256 dx = _mm256_load_ps(xd + 8 * b);
      alignas(32) float sdx[8];
      _mm256_store_ps(sdx, _mm256_mul_ps(_mm256_load_ps(rt.d + 8 * b), dx));
      if constexpr (W::kMin) {
        const __m256 xsum = _mm256_load_ps(xs + 8 * b);
        const __m256 mnx =
            W::kBlocks == 1 ? xsum : _mm256_mul_ps(_mm256_load_ps(rt.mn + 8 * b), xsum);
        am = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_load_ps(rt.m + 8 * b), dx), mnx, am);
      }
      __m256i xv[T];
      for (int t = 0; t < T; ++t) xv[t] = load256(x.q + (t0 + t) * x.n + b * kQK);
      for (int r = 0; r < R; ++r) {
        const __m256i qv = block_levels<Dot, W>(w + r * row_bytes + u * W::kBytes, jb);
        const __m256i au = W::kSigned ? _mm256_abs_epi8(qv) : qv;
        __m256i sc16 = _mm256_setzero_si256();
        if constexpr (W::kSub16) {
          sc16 = block_sub_scales(
              _mm256_load_si256(reinterpret_cast<const __m256i*>(rt.sc16 + (u * R + r) * 16)), jb);
        }
        for (int t = 0; t < T; ++t) {
          const __m256i bv = W::kSigned ? _mm256_sign_epi8(xv[t], qv) : xv[t];
          __m256i s;
          if constexpr (W::kSub16) s = _mm256_madd_epi16(_mm256_maddubs_epi16(au, bv), sc16);
          else s = Dot::dot(au, bv);
          as[r][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&sdx[t * R + r]), _mm256_cvtepi32_ps(s),
                                     as[r][t]);
        }
      }
    }
  }
  alignas(32) float mins[8];
  _mm256_store_ps(mins, am);
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r)
      y[t * y_stride + r] = hsum(as[r][t]) + (W::kMin ? mins[t * R + r] : 0.0f);
}

// R rows x T tokens; tokens t0 .. t0 + T of x. The K-quants: per block and token, one 4-lane
// product gives every row's d * sc * dx (and, with a min, m * dx, mn * X and the min sum, lane r
// for row r), the reference's roundings lane by lane; the multiply-adds take their row's scale
// with a broadcast load.
template <class Dot, class W, int R, int T>
inline void tile(const std::byte* w, uint64_t row_bytes, const QuantActs& x, int64_t t0,
                 float* y, int64_t y_stride) {
  static_assert(R <= 4);
  if constexpr (W::kBlocks == 1) {
    return tile_legacy<Dot, W, R, T>(w, row_bytes, x, t0, y, y_stride);
  } else {
    constexpr bool kQ2Min = W::kMin && W::kSub16;  // Q2_K: an integer min sum per half
    // The sub-16 formats under VNNI: the lane sum T_j = sum q * xq comes from dpbusd on the
    // unsigned levels (offset form, as in tile_legacy), and S_j = sc * T_j from one f32 product
    // with the sub-scale, exact because |sc * T_j| < 2^24 for every one of these formats (Q6_K:
    // 128 * 4 * 32 * 127 < 2^22): four operations per (row, token) for the AVX2 form's five
    // (sign, maddubs, madd with sc16, convert, fma).
    // (Q2_K, unsigned with a min, measured faster in the AVX2 form.)
    constexpr bool kFloatSub = W::kSub16 && W::kSigned && Dot::kFusedAcc;
    const int64_t nb = x.n / kQK, nu = nb / W::kBlocks;
    __m256 as[R][T];
    __m128 am[T];
    float am2[R][T];
    for (int t = 0; t < T; ++t) {
      am[t] = _mm_setzero_ps();
      for (int r = 0; r < R; ++r) {
        as[r][t] = _mm256_setzero_ps();
        am2[r][t] = 0.0f;
      }
    }
    Scales sc{};  // lanes r >= R stay zero
    alignas(32) float scf[R][16];  // kFloatSub: each row's 16 sub-scales as f32
    for (int64_t u = 0; u < nu; ++u) {
      for (int r = 0; r < R; ++r) {
        const std::byte* unit = w + r * row_bytes + u * W::kBytes;
        _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes, _MM_HINT_T0);
        if constexpr (W::kBytes > 64)
          _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes + 64, _MM_HINT_T0);
        if constexpr (W::kBytes > 128)
          _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes + 128, _MM_HINT_T0);
        W::scales(unit, sc, r);
        if constexpr (kFloatSub) {
          const __m256i v = sc.sc16[r];
          _mm256_store_ps(scf[r], _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v))));
          _mm256_store_ps(scf[r] + 8,
                          _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1))));
        }
      }
      // Unrolled: the shifts and offsets of each block of a super-block become constants.
#pragma GCC unroll 8
      for (int jb = 0; jb < W::kBlocks; ++jb) {
        const int64_t b = u * W::kBlocks + jb;
        __m256i xv[T], corr[T];
        alignas(16) float sdx[T][4];  // d * sc * dx of each row
        float dxs[T];
        for (int t = 0; t < T; ++t) {
          xv[t] = load256(x.q + (t0 + t) * x.n + b * kQK);
          if constexpr (kFloatSub) {
            corr[t] = neg_offset_sums<Dot>(W::kOffset, xv[t]);
          }
          dxs[t] = x.d[(t0 + t) * nb + b];
          const __m128 dx = _mm_set1_ps(dxs[t]);
          if constexpr (!W::kSub16 || kFloatSub)
            _mm_store_ps(sdx[t], _mm_mul_ps(_mm_load_ps(sc.dsc[jb]), dx));
          if constexpr (W::kMin && !kQ2Min) {
            // mn * X as f32: both are integers below 2^24, so the product is exact and equals
            // float(mn0 * X0 + mn1 * X1) of the reference (mn0 = mn1 here).
            const __m128 mnx =
                _mm_mul_ps(_mm_load_ps(sc.mnf[jb]), _mm_set1_ps(x.sum32[(t0 + t) * nb + b]));
            am[t] = _mm_fmadd_ps(_mm_mul_ps(_mm_load_ps(sc.m[jb]), dx), mnx, am[t]);
          }
        }
        if constexpr (kFloatSub) {
          for (int r = 0; r < R; ++r) {
            const __m256i qu = W::ulevels(w + r * row_bytes + u * W::kBytes, jb);
            // Lanes 0-3 take sub-scale 2 jb, lanes 4-7 sub-scale 2 jb + 1 (element order).
            const __m256 scv = _mm256_insertf128_ps(
                _mm256_castps128_ps256(_mm_broadcast_ss(&scf[r][2 * jb])),
                _mm_broadcast_ss(&scf[r][2 * jb + 1]), 1);
            for (int t = 0; t < T; ++t) {
              const __m256i lane_sums = Dot::dot_acc(corr[t], qu, xv[t]);
              const __m256 sj = _mm256_mul_ps(_mm256_cvtepi32_ps(lane_sums), scv);
              as[r][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&sdx[t][r]), sj, as[r][t]);
            }
          }
          continue;
        }
        for (int r = 0; r < R; ++r) {
          const __m256i qv = W::levels(w + r * row_bytes + u * W::kBytes, jb);
          const __m256i au = W::kSigned ? _mm256_abs_epi8(qv) : qv;
          __m256i sc16 = _mm256_setzero_si256();
          if constexpr (W::kSub16) sc16 = block_sub_scales(sc.sc16[r], jb);
          for (int t = 0; t < T; ++t) {
            const __m256i bv = W::kSigned ? _mm256_sign_epi8(xv[t], qv) : xv[t];
            __m256i s;
            if constexpr (W::kSub16) {
              s = _mm256_madd_epi16(_mm256_maddubs_epi16(au, bv), sc16);
            } else {
              s = Dot::dot(au, bv);
            }
            // (The sub-16 formats measured faster with the product made here.)
            const __m256 scale = W::kSub16 ? _mm256_set1_ps(sc.dsc[jb][r] * dxs[t])
                                           : _mm256_broadcast_ss(&sdx[t][r]);
            as[r][t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s), as[r][t]);
            if constexpr (kQ2Min) {
              const int16_t* xs = x.sum16 + (t0 + t) * (x.n / 16) + 2 * b;
              const int u32 = sc.mn[jb][r][0] * xs[0] + sc.mn[jb][r][1] * xs[1];
              am2[r][t] = fma_int(sc.m[jb][r] * dxs[t], u32, am2[r][t]);
            }
          }
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      alignas(16) float mins[4];
      _mm_store_ps(mins, am[t]);
      for (int r = 0; r < R; ++r) {
        const float min_sum = kQ2Min ? am2[r][t] : W::kMin ? mins[r] : 0.0f;
        y[t * y_stride + r] = hsum(as[r][t]) + min_sum;
      }
    }
  }
}

// One token against one row of a K-quant matrix (decode): tile<W, 1, 1>'s arithmetic with the
// scale work of a unit done for its eight blocks at once. One vector product gives every block's
// D = (d * sc) * dx (d * dx for the kSub16 formats) and, with a min, two give every block's
// m * dx and mn * X (exact: float(mn * X), or for Q2_K float(mn0 * X0 + mn1 * X1) from one madd
// of the int16 mins and half sums); the min sum then runs block after block as the reference's
// scalar fma chain. Each block's lane sums are tile()'s. Against tile<W, 1, 1>, kernel_bench
// --tokens 1, 1 thread, 4096x4096, AVX-512 VNNI on Zen 4: Q4_K 1557 -> 777 us, Q5_K 1569 -> 721,
// Q6_K 1318 -> 789, Q3_K 1832 -> 1052, Q2_K 886 -> 637. The `as` and `am` chains (an fma per block
// each) now bound it; two rows side by side, which would give the core two chains, ran 1.5-3x
// slower there (two streams from memory), as they do for Q8_0 (qdot_format).
template <class Dot, class W>
inline void tile_k1(const std::byte* w, const QuantActs& x, int64_t t0, float* y) {
  static_assert(W::kBlocks == 8);
  constexpr bool kQ2Min = W::kMin && W::kSub16;
  constexpr bool kFloatSub = W::kSub16 && W::kSigned && Dot::kFusedAcc;
  const int64_t nb = x.n / kQK, nu = nb / W::kBlocks;
  const int8_t* xq = x.q + t0 * x.n;
  const float* xd = x.d + t0 * nb;
  const float* xs = x.sum32 + t0 * nb;
  const int16_t* x16 = x.sum16 + t0 * (x.n / 16);
  __m256 as = _mm256_setzero_ps();
  __m128 am = _mm_setzero_ps();
  for (int64_t u = 0; u < nu; ++u) {
    const std::byte* unit = w + u * W::kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes, _MM_HINT_T0);
    if constexpr (W::kBytes > 64)
      _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes + 64, _MM_HINT_T0);
    if constexpr (W::kBytes > 128)
      _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes + 128, _MM_HINT_T0);
    UnitVec v;
    W::unit(unit, v);
    const __m256 dx = _mm256_loadu_ps(xd + u * 8);
    alignas(32) float dd[8], p1[8], p2[8];
    _mm256_store_ps(dd, _mm256_mul_ps(v.dsc, dx));
    if constexpr (W::kMin) {
      _mm256_store_ps(p1, _mm256_mul_ps(v.m, dx));
      if constexpr (kQ2Min) {
        _mm256_store_ps(p2, _mm256_cvtepi32_ps(_mm256_madd_epi16(v.mn16, load256(x16 + u * 16))));
      } else {
        _mm256_store_ps(p2, _mm256_mul_ps(v.mnf, _mm256_loadu_ps(xs + u * 8)));
      }
    }
    __m256 scf[2];  // kFloatSub: sub-scales 0-7 and 8-15 as f32
    if constexpr (kFloatSub) {
      scf[0] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v.sc16)));
      scf[1] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(v.sc16, 1)));
    }
#pragma GCC unroll 8
    for (int jb = 0; jb < W::kBlocks; ++jb) {
      const __m256i xv = load256(xq + (u * W::kBlocks + jb) * kQK);
      __m256 sf;
      if constexpr (kFloatSub) {
        // Lanes 0-3 take sub-scale 2 jb, lanes 4-7 sub-scale 2 jb + 1 (element order).
        const int k = 2 * (jb % 4);
        const __m256 scv = _mm256_permutevar8x32_ps(
            scf[jb / 4], _mm256_setr_epi32(k, k, k, k, k + 1, k + 1, k + 1, k + 1));
        const __m256i corr = neg_offset_sums<Dot>(W::kOffset, xv);
        sf = _mm256_mul_ps(_mm256_cvtepi32_ps(Dot::dot_acc(corr, W::ulevels(unit, jb), xv)), scv);
      } else {
        const __m256i qv = W::levels(unit, jb);
        __m256i s;
        if constexpr (W::kSub16) {
          const __m256i au = W::kSigned ? _mm256_abs_epi8(qv) : qv;
          const __m256i bv = W::kSigned ? _mm256_sign_epi8(xv, qv) : xv;
          s = _mm256_madd_epi16(_mm256_maddubs_epi16(au, bv), block_sub_scales(v.sc16, jb));
        } else {
          s = Dot::dot(qv, xv);
        }
        sf = _mm256_cvtepi32_ps(s);
      }
      as = _mm256_fmadd_ps(_mm256_broadcast_ss(&dd[jb]), sf, as);
      if constexpr (W::kMin) am = _mm_fmadd_ss(_mm_load_ss(&p1[jb]), _mm_load_ss(&p2[jb]), am);
    }
  }
  *y = hsum(as) + (W::kMin ? _mm_cvtss_f32(am) : 0.0f);
}

// The R x T tiles of qdot_format through tile_tab; returns the rows done (a multiple of R).
template <class Dot, class W, int R, int T>
int64_t qdot_tabled(const std::byte* w, uint64_t row_bytes, int64_t nr, const QuantActs& x,
                    int64_t nt, float* y, int64_t y_stride) {
  const int64_t nb = x.n / kQK, nu = nb / W::kBlocks, tiles = nt / T;
  // Token tables, then the row group's, each entry 8 lanes; 32-byte aligned.
  const int64_t n_tok = (W::kMin ? 2 : 1) * tiles * nb * 8, n_row = (W::kMin ? 3 : 1) * nb * 8;
  const int64_t n_sc16 = W::kSub16 ? nu * R * 8 : 0;  // 16 int16 an entry, in floats' room
  thread_local std::vector<float> buf;
  float* const xd = aligned_scratch(buf, n_tok + n_row + n_sc16);  // every lane read is written
  float* const xs = xd + tiles * nb * 8;
  float* const rd = xd + n_tok;
  float* const rm = rd + nb * 8;
  float* const rmn = rm + nb * 8;
  int16_t* const sc16 = reinterpret_cast<int16_t*>(rd + n_row);
  const RowTabs rt{rd, rm, rmn, sc16};
  // Lane t * R + r of an entry takes lane t of a per-token vector, or lane r (k r for the legacy
  // formats' dm_of, whose lanes alternate d and m) of a per-row one.
  static_assert(R * T == 8 && T <= 4);
  alignas(32) int32_t tok[8], row[8], row_d[8], row_m[8];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) {
      tok[t * R + r] = t;
      row[t * R + r] = r;
      row_d[t * R + r] = 2 * r;
      row_m[t * R + r] = 2 * r + 1;
    }
  const __m256i tok_i = _mm256_load_si256(reinterpret_cast<const __m256i*>(tok));
  const __m256i row_i = _mm256_load_si256(reinterpret_cast<const __m256i*>(row));
  const __m256i row_di = _mm256_load_si256(reinterpret_cast<const __m256i*>(row_d));
  const __m256i row_mi = _mm256_load_si256(reinterpret_cast<const __m256i*>(row_m));
  auto spread = [](const float* v4, __m256i idx) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(v4)), idx);
  };
  for (int64_t i = 0; i < tiles; ++i)
    for (int64_t b = 0; b < nb; ++b) {
      alignas(16) float d4[4] = {}, s4[4] = {};
      for (int t = 0; t < T; ++t) {
        d4[t] = x.d[(i * T + t) * nb + b];
        if constexpr (W::kMin) s4[t] = x.sum32[(i * T + t) * nb + b];
      }
      _mm256_store_ps(xd + (i * nb + b) * 8, spread(d4, tok_i));
      if constexpr (W::kMin) _mm256_store_ps(xs + (i * nb + b) * 8, spread(s4, tok_i));
    }
  int64_t r0 = 0;
  for (; r0 + R <= nr; r0 += R) {
    const std::byte* wr = w + r0 * row_bytes;
    for (int64_t u = 0; u < nu; ++u) {
      if constexpr (W::kBlocks == 1) {
        const __m256 dm = dm_of<R>(wr + u * W::kBytes, row_bytes);
        _mm256_store_ps(rd + u * 8, _mm256_permutevar8x32_ps(dm, row_di));
        if constexpr (W::kMin) _mm256_store_ps(rm + u * 8, _mm256_permutevar8x32_ps(dm, row_mi));
      } else {
        Scales sc{};
        for (int r = 0; r < R; ++r) {
          W::scales(wr + r * row_bytes + u * W::kBytes, sc, r);
          if constexpr (W::kSub16) {
            _mm256_store_si256(reinterpret_cast<__m256i*>(sc16 + (u * R + r) * 16), sc.sc16[r]);
          }
        }
        for (int jb = 0; jb < W::kBlocks; ++jb) {
          const int64_t e = (u * W::kBlocks + jb) * 8;
          _mm256_store_ps(rd + e, spread(sc.dsc[jb], row_i));
          if constexpr (W::kMin) {
            _mm256_store_ps(rm + e, spread(sc.m[jb], row_i));
            _mm256_store_ps(rmn + e, spread(sc.mnf[jb], row_i));
          }
        }
      }
    }
    int64_t t = 0;
    for (int64_t i = 0; i < tiles; ++i, t += T)
      tile_tab<Dot, W, R, T>(wr, row_bytes, x, t, rt, xd + i * nb * 8, xs + i * nb * 8,
                             y + t * y_stride + r0, y_stride);
    for (; t < nt; ++t) tile<Dot, W, R, 1>(wr, row_bytes, x, t, y + t * y_stride + r0, y_stride);
  }
  return r0;
}

// A set with row-pair tiles (VNNI: Dot::tile_legacy_pairs, tile_kquant_pairs) takes its R x T
// tiles here; returns the rows done (a multiple of R). Several tokens only: one token's blocks
// are the matrix-vector product, memory-bound, where the 256-bit tile() was measured faster
// (kernel_bench matvec, Q5_0: 26.8 against 33.6 us). A signed format's offset corrections
// (neg_offset_sums of each token and block) are made once per call into a table.
template <class Dot, class W, int R, int T>
int64_t qdot_pairs(const std::byte* w, uint64_t row_bytes, int64_t nr, const QuantActs& x,
                   int64_t nt, float* y, int64_t y_stride) {
  static_assert(R % 2 == 0 && T > 1);
  const int32_t* corr = nullptr;
  if constexpr (W::kSigned) {
    const int64_t nb = x.n / kQK;
    thread_local std::vector<int32_t> buf;
    int32_t* const c = aligned_scratch(buf, nt * nb * 8);
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t b = 0; b < nb; ++b)
        _mm256_store_si256(reinterpret_cast<__m256i*>(c + (t * nb + b) * 8),
                           neg_offset_sums<Dot>(W::kOffset, load256(x.q + t * x.n + b * kQK)));
    corr = c;
  }
  int64_t r0 = 0;
  for (; r0 + R <= nr; r0 += R) {
    const std::byte* wr = w + r0 * row_bytes;
    int64_t t = 0;
    for (; t + T <= nt; t += T) {
      if constexpr (W::kBlocks == 1)
        Dot::template tile_legacy_pairs<W, R, T>(wr, row_bytes, x, t, corr, y + t * y_stride + r0,
                                                 y_stride);
      else
        Dot::template tile_kquant_pairs<W, R, T>(wr, row_bytes, x, t, corr, y + t * y_stride + r0,
                                                 y_stride);
    }
    for (; t < nt; ++t) tile<Dot, W, R, 1>(wr, row_bytes, x, t, y + t * y_stride + r0, y_stride);
  }
  return r0;
}

// Decode (one token) reads one row at a time: a matrix's rows lie one after another, so its
// bytes are read as one sequential stream, which the hardware prefetcher follows (four rows side
// by side, four streams, measured 35-45% slower on Zen 4: SmolLM2 Q8_0 decode 115-130 against
// 199-210 tok/s; the f32/f16/bf16 kernels, with their far prefetch, showed no such gain).
// Several tokens: tiles of Dot::kRows rows x Dot::kTokens tokens (kTokensK for the K-quants; as
// many accumulators as the register file holds), through tile_tab where kScaleTables holds, each
// weight block unpacked once per tile; leftover rows and tokens in thinner tiles.
template <class Dot, class W>
void qdot_format(const std::byte* w, uint64_t row_bytes, int64_t nr, const QuantActs& x,
                 int64_t nt, float* y, int64_t y_stride) {
  if (nt == 1) {
    for (int64_t r = 0; r < nr; ++r) {
      if constexpr (W::kBlocks == 8) tile_k1<Dot, W>(w + r * row_bytes, x, 0, y + r);
      else tile<Dot, W, 1, 1>(w + r * row_bytes, row_bytes, x, 0, y + r, y_stride);
    }
    return;
  }
  constexpr int R = Dot::kRows, T = W::kBlocks == 1 ? Dot::kTokens : Dot::kTokensK;
  int64_t r = 0;
  if constexpr (kScaleTables<Dot, W>) {
    r = qdot_tabled<Dot, W, R, T>(w, row_bytes, nr, x, nt, y, y_stride);
  } else if constexpr (Dot::kRowPairs && !(W::kMin && W::kSub16)) {  // not Q2_K
    r = qdot_pairs<Dot, W, R, T>(w, row_bytes, nr, x, nt, y, y_stride);
  } else {
    for (; r + R <= nr; r += R) {
      const std::byte* wr = w + r * row_bytes;
      int64_t t = 0;
      for (; t + T <= nt; t += T)
        tile<Dot, W, R, T>(wr, row_bytes, x, t, y + t * y_stride + r, y_stride);
      for (; t < nt; ++t) tile<Dot, W, R, 1>(wr, row_bytes, x, t, y + t * y_stride + r, y_stride);
    }
  }
  for (; r < nr; ++r) {
    const std::byte* wr = w + r * row_bytes;
    int64_t t = 0;
    for (; t + T <= nt; t += T) tile<Dot, W, 1, T>(wr, row_bytes, x, t, y + t * y_stride + r, y_stride);
    for (; t < nt; ++t) tile<Dot, W, 1, 1>(wr, row_bytes, x, t, y + t * y_stride + r, y_stride);
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
                          int8_t* q, float* d, int16_t* sum16, float* sum32) {
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
      // Sums of each 16 levels: pairs (maddubs), then pairs of pairs (madd), then the two
      // 128-bit halves of eight 32-bit partial sums each.
      const __m256i p4 = _mm256_madd_epi16(_mm256_maddubs_epi16(mask8(1), p), _mm256_set1_epi16(1));
      __m128i h = _mm_add_epi32(_mm256_castsi256_si128(p4), _mm_srli_si128(_mm256_castsi256_si128(p4), 8));
      __m128i g = _mm_add_epi32(_mm256_extracti128_si256(p4, 1),
                                _mm_srli_si128(_mm256_extracti128_si256(p4, 1), 8));
      h = _mm_add_epi32(h, _mm_srli_si128(h, 4));
      g = _mm_add_epi32(g, _mm_srli_si128(g, 4));
      const int s0 = _mm_cvtsi128_si32(h), s1 = _mm_cvtsi128_si32(g);
      sum16[t * (n / 16) + 2 * b] = static_cast<int16_t>(s0);
      sum16[t * (n / 16) + 2 * b + 1] = static_cast<int16_t>(s1);
      sum32[t * nb + b] = static_cast<float>(s0 + s1);
    }
  }
}

}  // namespace
}  // namespace cleave::cpu::detail::simd
