// AVX-512 kernels: the f32-path reduction order (kernel_set.h) with the accumulators of two
// rows in one 16-lane register, the micro-kernels of the multi-token matmul (matmul_block.h),
// which runs every token of the batch against each block of weight rows, and the element-wise
// kernels on 16 lanes.
//
// Bit-identity with the AVX2 set: both keep one 8-lane accumulator per (row, token) over the
// 8-element chunks in increasing order. Here a register holds rows r and r + 1 of one token
// (lanes 0-7 and 8-15): the weights of both rows side by side, the token's 8 activations in
// both halves. A 512-bit fused multiply-add is eight-lane FMAs side by side, so every lane sees
// the same sequence of roundings; each half then takes dot_simd.h's horizontal sum and tail,
// the AVX2 set's code.
//
// The code is compiled for AVX-512 through a target pragma (the rest of the engine is not), and
// runs only when cpu_has_avx512_kernels() is true.
#include "kernel_set.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

// The standard headers here and in matmul_block.h, before the target pragma below.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(CLEAVE_AVX512_EMULATED)
#include "avx512_emulated.h"  // the test build: SIMDe in place of the target pragma
#elif defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
// GCC 12's AVX-512 intrinsics self-initialise their "undefined" operands and warn about it when
// inlined (GCC bug 105593, fixed in GCC 13): silence that here only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "dot_simd.h"         // internal linkage only, as vec_simd.h
#include "matmul_block.h"     // internal linkage only, as vec_simd.h
#include "stream_prefetch.h"  // internal linkage only, as vec_simd.h
#include "vec_simd.h"  // internal linkage only: compiled here for AVX-512

namespace cleave::cpu::detail {
namespace {

// Pair<W>::load(r0, r1, i): elements [i, i + 8) of rows r0 and r1 in lanes 0-7 and 8-15.
template <typename W>
struct Pair;

inline __m256i join128(const std::byte* p0, const std::byte* p1) {
  return _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1);
}

template <>
struct Pair<F32Weights> {
  static inline __m512 load(const std::byte* r0, const std::byte* r1, int64_t i) {
    const __m256d lo = _mm256_loadu_pd(reinterpret_cast<const double*>(r0 + i * 4));
    const __m256d hi = _mm256_loadu_pd(reinterpret_cast<const double*>(r1 + i * 4));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1));
  }
};

template <>
struct Pair<F16Weights> {
  static inline __m512 load(const std::byte* r0, const std::byte* r1, int64_t i) {
    return _mm512_cvtph_ps(join128(r0 + i * 2, r1 + i * 2));
  }
};

template <>
struct Pair<BF16Weights> {
  static inline __m512 load(const std::byte* r0, const std::byte* r1, int64_t i) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(join128(r0 + i * 2, r1 + i * 2)), 16));
  }
};

// x[i, i + 8) in both halves.
inline __m512 both_halves(const float* x) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(x))));
}

inline __m256 low_half(__m512 a) { return _mm512_castps512_ps256(a); }
inline __m256 high_half(__m512 a) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
}

// The rows of a tile of R rows in pairs: pair p holds rows 2p and 2p + 1, or row 2p twice when R
// is odd and 2p + 1 == R (its high half is then never stored).
template <int R>
struct RowPairs {
  static constexpr int kPairs = (R + 1) / 2;
  const std::byte* row[2 * kPairs];
  RowPairs(const std::byte* w, uint64_t row_bytes) {
    for (int j = 0; j < 2 * kPairs; ++j)
      row[j] = w + static_cast<uint64_t>(j < R ? j : R - 1) * row_bytes;
  }
};

// One 8-element chunk k of the R rows (in pairs) against T tokens (x + t * x_stride): the
// tokens' activations in both halves, loaded once, then per pair one load of both rows and T
// fused multiply-adds into a[p][t]. tile and micro are loops of this step, so each (row, token)
// accumulator sees the chunks in increasing order (kernel_set.h).
template <typename W, int R, int T>
[[gnu::always_inline]] inline void step(const RowPairs<R>& rp, const float* x, int64_t x_stride,
                                        int64_t k, __m512 (&a)[RowPairs<R>::kPairs][T]) {
  __m512 xv[T];
  for (int t = 0; t < T; ++t) xv[t] = both_halves(x + t * x_stride + k);
  for (int p = 0; p < RowPairs<R>::kPairs; ++p) {
    const __m512 wv = Pair<W>::load(rp.row[2 * p], rp.row[2 * p + 1], k);
    for (int t = 0; t < T; ++t) a[p][t] = _mm512_fmadd_ps(wv, xv[t], a[p][t]);
  }
}

// R rows x T tokens straight from the weights (decode, attention, small calls), with the
// streaming prefetch (stream_prefetch.h), which measured faster on Zen 4.
template <typename W, int R, int T>
inline void tile(const std::byte* w, uint64_t row_bytes, const float* x, int64_t x_stride,
                 int64_t n, float* y, int64_t y_stride) {
  const RowPairs<R> rp(w, row_bytes);
  constexpr int P = RowPairs<R>::kPairs;
  __m512 a[P][T];
  for (int p = 0; p < P; ++p)
    for (int t = 0; t < T; ++t) a[p][t] = _mm512_setzero_ps();
  int64_t i = 0;
  StreamPrefetch pf(w, row_bytes, R);
  for (; i + 32 <= n; i += 32, pf.advance(4 * W::kBytesPer8)) {
    for (int r = 0; r < R; ++r) pf.fetch(r, W::kBytesPer8 > 16 ? 2 : 1);
    for (int c = 0; c < 32; c += 8) step<W, R, T>(rp, x, x_stride, i + c, a);
  }
  for (; i + 8 <= n; i += 8) step<W, R, T>(rp, x, x_stride, i, a);
  for (int p = 0; p < P; ++p)
    for (int t = 0; t < T; ++t) {
      const float* xt = x + t * x_stride;
      y[t * y_stride + 2 * p] = finish_pair<W>(low_half(a[p][t]), rp.row[2 * p], xt, i, n);
      if (2 * p + 1 < R)
        y[t * y_stride + 2 * p + 1] =
            finish_pair<W>(high_half(a[p][t]), rp.row[2 * p + 1], xt, i, n);
    }
}

template <typename W, int R>
inline void tile_rows(const std::byte* w, uint64_t row_bytes, const float* x, int64_t x_stride,
                      int nt, int64_t n, float* y, int64_t y_stride) {
  switch (nt) {
    case 1: tile<W, R, 1>(w, row_bytes, x, x_stride, n, y, y_stride); return;
    case 2: tile<W, R, 2>(w, row_bytes, x, x_stride, n, y, y_stride); return;
    case 3: tile<W, R, 3>(w, row_bytes, x, x_stride, n, y, y_stride); return;
    default: tile<W, R, 4>(w, row_bytes, x, x_stride, n, y, y_stride); return;
  }
}

template <typename W>
void dot_tile(const std::byte* w, uint64_t row_bytes, int nr, const float* x, int64_t x_stride,
              int nt, int64_t n, float* y, int64_t y_stride) {
  switch (nr) {
    case 1: tile_rows<W, 1>(w, row_bytes, x, x_stride, nt, n, y, y_stride); return;
    case 2: tile_rows<W, 2>(w, row_bytes, x, x_stride, nt, n, y, y_stride); return;
    case 3: tile_rows<W, 3>(w, row_bytes, x, x_stride, nt, n, y, y_stride); return;
    default: tile_rows<W, 4>(w, row_bytes, x, x_stride, nt, n, y, y_stride); return;
  }
}

// ---- Multi-token matmul (matmul_block.h) ---------------------------------------------------

// R rows (in pairs) x T tokens over [k0, k0 + kc); pair (r, t)'s 8-lane accumulator rests at
// acc + (r * acc_stride + t) * 8 between calls.
template <typename W, int R, int T>
void micro(const std::byte* w, uint64_t row_bytes, int64_t k0, int64_t kc, const float* x,
           int64_t x_stride, float* acc, int64_t acc_stride) {
  const RowPairs<R> rp(w, row_bytes);
  constexpr int P = RowPairs<R>::kPairs;
  const auto slot = [&](int r, int t) { return acc + (r * acc_stride + t) * 8; };
  __m512 a[P][T];
  for (int p = 0; p < P; ++p)
    for (int t = 0; t < T; ++t) {
      if (k0 == 0) {
        a[p][t] = _mm512_setzero_ps();
        continue;
      }
      const __m256d lo = _mm256_castps_pd(_mm256_loadu_ps(slot(2 * p, t)));
      const __m256d hi = _mm256_castps_pd(_mm256_loadu_ps(slot(2 * p + 1 < R ? 2 * p + 1 : 2 * p, t)));
      a[p][t] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1));
    }
  for (int64_t k = k0; k < k0 + kc; k += 8) step<W, R, T>(rp, x, x_stride, k, a);
  for (int p = 0; p < P; ++p)
    for (int t = 0; t < T; ++t) {
      _mm256_storeu_ps(slot(2 * p, t), low_half(a[p][t]));
      if (2 * p + 1 < R) _mm256_storeu_ps(slot(2 * p + 1, t), high_half(a[p][t]));
    }
}

template <typename W, int R>
constexpr MicroFn micro_for_tokens(int t) {
  return t == 1   ? &micro<W, R, 1>
         : t == 2 ? &micro<W, R, 2>
         : t == 3 ? &micro<W, R, 3>
         : t == 4 ? &micro<W, R, 4>
         : t == 5 ? &micro<W, R, 5>
                  : &micro<W, R, 6>;
}

// kMicroFns<W>[R - 1][T - 1]
template <typename W>
constexpr MicroFn kMicroFns[4][6] = {
    {micro_for_tokens<W, 1>(1), micro_for_tokens<W, 1>(2), micro_for_tokens<W, 1>(3),
     micro_for_tokens<W, 1>(4), micro_for_tokens<W, 1>(5), micro_for_tokens<W, 1>(6)},
    {micro_for_tokens<W, 2>(1), micro_for_tokens<W, 2>(2), micro_for_tokens<W, 2>(3),
     micro_for_tokens<W, 2>(4), micro_for_tokens<W, 2>(5), micro_for_tokens<W, 2>(6)},
    {micro_for_tokens<W, 3>(1), micro_for_tokens<W, 3>(2), micro_for_tokens<W, 3>(3),
     micro_for_tokens<W, 3>(4), micro_for_tokens<W, 3>(5), micro_for_tokens<W, 3>(6)},
    {micro_for_tokens<W, 4>(1), micro_for_tokens<W, 4>(2), micro_for_tokens<W, 4>(3),
     micro_for_tokens<W, 4>(4), micro_for_tokens<W, 4>(5), micro_for_tokens<W, 4>(6)},
};

struct Avx512Block {
  // One chunk for 1536 columns (4 f16 rows and 6 f32 activation rows: 48 KiB, from L1 and L2):
  // 2048 measured 5-15% faster than 1024 on 576x1536 and level on 4096x4096 (Zen 4, with the
  // earlier two-accumulator order).
  static constexpr int64_t kMaxChunk = 2048;
  static constexpr int kMicroRows = 4;
  static constexpr int kMicroTokens = 6;  // 12 accumulators + 2 weights + 6 activations of 32 zmm
  static constexpr int kReduceRows = 8;
  template <typename W>
  static MicroFn micro(int mr, int mt) { return kMicroFns<W>[mr - 1][mt - 1]; }
  static void reduce(const float* acc, int64_t stride, float* out) {
    _mm256_storeu_ps(out, hsum8(acc, stride));
  }
  template <typename W>
  static float finish(const float* acc, const std::byte* row, const float* x, int64_t i,
                      int64_t n) {
    return finish_pair<W>(_mm256_loadu_ps(acc), row, x, i, n);
  }
};

// tile<F32Weights, 1, 1> without the streaming prefetch: the same chain of 8-lane fused
// multiply-adds and the same epilogue.
float dot_f32(const float* a, const float* b, int64_t n) {
  return dot_one<F32Weights>(reinterpret_cast<const std::byte*>(a), b, n);
}

void axpy(float* y, float a, const float* x, int64_t n) {
  const __m512 av = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i,
                     _mm512_add_ps(_mm512_loadu_ps(y + i), _mm512_mul_ps(av, _mm512_loadu_ps(x + i))));
  for (; i < n; ++i) y[i] += a * x[i];  // -ffp-contract=off: a rounded product, then the sum
}

// The vector type of vec_simd.h's shared element-wise kernels.
struct Zmm {
  using Reg = __m512;
  static constexpr int64_t kLanes = 16;
  static inline Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static inline Reg set1(float v) { return _mm512_set1_ps(v); }
  static inline Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static inline Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static inline Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }
  static inline Reg min(Reg a, Reg b) { return _mm512_min_ps(a, b); }
  static inline Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static inline Reg fnma(Reg a, Reg b, Reg c) { return _mm512_fnmadd_ps(a, b, c); }
  static inline Reg round_even(Reg v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static inline Reg pow2(Reg k) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23));
  }
};

}  // namespace

const KernelSet& avx512_kernels() {
  static const KernelSet set{
      "avx512",
      {&dot_tile<F32Weights>, &dot_tile<F16Weights>, &dot_tile<BF16Weights>},
      {&matmul_block<Avx512Block, F32Weights>, &matmul_block<Avx512Block, F16Weights>,
       &matmul_block<Avx512Block, BF16Weights>},
      &dot_f32,
      &axpy,
      &vec::axpy_rows<Zmm>,
      &quantize_acts_avx2,
      cpu_has_avx512_vnni() ? &qdot_avx512_vnni : &qdot_avx2,
      &vec::exp<Zmm>};
  return set;
}

}  // namespace cleave::cpu::detail

#if defined(CLEAVE_AVX512_EMULATED)
#elif defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#else  // not x86-64 with GCC or clang: there is no AVX-512 set; dispatch never asks for it.

namespace cleave::cpu::detail {
const KernelSet& avx512_kernels() { return generic_kernels(); }
}  // namespace cleave::cpu::detail

#endif
