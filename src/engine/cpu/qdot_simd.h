// Internal: the integer path's SIMD body, shared by qdot_avx2.cpp and qdot_avx512.cpp, which
// include it with their own target flags and their own `Dot` (how 32 u8 x s8 products become the
// eight int32 lane sums). Everything here has internal linkage, so each includer gets code for
// its own instruction set. The arithmetic is the reference's (kernel_set.h), lane by lane.
//
// Per format, a traits struct describes a "unit" of blocks that share their scale storage (one
// 32-element block for the legacy formats, a 256-element super-block of eight for the K-quants).
// The legacy formats (kernel_set.h's first form) give, from the unit alone and the Dot that
// unpacks their fifth bits:
//   ulevels<Dot>(unit)     the 32 levels as unsigned bytes: level + kOffset for the signed ones
//   levels<Dot>(unit)      (signed formats) the levels as int8, ulevels - kOffset
// and their d (and m) at the block's start (dm_of). The K-quants (the second form) give
//   unit(unit, UnitVec&)   d, m, the scale bytes and the int16 min of each 16 elements
//   ulevels(unit, jb)      block jb's levels as unsigned bytes, level + kOffset (0: unsigned)
// `Dot` supplies dot(a_u8, b_s8) (the eight int32 lane sums), bit_bytes(bits, v) (byte j = v
// where bit j of bits is set, else 0), madd_acc(acc, a_i16, b_i16) (acc + the int32 sums of
// the products of int16 pairs) and kFusedAcc; where that is true, also dot_acc(c, a_u8, b_s8) =
// c + dot in one instruction, exact for any unsigned a.
#pragma once

#include <immintrin.h>

#include <cstring>
#include <vector>

#include "cleave/model/quants.h"
#include "dot_simd.h"
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

// One row's multipliers for a K-quant super-block (tile_k): d and its scale bytes; with a min
// also m and each 16 elements' int16 min; with a level offset o, o times each 16 elements'
// sub-scale (int16, |o * sc| <= 2^12); all in element order.
struct UnitVec {
  float d;
  float m;
  __m256i scb;   // the scale bytes in both 128-bit halves (the format's block_scales reads them)
  __m256i mn16;
  __m256i oc16;
};
// offset times each of the 16 signed sub-scale bytes of sc, as int16.
inline __m256i offset_scales(int offset, __m128i sc) {
  return _mm256_mullo_epi16(_mm256_cvtepi8_epi16(sc),
                            _mm256_set1_epi16(static_cast<short>(offset)));
}
inline __m256i both_halves(__m128i v) { return _mm256_broadcastsi128_si256(v); }

// --- legacy formats: one block a unit, no sub-scales -------------------------------------------

struct Q4_0 {
  static constexpr int kBytes = sizeof(BlockQ4_0), kOffset = 8;
  static constexpr bool kSigned = true, kMin = false;
  template <class Dot>
  static inline __m256i ulevels(const std::byte* u) { return nibbles32(u + 2); }
  template <class Dot>
  static inline __m256i levels(const std::byte* u) {
    return _mm256_sub_epi8(ulevels<Dot>(u), mask8(kOffset));
  }
};
struct Q4_1 {
  static constexpr int kBytes = sizeof(BlockQ4_1);
  static constexpr bool kSigned = false, kMin = true;
  template <class Dot>
  static inline __m256i ulevels(const std::byte* u) { return nibbles32(u + 4); }
};
struct Q5_0 {
  static constexpr int kBytes = sizeof(BlockQ5_0), kOffset = 16;
  static constexpr bool kSigned = true, kMin = false;
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
  static constexpr int kBytes = sizeof(BlockQ5_1);
  static constexpr bool kSigned = false, kMin = true;
  template <class Dot>
  static inline __m256i ulevels(const std::byte* u) {
    return _mm256_or_si256(nibbles32(u + 8), Dot::bit_bytes(load_u32(u + 4), 0x10));
  }
};
struct Q8_0 {
  static constexpr int kBytes = sizeof(BlockQ8_0), kOffset = 128;
  static constexpr bool kSigned = true, kMin = false;
  template <class Dot>
  static inline __m256i ulevels(const std::byte* u) {
    return _mm256_xor_si256(load256(u + 2), mask8(0x80));  // level + 128 as an unsigned byte
  }
  template <class Dot>
  static inline __m256i levels(const std::byte* u) { return load256(u + 2); }
};

// --- K-quants: a 256-element super-block a unit -------------------------------------------------
// unit(u, UnitVec&) gives the super-block's multipliers; ulevels(u, jb) block jb's 32 levels as
// unsigned bytes, level + kOffset (kOffset 0 for the unsigned formats).

struct Q2_K {  // scales[16] @0, qs[64] @16, d @80, dmin @82
  static constexpr int kBytes = sizeof(BlockQ2_K), kOffset = 0;
  static constexpr bool kMin = true;
  static constexpr int kScaleStride = 2;  // a scale per 16 elements
  static constexpr bool kSignedScales = false;
  static inline void unit(const std::byte* u, UnitVec& v) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
    v.d = f16(u + 80);
    v.m = -f16(u + 82);
    v.scb = both_halves(_mm_and_si128(bytes, _mm_set1_epi8(0x0F)));
    v.mn16 = _mm256_srli_epi16(_mm256_cvtepu8_epi16(bytes), 4);
  }
  static inline __m256i ulevels(const std::byte* u, int jb) {
    return _mm256_and_si256(srl16(load256(u + 16 + 32 * (jb / 4)), 2 * (jb % 4)), mask8(3));
  }
};
struct Q3_K {  // hmask[32] @0, qs[64] @32, scales[12] @96, d @108
  static constexpr int kBytes = sizeof(BlockQ3_K), kOffset = level_offset(DType::kQ3_K);
  static constexpr int kScaleStride = 2;
  static constexpr bool kSignedScales = true;
  static constexpr bool kMin = false;
  // The 16 6-bit sub-scales, minus 32, as int8: four 32-bit words, each four scales' low
  // nibbles (bytes 0-7, low then high nibbles) with their two high bits from bytes 8-11.
  static inline void unit(const std::byte* u, UnitVec& v) {
    uint32_t a[3];
    std::memcpy(a, u + 96, 12);
    constexpr uint32_t k2 = 0x03030303u, k4 = 0x0f0f0f0fu;
    const uint32_t s0 = (a[0] & k4) | ((a[2] & k2) << 4);
    const uint32_t s1 = (a[1] & k4) | (((a[2] >> 2) & k2) << 4);
    const uint32_t s2 = ((a[0] >> 4) & k4) | (((a[2] >> 4) & k2) << 4);
    const uint32_t s3 = ((a[1] >> 4) & k4) | (((a[2] >> 6) & k2) << 4);
    const __m128i b = _mm_setr_epi32(static_cast<int>(s0), static_cast<int>(s1),
                                     static_cast<int>(s2), static_cast<int>(s3));
    const __m128i sc = _mm_sub_epi8(b, _mm_set1_epi8(32));
    v.d = f16(u + 108);
    v.scb = both_halves(sc);
    v.oc16 = offset_scales(kOffset, sc);
  }
  static inline __m256i ulevels(const std::byte* u, int jb) {
    const __m256i low =
        _mm256_and_si256(srl16(load256(u + 32 + 32 * (jb / 4)), 2 * (jb % 4)), mask8(3));
    const __m256i high = _mm256_and_si256(srl16(load256(u), jb), mask8(1));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
  }
};
// Q4_K and Q5_K: d @0, dmin @2, scales[12] @4 (as ggml's get_scale_min_k4). The 6-bit scales
// and mins of blocks 0-3 and 4-7 are gathered into four 32-bit words (bytes 4-15 as three
// little-endian words); each block's min is taken twice (its two 16-element halves).
inline void unit_k4(const std::byte* u, UnitVec& v) {
  uint32_t a[3];
  std::memcpy(a, u + 4, 12);
  const uint32_t sc_lo = a[0] & 0x3f3f3f3fu, mn_lo = a[1] & 0x3f3f3f3fu;
  const uint32_t sc_hi = (a[2] & 0x0f0f0f0fu) | (((a[0] >> 6) & 0x03030303u) << 4);
  const uint32_t mn_hi = ((a[2] >> 4) & 0x0f0f0f0fu) | (((a[1] >> 6) & 0x03030303u) << 4);
  const __m128i b = _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi),
                                   static_cast<int>(mn_lo), static_cast<int>(mn_hi));
  v.d = f16(u);
  v.m = -f16(u + 2);
  v.scb = both_halves(b);  // bytes 0-7 (the mins in 8-15 are not read as scales)
  v.mn16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(b, b));
}
struct Q4_K {  // qs[128] @16
  static constexpr int kBytes = sizeof(BlockQ4_K), kOffset = 0;
  static constexpr int kScaleStride = 1;  // a scale per 32 elements
  static constexpr bool kSignedScales = false;
  static constexpr bool kMin = true;
  static inline void unit(const std::byte* u, UnitVec& v) { unit_k4(u, v); }
  static inline __m256i ulevels(const std::byte* u, int jb) {
    return _mm256_and_si256(srl16(load256(u + 16 + 32 * (jb / 2)), 4 * (jb % 2)), mask8(0x0F));
  }
};
struct Q5_K {  // qh[32] @16, qs[128] @48
  static constexpr int kBytes = sizeof(BlockQ5_K), kOffset = 0;
  static constexpr int kScaleStride = 1;  // a scale per 32 elements
  static constexpr bool kSignedScales = false;
  static constexpr bool kMin = true;
  static inline void unit(const std::byte* u, UnitVec& v) { unit_k4(u, v); }
  static inline __m256i ulevels(const std::byte* u, int jb) {
    const __m256i low =
        _mm256_and_si256(srl16(load256(u + 48 + 32 * (jb / 2)), 4 * (jb % 2)), mask8(0x0F));
    const __m256i high = _mm256_and_si256(srl16(load256(u + 16), jb), mask8(1));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
  }
};
struct Q6_K {  // ql[128] @0, qh[64] @128, scales[16] @192, d @208
  static constexpr int kBytes = sizeof(BlockQ6_K), kOffset = level_offset(DType::kQ6_K);
  static constexpr int kScaleStride = 2;
  static constexpr bool kSignedScales = true;
  static constexpr bool kMin = false;
  static inline void unit(const std::byte* u, UnitVec& v) {
    v.d = f16(u + 208);
    // Block jb = 4 half + k uses scales 8 half + 2 k + {0, 1} = 2 jb + {0, 1}: element order.
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 192));
    v.scb = both_halves(sc);
    v.oc16 = offset_scales(kOffset, sc);
  }
  static inline __m256i ulevels(const std::byte* u, int jb) {
    const int half = jb / 4, k = jb % 4;
    const __m256i low = _mm256_and_si256(
        srl16(load256(u + 64 * half + 32 * (k & 1)), 4 * (k >> 1)), mask8(0x0F));
    const __m256i high =
        _mm256_and_si256(srl16(load256(u + 128 + 32 * half), 2 * k), mask8(3));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
  }
};

// The offset form's start value: lane j = -offset * (the sum of xq's four elements 4j .. 4j + 3),
// exact (offset <= 128, |xq| <= 127), so that dot_acc(it, level + offset, xq) is the lane sum of
// level * xq.
template <class Dot>
inline __m256i neg_offset_sums(int offset, __m256i xq) {
  return _mm256_sub_epi32(_mm256_setzero_si256(), Dot::dot(mask8(offset), xq));
}

// Keeps v in a register at this point of the program: an empty asm that the compiler must treat
// as reading and rewriting it. Without it GCC reassociates tile_k's unrolled integer sums (exact
// in any order) on the AVX2 set into a tree whose 64 partial sums per super-block go through the
// stack: Q4_K prefill at 2048 columns ran 78 instead of 94 GFLOP/s on one Zen 3 core.
inline void pin(__m256i& v) { asm("" : "+x"(v)); }

// The fixed horizontal sum (8 -> 4 -> 2 -> 1 lanes), the f32 path's (dot_simd.h).
using ::cleave::cpu::detail::hsum;
// The decode row schedule, the f32 matvec's (dot_simd.h).
using ::cleave::cpu::detail::decode_runs;

// block_scales' 32 shuffle bytes for block jb, into pick.
template <class W>
inline void scale_pick(int jb, char* pick) {
  const char lo = static_cast<char>(W::kScaleStride * jb);
  const char hi = static_cast<char>(W::kScaleStride == 1 ? jb : 2 * jb + 1);
  constexpr char z = static_cast<char>(0x80);  // pshufb: a zero byte
  // Byte 2 i + at of int16 lane i takes scale byte lo (lanes 0-7) or hi (8-15), byte 2 i + 1 - at
  // zero.
  constexpr int at = W::kSignedScales ? 1 : 0;
  for (int i = 0; i < 16; ++i) {
    pick[2 * i + at] = i < 8 ? lo : hi;
    pick[2 * i + 1 - at] = z;
  }
}
// The int16 multipliers of madd for block jb of a K-quant super-block: lanes 0-7 take the scale
// of its elements 0-15, lanes 8-15 that of 16-31. One byte shuffle of the scale bytes (into
// the low byte of each int16, the high one zeroed) where the scales are unsigned; into the high
// byte, then an arithmetic shift by 8, where they are signed.
template <class W>
inline __m256i block_scales(__m256i scb, int jb) {
  alignas(32) char pick[32];
  scale_pick<W>(jb, pick);
  const __m256i v =
      _mm256_shuffle_epi8(scb, _mm256_load_si256(reinterpret_cast<const __m256i*>(pick)));
  if constexpr (W::kSignedScales) return _mm256_srai_epi16(v, 8);
  return v;
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

// R rows x T tokens (tokens t0 .. t0 + T of x) of a legacy format: the reference's f32
// operations lane by lane, with the scale work done for all R rows together. Lane 2 r of dmx[t] is d_r * dx and lane 2 r + 1 is m_r * dx (the
// products the reference rounds); the min sum of row r runs in lane 2 r + 1 of am[t], the same
// fma(m * dx, X, am) block after block (mn = 1 here, so mn * X is X).
// Where Dot accumulates for free (VNNI) the signed formats take the offset form: S_j = sum
// (q + o) * xq - o * sum xq over the lane's four elements, the second term once per token and
// block (dot(o, xq), exact) and the first one dot_acc on the unsigned levels (q + o <= 255), so
// the exact lane sums come without a sign or abs per row and token. Elsewhere (AVX2, where the
// extra add costs what the sign saves, and 255 would saturate maddubs) the sign of q moves onto
// xq, except with kCorrTab: one token whose corrections come from offset_corrections' table
// (qdot_format's decode of Q4_0 and Q5_0, whose offset levels fit maddubs), added per block.
template <class Dot, class W, int R, int T, bool kCorrTab = false>
inline void tile(const std::byte* w, uint64_t row_bytes, const QuantActs& x, int64_t t0,
                 float* y, int64_t y_stride, const int32_t* corr_tab = nullptr) {
  static_assert(!kCorrTab || (W::kSigned && T == 1));
  constexpr bool kOffsetForm = W::kSigned && Dot::kFusedAcc;
  // One row on the AVX2 set (decode): the scale is broadcast from its register instead, which
  // spares each block a store and a reload.
  constexpr bool kRegScale = R == 1 && !Dot::kFusedAcc;
  const int64_t nb = x.n / kQK;
  __m256 as[R][T], am[T];
  // Each token's levels, scales and level sums (hoisted: GCC reloaded x's fields every block).
  const int8_t* xq[T];
  const float *xd[T], *xs[T];
  for (int t = 0; t < T; ++t) {
    am[t] = _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) as[r][t] = _mm256_setzero_ps();
    xq[t] = x.q + (t0 + t) * x.n;
    xd[t] = x.d + (t0 + t) * nb;
    xs[t] = x.sum32 + (t0 + t) * nb;
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
    __m256 dx0[T];  // kRegScale: lane 0 of dmx[t] in every lane
    for (int t = 0; t < T; ++t) {
      xv[t] = load256(xq[t] + b * kQK);
      if constexpr (kOffsetForm) {
        corr[t] = neg_offset_sums<Dot>(W::kOffset, xv[t]);
      }
      const __m256 dmxt = _mm256_mul_ps(dm, _mm256_set1_ps(xd[t][b]));
      if constexpr (kRegScale) dx0[t] = _mm256_broadcastss_ps(_mm256_castps256_ps128(dmxt));
      else _mm256_store_ps(dmx[t], dmxt);
      if constexpr (W::kMin) {
        am[t] = _mm256_fmadd_ps(dmxt, _mm256_set1_ps(xs[t][b]), am[t]);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256i s[T];
      if constexpr (kCorrTab) {
        const auto* c = reinterpret_cast<const __m256i*>(corr_tab + (t0 * nb + b) * 8);
        s[0] = _mm256_add_epi32(Dot::dot(W::template ulevels<Dot>(unit + r * row_bytes), xv[0]),
                                _mm256_load_si256(c));
      } else if constexpr (kOffsetForm || !W::kSigned) {
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
        __m256 scale;
        if constexpr (kRegScale) scale = dx0[t];
        else scale = _mm256_broadcast_ss(&dmx[t][2 * r]);
        as[r][t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s[t]), as[r][t]);
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

// On a set without fused accumulation (AVX2), the multi-token tiles do the scale work once per
// block for the whole R x T tile (R * T <= 8), from tables in which lane t * R + r of a block's
// entry belongs to row r and token t:
//   per row group (RowTabs): d and, with a min, m;
//   per token tile, built once per call: dx and, with a min, X (the block's level sum).
// A block's products d_r * dx_t are then one multiply and its min terms one fma, the same f32
// operations as tile() lane by lane. The per-token multiplies and the rows' scale decoding had
// been done once per tile: Q8_0 ran 2.5 instead of 2.9 cycles per (row, token, block) without
// them in a standalone loop on Zen 4.
template <class Dot>
constexpr bool kScaleTables = !Dot::kFusedAcc;

// A thread's scratch table of at least n elements, 32-byte aligned for vector loads and stores;
// its contents are whatever the last call left.
template <class E>
E* aligned_scratch(std::vector<E>& buf, int64_t n) {
  const size_t need = static_cast<size_t>(n) + 32 / sizeof(E);
  if (buf.size() < need) buf.resize(need);
  return reinterpret_cast<E*>((reinterpret_cast<uintptr_t>(buf.data()) + 31) & ~uintptr_t{31});
}

// A signed legacy format's offset corrections (neg_offset_sums) of tokens 0 .. nt - 1 of x, one
// 8-lane entry per token and block ([token][block]), made once per call into the calling
// thread's table (valid until its next call).
template <class Dot, class W>
const int32_t* offset_corrections(const QuantActs& x, int64_t nt) {
  const int64_t nb = x.n / kQK;
  thread_local std::vector<int32_t> buf;
  int32_t* const c = aligned_scratch(buf, nt * nb * 8);
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t b = 0; b < nb; ++b)
      _mm256_store_si256(reinterpret_cast<__m256i*>(c + (t * nb + b) * 8),
                         neg_offset_sums<Dot>(W::kOffset, load256(x.q + t * x.n + b * kQK)));
  return c;
}

struct RowTabs {
  const float* d;
  const float* m;
};

template <class Dot, class W, int R, int T>
inline void tile_tab(const std::byte* w, uint64_t row_bytes, const QuantActs& x, int64_t t0,
                     const RowTabs& rt, const float* xd, const float* xs, float* y,
                     int64_t y_stride) {
  static_assert(R * T <= 8 && kScaleTables<Dot>);
  const int64_t nb = x.n / kQK;
  __m256 as[R][T];
  __m256 am = _mm256_setzero_ps();
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) as[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 dx = _mm256_load_ps(xd + 8 * b);
    alignas(32) float sdx[8];
    _mm256_store_ps(sdx, _mm256_mul_ps(_mm256_load_ps(rt.d + 8 * b), dx));
    if constexpr (W::kMin) {
      am = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_load_ps(rt.m + 8 * b), dx),
                           _mm256_load_ps(xs + 8 * b), am);
    }
    __m256i xv[T];
    for (int t = 0; t < T; ++t) xv[t] = load256(x.q + (t0 + t) * x.n + b * kQK);
    for (int r = 0; r < R; ++r) {
      const std::byte* unit = w + r * row_bytes + b * W::kBytes;
      __m256i qv;
      if constexpr (W::kSigned) qv = W::template levels<Dot>(unit);
      else qv = W::template ulevels<Dot>(unit);
      const __m256i au = W::kSigned ? _mm256_abs_epi8(qv) : qv;
      for (int t = 0; t < T; ++t) {
        const __m256i bv = W::kSigned ? _mm256_sign_epi8(xv[t], qv) : xv[t];
        as[r][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&sdx[t * R + r]),
                                   _mm256_cvtepi32_ps(Dot::dot(au, bv)), as[r][t]);
      }
    }
  }
  alignas(32) float mins[8];
  _mm256_store_ps(mins, am);
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r)
      y[t * y_stride + r] = hsum(as[r][t]) + (W::kMin ? mins[t * R + r] : 0.0f);
}

// The end of a K-quant super-block u for an R x T tile: per (row, token) the reference's two
// fmas, d·dx times the exact integer lanes I (isum(r, t), the unsigned levels' lane sums, less
// the offset's o * sc * X16 lanes, one madd) and, with a min, m·dx times the blocks' min sums.
// One definition for every tile kernel (tile_k, VnniDot::tile_k_wide): their bits are equal
// because these steps are.
template <class W, int R, int T, class IntSum>
[[gnu::always_inline]] inline void unit_fmas(const UnitVec (&v)[R], const QuantActs& x,
                                             int64_t t0, int64_t u, __m256 (&as)[R][T],
                                             IntSum&& isum) {
  const int64_t nu = x.n / 256;
  for (int t = 0; t < T; ++t) {
    const float dx = x.d[(t0 + t) * nu + u];
    __m256i xs16;
    if constexpr (W::kMin || W::kOffset != 0)
      xs16 = load256(x.sum16 + (t0 + t) * (x.n / 16) + u * 16);
    for (int r = 0; r < R; ++r) {
      __m256i i = isum(r, t);
      if constexpr (W::kOffset != 0) i = _mm256_sub_epi32(i, _mm256_madd_epi16(v[r].oc16, xs16));
      as[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(v[r].d * dx), _mm256_cvtepi32_ps(i), as[r][t]);
      if constexpr (W::kMin) {
        const __m256i bsum = _mm256_madd_epi16(v[r].mn16, xs16);
        as[r][t] =
            _mm256_fmadd_ps(_mm256_set1_ps(v[r].m * dx), _mm256_cvtepi32_ps(bsum), as[r][t]);
      }
    }
  }
}

// The K-quants (kernel_set.h, activations in 256-element groups): R rows x T tokens. Per
// super-block, each (row, token) sums its eight blocks' lane sums times their sub-scales in an
// int32 vector, exactly: the unsigned levels (level + kOffset, at most 63) times xq in int16
// pairs (maddubs: every pair stays below 2^15), then Dot::madd_acc applies the pair's sub-scale
// and adds (VNNI: one vpdpwssd); the offset's share comes off once per super-block, in
// unit_fmas. Per block and (row, token) that is two multiplies, where taking the offset off each
// block had cost a third (maddubs(offset, xq) per token) and a subtraction: Q6_K prefill 84 ->
// 94 and Q3_K 73 -> 83 GFLOP/s at 2048 columns on one Zen 3 core. Each block's R rows are
// unpacked first and the tokens then come one at a time, so that only R x T accumulators and
// 2 R row vectors stay in registers (VNNI 4 x 6: 32; with the six token vectors held as well
// they had spilled, 123-125 against 128-135 GFLOP/s for Q6_K).
// Then per super-block, the reference's two fmas. One (row, token) alone (decode) splits its
// integer sum over four accumulators (exact in any order), so that no block waits for the one
// before.
template <class Dot, class W, int R, int T>
inline void tile_k(const std::byte* w, uint64_t row_bytes, const QuantActs& x, int64_t t0,
                   float* y, int64_t y_stride) {
  static_assert(R >= 1 && T >= 1);
  constexpr int kSplit = R * T == 1 ? 4 : 1;
  const int64_t nu = x.n / 256;
  __m256 as[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) as[r][t] = _mm256_setzero_ps();
  for (int64_t u = 0; u < nu; ++u) {
    UnitVec v[R];
    for (int r = 0; r < R; ++r) {
      const std::byte* unit = w + r * row_bytes + u * W::kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes, _MM_HINT_T0);
      if constexpr (W::kBytes > 64)
        _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes + 64, _MM_HINT_T0);
      if constexpr (W::kBytes > 128)
        _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes + 128, _MM_HINT_T0);
      W::unit(unit, v[r]);
    }
    __m256i acc[R][T][kSplit];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t)
        for (int k = 0; k < kSplit; ++k) acc[r][t][k] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int jb = 0; jb < 8; ++jb) {
      __m256i qu[R], scp[R];
      for (int r = 0; r < R; ++r) {
        qu[r] = W::ulevels(w + r * row_bytes + u * W::kBytes, jb);
        scp[r] = block_scales<W>(v[r].scb, jb);
      }
      for (int t = 0; t < T; ++t) {
        const __m256i xv = load256(x.q + (t0 + t) * x.n + u * 256 + jb * kQK);
        for (int r = 0; r < R; ++r) {
          __m256i& a = acc[r][t][jb % kSplit];
          a = Dot::madd_acc(a, _mm256_maddubs_epi16(qu[r], xv), scp[r]);
          if constexpr (!Dot::kFusedAcc && kSplit == 1) pin(a);
        }
      }
    }
    unit_fmas<W, R, T>(v, x, t0, u, as, [&](int r, int t) {
      __m256i isum = acc[r][t][0];
      for (int k = 1; k < kSplit; ++k) isum = _mm256_add_epi32(isum, acc[r][t][k]);
      return isum;
    });
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) y[t * y_stride + r] = hsum(as[r][t]);
}

// A K-quant matrix: R x T tiles (Dot::kRowsK x kTokensK), leftovers in thinner ones; decode one
// row at a time.
template <class Dot, class W>
void qdot_k(const std::byte* w, uint64_t row_bytes, int64_t nr, const QuantActs& x, int64_t nt,
            float* y, int64_t y_stride) {
  if (nt == 1) {  // one row at a time: tile_k splits its sum over four chains
    for (int64_t r = 0; r < nr; ++r)
      tile_k<Dot, W, 1, 1>(w + r * row_bytes, row_bytes, x, 0, y + r, y_stride);
    return;
  }
  constexpr int R = Dot::kRowsK, T = Dot::kTokensK;
  static_assert(T <= 8);
  // A set with 512-bit vectors takes its several-token tiles from Dot::tile_k_wide.
  auto tile = [&]<int RR, int N>(const std::byte* wr, int64_t t, float* yt) {
    if constexpr (Dot::kWideK) Dot::template tile_k_wide<W, RR, N>(wr, row_bytes, x, t, yt, y_stride);
    else tile_k<Dot, W, RR, N>(wr, row_bytes, x, t, yt, y_stride);
  };
  auto row_tiles = [&]<int RR>(int64_t r) {
    const std::byte* wr = w + r * row_bytes;
    int64_t t = 0;
    for (; t + T <= nt; t += T) tile.template operator()<RR, T>(wr, t, y + t * y_stride + r);
    // The leftover tokens in one tile of their own width (one pass over the rows, not one each).
    auto rest = [&]<int N>() {
      if constexpr (N < T) tile.template operator()<RR, N>(wr, t, y + t * y_stride + r);
    };
    switch (nt - t) {
      case 1: return rest.template operator()<1>();
      case 2: return rest.template operator()<2>();
      case 3: return rest.template operator()<3>();
      case 4: return rest.template operator()<4>();
      case 5: return rest.template operator()<5>();
      case 6: return rest.template operator()<6>();
      case 7: return rest.template operator()<7>();
      default: return;
    }
  };
  int64_t r = 0;
  for (; r + R <= nr; r += R) row_tiles.template operator()<R>(r);
  for (; r < nr; ++r) row_tiles.template operator()<1>(r);
}

// The R x T tiles of qdot_format through tile_tab; returns the rows done (a multiple of R).
template <class Dot, class W, int R, int T>
int64_t qdot_tabled(const std::byte* w, uint64_t row_bytes, int64_t nr, const QuantActs& x,
                    int64_t nt, float* y, int64_t y_stride) {
  const int64_t nb = x.n / kQK, tiles = nt / T;
  // Token tables, then the row group's, each entry 8 lanes; 32-byte aligned.
  const int64_t n_tok = (W::kMin ? 2 : 1) * tiles * nb * 8, n_row = (W::kMin ? 2 : 1) * nb * 8;
  thread_local std::vector<float> buf;
  float* const xd = aligned_scratch(buf, n_tok + n_row);  // every lane read is written
  float* const xs = xd + tiles * nb * 8;
  float* const rd = xd + n_tok;
  float* const rm = rd + nb * 8;
  const RowTabs rt{rd, rm};
  // Lane t * R + r of an entry takes lane t of a per-token vector, or lane 2 r (d) or 2 r + 1
  // (m) of dm_of's.
  static_assert(R * T == 8 && T <= 4);
  alignas(32) int32_t tok[8], row_d[8], row_m[8];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) {
      tok[t * R + r] = t;
      row_d[t * R + r] = 2 * r;
      row_m[t * R + r] = 2 * r + 1;
    }
  const __m256i tok_i = _mm256_load_si256(reinterpret_cast<const __m256i*>(tok));
  const __m256i row_di = _mm256_load_si256(reinterpret_cast<const __m256i*>(row_d));
  const __m256i row_mi = _mm256_load_si256(reinterpret_cast<const __m256i*>(row_m));
  for (int64_t i = 0; i < tiles; ++i)
    for (int64_t b = 0; b < nb; ++b) {
      alignas(16) float d4[4] = {}, s4[4] = {};
      for (int t = 0; t < T; ++t) {
        d4[t] = x.d[(i * T + t) * nb + b];
        if constexpr (W::kMin) s4[t] = x.sum32[(i * T + t) * nb + b];
      }
      const auto spread = [&](const float* v4) {
        return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_load_ps(v4)), tok_i);
      };
      _mm256_store_ps(xd + (i * nb + b) * 8, spread(d4));
      if constexpr (W::kMin) _mm256_store_ps(xs + (i * nb + b) * 8, spread(s4));
    }
  int64_t r0 = 0;
  for (; r0 + R <= nr; r0 += R) {
    const std::byte* wr = w + r0 * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 dm = dm_of<R>(wr + b * W::kBytes, row_bytes);
      _mm256_store_ps(rd + b * 8, _mm256_permutevar8x32_ps(dm, row_di));
      if constexpr (W::kMin) _mm256_store_ps(rm + b * 8, _mm256_permutevar8x32_ps(dm, row_mi));
    }
    int64_t t = 0;
    for (int64_t i = 0; i < tiles; ++i, t += T)
      tile_tab<Dot, W, R, T>(wr, row_bytes, x, t, rt, xd + i * nb * 8, xs + i * nb * 8,
                             y + t * y_stride + r0, y_stride);
    for (; t < nt; ++t) tile<Dot, W, R, 1>(wr, row_bytes, x, t, y + t * y_stride + r0, y_stride);
  }
  return r0;
}

// A set with row-pair tiles (VNNI: Dot::tile_legacy_pairs) takes its R x T
// tiles here; returns the rows done (a multiple of R). Several tokens only: one token's blocks
// are the matrix-vector product, memory-bound, where the 256-bit tile() was measured faster
// (kernel_bench matvec, Q5_0: 26.8 against 33.6 us). A signed format's offset corrections
// (neg_offset_sums of each token and block) are made once per call into a table.
template <class Dot, class W, int R, int T>
int64_t qdot_pairs(const std::byte* w, uint64_t row_bytes, int64_t nr, const QuantActs& x,
                   int64_t nt, float* y, int64_t y_stride) {
  static_assert(R % 2 == 0 && T > 1);
  const int32_t* corr = nullptr;
  if constexpr (W::kSigned) corr = offset_corrections<Dot, W>(x, nt);
  int64_t r0 = 0;
  for (; r0 + R <= nr; r0 += R) {
    const std::byte* wr = w + r0 * row_bytes;
    int64_t t = 0;
    for (; t + T <= nt; t += T)
      Dot::template tile_legacy_pairs<W, R, T>(wr, row_bytes, x, t, corr, y + t * y_stride + r0,
                                               y_stride);
    for (; t < nt; ++t) tile<Dot, W, R, 1>(wr, row_bytes, x, t, y + t * y_stride + r0, y_stride);
  }
  return r0;
}

// A legacy format's matrix. Decode (one token): decode_runs with Dot::kDecodeRuns runs (AVX2:
// 4; the VNNI set one row at a time, as measured on Zen 4 against four adjacent rows side by
// side: SmolLM2 Q8_0 decode 199-210 against 115-130 tok/s). Several tokens: tiles of Dot::kRows
// rows x Dot::kTokens tokens (as many accumulators as the register file holds), through
// tile_tab (AVX2) or the row-pair tiles (VNNI), each weight block unpacked once per tile;
// leftover rows and tokens in thinner tiles.
template <class Dot, class W>
void qdot_format(const std::byte* w, uint64_t row_bytes, int64_t nr, const QuantActs& x,
                 int64_t nt, float* y, int64_t y_stride) {
  if (nt == 1) {
    constexpr int S = Dot::kDecodeRuns;
    // A signed format whose offset level times 127 fits maddubs (Q4_0, Q5_0) on the AVX2 set:
    // the offset form, its corrections (the token's own, the same for every row) made once
    // per call: an add per block instead of the sign of each level moved onto x (abs and sign)
    // and the offset subtracted.
    if constexpr (W::kSigned && !Dot::kFusedAcc) {
      if constexpr (W::kOffset <= 64) {
        const int32_t* corr = offset_corrections<Dot, W>(x, 1);
        return decode_runs<S>(w, row_bytes, nr, y,
                              [&]<int N>(const std::byte* wr, uint64_t apart, float* out) {
                                tile<Dot, W, N, 1, true>(wr, apart, x, 0, out, 0, corr);
                              });
      }
    }
    return decode_runs<S>(w, row_bytes, nr, y,
                          [&]<int N>(const std::byte* wr, uint64_t apart, float* out) {
                            tile<Dot, W, N, 1>(wr, apart, x, 0, out, 0);
                          });
  }
  constexpr int R = Dot::kRows, T = Dot::kTokens;
  static_assert(kScaleTables<Dot> || Dot::kRowPairs);
  int64_t r = 0;
  if constexpr (kScaleTables<Dot>) r = qdot_tabled<Dot, W, R, T>(w, row_bytes, nr, x, nt, y, y_stride);
  else r = qdot_pairs<Dot, W, R, T>(w, row_bytes, nr, x, nt, y, y_stride);
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
    case DType::kQ2_K: return qdot_k<Dot, Q2_K>(w, row_bytes, nr, x, nt, y, y_stride);
    case DType::kQ3_K: return qdot_k<Dot, Q3_K>(w, row_bytes, nr, x, nt, y, y_stride);
    case DType::kQ4_K: return qdot_k<Dot, Q4_K>(w, row_bytes, nr, x, nt, y, y_stride);
    case DType::kQ5_K: return qdot_k<Dot, Q5_K>(w, row_bytes, nr, x, nt, y, y_stride);
    case DType::kQ6_K: return qdot_k<Dot, Q6_K>(w, row_bytes, nr, x, nt, y, y_stride);
    default: return;
  }
}

// Activation quantisation (kernel_set.h): the same operations as quantize_acts_generic, eight
// lanes at a time. max is exact whatever the order; _mm256_cvtps_epi32 rounds half to even in
// the default rounding mode, as nearbyint does.
inline void quantize_acts(const float* x, int64_t x_stride, int64_t n_tokens, int64_t n,
                          int64_t group, int8_t* q, float* d, int16_t* sum16, float* sum32) {
  const int64_t nb = n / kQK, ng = n / group;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* xt = x + t * x_stride;
    for (int64_t g = 0; g < ng; ++g) {
      const float* xg = xt + g * group;
      __m256 mx = _mm256_setzero_ps();
      for (int64_t i = 0; i < group; i += 8)
        mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xg + i), abs_mask));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 0x55));
      const float amax = _mm_cvtss_f32(m4);
      const float dg = amax / 127.0f;
      const float id = dg != 0.0f ? 1.0f / dg : 0.0f;
      d[t * ng + g] = dg;
      const __m256 vid = _mm256_set1_ps(id);
      for (int64_t b = g * group / kQK; b < (g + 1) * group / kQK; ++b) {
        const float* xb = xt + b * kQK;
        __m256i i32[4];
        for (int k = 0; k < 4; ++k)
          i32[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * k), vid));
        // packs work within 128-bit lanes: fix the order with one permute at the end.
        const __m256i p01 = _mm256_packs_epi32(i32[0], i32[1]);
        const __m256i p23 = _mm256_packs_epi32(i32[2], i32[3]);
        __m256i p = _mm256_packs_epi16(p01, p23);
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + t * n + b * kQK), p);
        // Sums of each 16 levels: pairs (maddubs), then pairs of pairs (madd), then the two
        // 128-bit halves of eight 32-bit partial sums each.
        const __m256i p4 =
            _mm256_madd_epi16(_mm256_maddubs_epi16(mask8(1), p), _mm256_set1_epi16(1));
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(p4),
                                  _mm_srli_si128(_mm256_castsi256_si128(p4), 8));
        __m128i k = _mm_add_epi32(_mm256_extracti128_si256(p4, 1),
                                  _mm_srli_si128(_mm256_extracti128_si256(p4, 1), 8));
        h = _mm_add_epi32(h, _mm_srli_si128(h, 4));
        k = _mm_add_epi32(k, _mm_srli_si128(k, 4));
        const int s0 = _mm_cvtsi128_si32(h), s1 = _mm_cvtsi128_si32(k);
        sum16[t * (n / 16) + 2 * b] = static_cast<int16_t>(s0);
        sum16[t * (n / 16) + 2 * b + 1] = static_cast<int16_t>(s1);
        sum32[t * nb + b] = static_cast<float>(s0 + s1);
      }
    }
  }
}

}  // namespace
}  // namespace cleave::cpu::detail::simd
