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
#include <type_traits>

#include "cleave/model/quants.h"

#if defined(CLEAVE_AVX512_EMULATED)
#include "avx512_emulated.h"  // the test build: SIMDe in place of the target pragma
#elif defined(__clang__)
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
  // The legacy formats: row pairs (tile_legacy_pairs) x tokens, measured in kernel_bench
  // prefill: 2 x 6 (5-10% above 4 and 8).
  static constexpr int kRows = 4, kTokens = 6;
  // The K-quants' several-token tiles (tile_k_wide): 4 x 4, measured on Sapphire Rapids against
  // 4 x 6, 2 x 8, 2 x 6 and 3 x 4, all within the noise (Q4_K 106-118 GFLOP/s, Q6_K 99-120,
  // Q5_K 100-108); 4 x 6 holds 24 of the 32 registers in accumulators alone.
  static constexpr int kRowsK = 4, kTokensK = 4;
  // The legacy formats' decode: one row at a time (decode_runs, dot_simd.h; runs, faster on
  // Zen 3's AVX2 set, are untimed on an AVX-512 host).
  static constexpr int kDecodeRuns = 1;
  static constexpr bool kFusedAcc = true;  // vpdpbusd: no intermediate saturation
  static inline __m256i dot(__m256i a_u8, __m256i b_s8) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a_u8, b_s8);
  }
  static inline __m256i dot_acc(__m256i c, __m256i a_u8, __m256i b_s8) {
    return _mm256_dpbusd_epi32(c, a_u8, b_s8);
  }
  // acc + the int32 lane sums of the int16 pairs of a times b, in one vpdpwssd (no saturation).
  static inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
    return _mm256_dpwssd_epi32(acc, a, b);
  }
  // A mask register selects the bytes (AVX512BW/VL): two instructions for the AVX2 set's five.
  static inline __m256i bit_bytes(uint32_t bits, int v) {
    return _mm256_maskz_mov_epi8(static_cast<__mmask32>(bits), simd::mask8(v));
  }

  // The legacy formats take tiles of row pairs (through simd::qdot_pairs).
  static constexpr bool kRowPairs = true;
  // The K-quants' several-token tiles take two blocks a 512-bit vector (tile_k_wide).
  static constexpr bool kWideK = true;
  template <class W, int R, int T>
  static void tile_k_wide(const std::byte* w, uint64_t row_bytes, const QuantActs& x, int64_t t0,
                          float* y, int64_t y_stride);
  // corr: the signed formats' offset corrections of every token and block (simd::qdot_pairs).
  template <class W, int R, int T>
  static void tile_legacy_pairs(const std::byte* w, uint64_t row_bytes, const QuantActs& x,
                                int64_t t0, const int32_t* corr, float* y, int64_t y_stride);
};

// Lanes 0-7 = lane a of v, lanes 8-15 = lane b.
inline __m512 two_lanes(__m512 v, int a, int b) {
  return _mm512_permutexvar_ps(
      _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(a)), _mm256_set1_epi32(b), 1), v);
}
// Lanes 8-15 as a 256-bit vector.
inline __m256 high_half(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
// Two 256-bit level vectors as the halves of one.
inline __m512i halves(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
// The start of a (row pair, token, block)'s dot product: for a signed format (offset form, as in
// simd::tile) the token's offset correction from simd::qdot_pairs' table, in both halves
// (a load, where computing it in the tile kept one register per token and cost a third of the
// tile's dot products); zero for the unsigned formats.
template <class W>
inline __m512i start(const int32_t* corr, int64_t token_block) {
  if constexpr (W::kSigned) {
    return _mm512_broadcast_i64x4(
        _mm256_load_si256(reinterpret_cast<const __m256i*>(corr + token_block * 8)));
  } else {
    return _mm512_setzero_si512();
  }
}

// simd::tile with two rows in one 512-bit vector: lanes 0-7 are row 2p's eight lanes,
// lanes 8-15 row 2p + 1's. Each half does what tile's 256-bit vector does for its row:
// the same exact lane sums, the same product d_r * dx (here (d_r broadcast) * dx, the same
// rounded value), the same fma block after block and the same horizontal sum, so the results
// are tile's bit for bit. Per (row pair, token, block): dot, convert, scale product and
// fma, four 512-bit operations where tile spends six 256-bit ones (with the row's scale
// broadcast from memory) on the same two rows; the activations come broadcast to both halves.
template <class W, int R, int T>
void VnniDot::tile_legacy_pairs(const std::byte* w, uint64_t row_bytes, const QuantActs& x,
                                int64_t t0, const int32_t* corr, float* y, int64_t y_stride) {
  static_assert(R % 2 == 0 && R <= 4);
  constexpr int P = R / 2;
  const int64_t nb = x.n / kQK;
  __m512 as[P][T];
  __m256 am[T];
  for (int t = 0; t < T; ++t) {
    am[t] = _mm256_setzero_ps();
    for (int p = 0; p < P; ++p) as[p][t] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const std::byte* unit = w + b * W::kBytes;  // row 0's block b
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(unit + r * row_bytes) + simd::kPrefetchBytes,
                   _MM_HINT_T0);
    }
    const __m256 dm = simd::dm_of<R>(unit, row_bytes);
    // Pair p: lane 2 (2 p) of dm (d of row 2 p) in its low half, lane 2 (2 p + 1) in its high one.
    __m512 dpair[P];
    for (int p = 0; p < P; ++p) dpair[p] = two_lanes(_mm512_castps256_ps512(dm), 4 * p, 4 * p + 2);
    __m512i qu[P];
    for (int p = 0; p < P; ++p)
      qu[p] = halves(W::template ulevels<VnniDot>(unit + 2 * p * row_bytes),
                     W::template ulevels<VnniDot>(unit + (2 * p + 1) * row_bytes));
    // Token by token, so that a token's activations and start live only for its R rows.
    for (int t = 0; t < T; ++t) {
      const __m512i xv = _mm512_broadcast_i64x4(simd::load256(x.q + (t0 + t) * x.n + b * kQK));
      const __m512i st = start<W>(corr, (t0 + t) * nb + b);
      const float dx = x.d[(t0 + t) * nb + b];
      if constexpr (W::kMin) {
        const __m256 dmxt = _mm256_mul_ps(dm, _mm256_set1_ps(dx));
        am[t] = _mm256_fmadd_ps(dmxt, _mm256_set1_ps(x.sum32[(t0 + t) * nb + b]), am[t]);
      }
      for (int p = 0; p < P; ++p) {
        const __m512i s = _mm512_dpbusd_epi32(st, qu[p], xv);
        const __m512 scale = _mm512_mul_ps(dpair[p], _mm512_set1_ps(dx));
        as[p][t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s), as[p][t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    alignas(32) float mins[8];
    _mm256_store_ps(mins, am[t]);
    for (int p = 0; p < P; ++p) {
      const float min0 = W::kMin ? mins[4 * p + 1] : 0.0f, min1 = W::kMin ? mins[4 * p + 3] : 0.0f;
      y[t * y_stride + 2 * p] = simd::hsum(_mm512_castps512_ps256(as[p][t])) + min0;
      y[t * y_stride + 2 * p + 1] = simd::hsum(high_half(as[p][t])) + min1;
    }
  }
}

// Bytes of p (32) in both 256-bit halves, the low half's 64-bit lanes shifted right by s0, the
// high half's by s1 (as the 256-bit formats' srl16 on a block's bytes: the masks after it keep
// only bits that stay within their byte).
inline __m512i pair_shift(const std::byte* p, int s0, int s1) {
  const __m512i v = _mm512_broadcast_i64x4(simd::load256(p));
  return _mm512_srlv_epi64(v, _mm512_inserti64x4(_mm512_set1_epi64(s0), _mm256_set1_epi64x(s1), 1));
}
inline __m512i mask8w(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
// Blocks 2 c and 2 c + 1 of a K-quant super-block as unsigned levels: W::ulevels of each, as the
// halves of one vector.
template <class W>
inline __m512i ulevels_pair(const std::byte* u, int c) {
  using namespace simd;
  if constexpr (std::is_same_v<W, Q2_K>) {
    return _mm512_and_si512(pair_shift(u + 16 + 32 * (c / 2), 4 * (c % 2), 4 * (c % 2) + 2),
                            mask8w(3));
  } else if constexpr (std::is_same_v<W, Q3_K>) {
    const __m512i low = _mm512_and_si512(
        pair_shift(u + 32 + 32 * (c / 2), 4 * (c % 2), 4 * (c % 2) + 2), mask8w(3));
    const __m512i high = _mm512_and_si512(pair_shift(u, 2 * c, 2 * c + 1), mask8w(1));
    return _mm512_or_si512(low, _mm512_slli_epi16(high, 2));
  } else if constexpr (std::is_same_v<W, Q4_K>) {
    return _mm512_and_si512(pair_shift(u + 16 + 32 * c, 0, 4), mask8w(0x0F));
  } else if constexpr (std::is_same_v<W, Q5_K>) {
    const __m512i low = _mm512_and_si512(pair_shift(u + 48 + 32 * c, 0, 4), mask8w(0x0F));
    const __m512i high = _mm512_and_si512(pair_shift(u + 16, 2 * c, 2 * c + 1), mask8w(1));
    return _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
  } else {
    static_assert(std::is_same_v<W, Q6_K>);
    // Blocks 4 h + k, k = 2 (c % 2) + {0, 1}: their low nibbles are the two 32-byte halves of
    // ql[64 h ..], both shifted by 4 (c % 2); their high bits are qh[32 h ..] >> 2 k.
    const int h = c / 2, s = 4 * (c % 2);
    const __m512i ql = _mm512_loadu_si512(u + 64 * h);
    const __m512i low =
        _mm512_and_si512(_mm512_srl_epi16(ql, _mm_cvtsi32_si128(s)), mask8w(0x0F));
    const __m512i high = _mm512_and_si512(pair_shift(u + 128 + 32 * h, s, s + 2), mask8w(3));
    return _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
  }
}
// simd::block_scales of blocks 2 c and 2 c + 1 as the halves of one vector: the same shuffle,
// over the scale bytes broadcast to every 128-bit lane.
template <class W>
inline __m512i block_scales_pair(__m512i scb, int c) {
  alignas(64) char pick[64];
  simd::scale_pick<W>(2 * c, pick);
  simd::scale_pick<W>(2 * c + 1, pick + 32);
  const __m512i v = _mm512_shuffle_epi8(scb, _mm512_load_si512(pick));
  if constexpr (W::kSignedScales) return _mm512_srai_epi16(v, 8);
  return v;
}
// simd::tile_k with two blocks a 512-bit vector, block 2 c in the low half and 2 c + 1 in the
// high one: per (row, token, block pair) one maddubs and one vpdpwssd, where tile_k spends twice
// as many 256-bit ones; the two blocks' activations lie side by side (one load). At the end of a
// super-block the halves are added (exact int32: each lane then holds tile_k's integer sum) and
// tile_k's f32 steps follow, so the results are tile_k's bit for bit.
template <class W, int R, int T>
void VnniDot::tile_k_wide(const std::byte* w, uint64_t row_bytes, const QuantActs& x, int64_t t0,
                          float* y, int64_t y_stride) {
  const int64_t nu = x.n / 256;
  __m256 as[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) as[r][t] = _mm256_setzero_ps();
  for (int64_t u = 0; u < nu; ++u) {
    simd::UnitVec v[R];
    __m512i scb[R];
    for (int r = 0; r < R; ++r) {
      W::unit(w + r * row_bytes + u * W::kBytes, v[r]);
      scb[r] = _mm512_broadcast_i64x4(v[r].scb);
    }
    __m512i acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512i qu[R], scp[R];
      for (int r = 0; r < R; ++r) {
        qu[r] = ulevels_pair<W>(w + r * row_bytes + u * W::kBytes, c);
        scp[r] = block_scales_pair<W>(scb[r], c);
      }
      for (int t = 0; t < T; ++t) {
        const __m512i xv = _mm512_loadu_si512(x.q + (t0 + t) * x.n + u * 256 + c * 64);
        for (int r = 0; r < R; ++r)
          acc[r][t] = _mm512_dpwssd_epi32(acc[r][t], _mm512_maddubs_epi16(qu[r], xv), scp[r]);
      }
    }
    simd::unit_fmas<W, R, T>(v, x, t0, u, as, [&](int r, int t) {
      return _mm256_add_epi32(_mm512_castsi512_si256(acc[r][t]),
                              _mm512_extracti64x4_epi64(acc[r][t], 1));
    });
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) y[t * y_stride + r] = simd::hsum(as[r][t]);
}

}  // namespace

void qdot_avx512_vnni(DType t, const std::byte* w, uint64_t row_bytes, int64_t nr,
                      const QuantActs& x, int64_t nt, float* y, int64_t y_stride) {
  simd::qdot<VnniDot>(t, w, row_bytes, nr, x, nt, y, y_stride);
}

}  // namespace cleave::cpu::detail

#if defined(CLEAVE_AVX512_EMULATED)
#elif defined(__clang__)
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
