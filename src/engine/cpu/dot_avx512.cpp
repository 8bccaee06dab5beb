// AVX-512 kernels: the AVX2 set's reduction order (kernel_set.h) with 16-lane vectors, and the
// micro-kernels of the multi-token matmul (matmul_block.h), which runs every token of the batch
// against each block of weight rows.
//
// Bit-identity with the AVX2 set: the AVX2 kernels keep, per (row, token), a0 for elements
// [16k, 16k+8) and a1 for [16k+8, 16k+16). One 16-lane accumulator over [16k, 16k+16) holds a0 in
// lanes 0-7 and a1 in lanes 8-15, and a 512-bit fused multiply-add is eight-lane FMAs side by
// side, so every lane sees the same sequence of roundings. The trailing 8-chunk goes into the
// low half, then the same horizontal sum and scalar tail as dot_avx2.cpp.
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

#include "matmul_block.h"     // internal linkage only, as vec_simd.h
#include "stream_prefetch.h"  // internal linkage only, as vec_simd.h
#include "vec_simd.h"  // internal linkage only: compiled here for AVX-512

namespace cleave::cpu::detail {
namespace {

inline uint16_t load_u16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// load16(row, i): elements [i, i+16) as f32 (exact); load8 / load1 for the tails.
struct F32Weights {
  static constexpr int64_t kBytesPer16 = 64;
  static inline __m512 load16(const std::byte* row, int64_t i) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + i);
  }
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
  static constexpr int64_t kBytesPer16 = 32;
  static inline __m512 load16(const std::byte* row, int64_t i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i * 2)));
  }
  static inline __m256 load8(const std::byte* row, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i * 2)));
  }
  static inline float load1(const std::byte* row, int64_t i) {
    return _cvtsh_ss(load_u16(row + i * 2));
  }
};

struct BF16Weights {
  static constexpr int64_t kBytesPer16 = 32;
  static inline __m512 load16(const std::byte* row, int64_t i) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i * 2));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline __m256 load8(const std::byte* row, int64_t i) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i * 2));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline float load1(const std::byte* row, int64_t i) {
    return bf16_to_f32(load_u16(row + i * 2));
  }
};

// Finishes one (row, token) dot from its 16-lane accumulator over elements [0, i): the trailing
// 8-chunk into a0 (lanes 0-7), the fixed horizontal sum of a0 + a1 (8 -> 4 -> 2 -> 1), then the
// scalar tail in order. Exactly dot_avx2.cpp's epilogue.
template <typename W>
inline float finish(__m512 acc, const std::byte* row, const float* x, int64_t i, int64_t n) {
  __m256 a0 = _mm512_castps512_ps256(acc);
  const __m256 a1 = _mm512_castps512_ps256(_mm512_shuffle_f32x4(acc, acc, 0xee));
  if (i + 8 <= n) {
    a0 = _mm256_fmadd_ps(W::load8(row, i), _mm256_loadu_ps(x + i), a0);
    i += 8;
  }
  const __m256 v = _mm256_add_ps(a0, a1);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 0x55));
  float s = _mm_cvtss_f32(s4);
  for (int64_t j = i; j < n; ++j) s = std::fma(W::load1(row, j), x[j], s);
  return s;
}

// R rows x T tokens straight from the weights (decode and small calls).
template <typename W, int R, int T>
inline void tile(const std::byte* w, uint64_t row_bytes, const float* x, int64_t x_stride,
                 int64_t n, float* y, int64_t y_stride) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  int64_t i = 0;
  StreamPrefetch pf(w, row_bytes, R);
  for (; i + 32 <= n; i += 32, pf.advance(2 * W::kBytesPer16)) {
    for (int r = 0; r < R; ++r) {
      const std::byte* row = w + r * row_bytes;
      pf.fetch(r, W::kBytesPer16 > 32 ? 2 : 1);
      const __m512 w0 = W::load16(row, i);
      const __m512 w1 = W::load16(row, i + 16);
      for (int t = 0; t < T; ++t) {
        const float* xt = x + t * x_stride + i;
        acc[r][t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt), acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), acc[r][t]);
      }
    }
  }
  for (; i + 16 <= n; i += 16) {
    for (int r = 0; r < R; ++r) {
      const __m512 w0 = W::load16(w + r * row_bytes, i);
      for (int t = 0; t < T; ++t)
        acc[r][t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * x_stride + i), acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      y[t * y_stride + r] = finish<W>(acc[r][t], w + r * row_bytes, x + t * x_stride, i, n);
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

template <typename W, int R, int T>
inline void micro(const std::byte* w, uint64_t row_bytes, int64_t k0, int64_t kc, const float* x,
                  int64_t x_stride, float* acc, int64_t acc_stride) {
  __m512 a[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      a[r][t] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (r * acc_stride + t) * 16);
  for (int64_t k = k0; k < k0 + kc; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = W::load16(w + static_cast<uint64_t>(r) * row_bytes, k);
    for (int t = 0; t < T; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * x_stride + k);
      for (int r = 0; r < R; ++r) a[r][t] = _mm512_fmadd_ps(wv[r], xv, a[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(acc + (r * acc_stride + t) * 16, a[r][t]);
}

// Lane j of the result is finish()'s horizontal sum of a[j] (no tails): the same additions of
// the same pairs (lane i + lane i + 8, then i + 4, i + 2, i + 1), done for 16 accumulators at
// once by transposing as the tree narrows: 15 adds and 29 shuffles for 16 sums instead of 64
// and 48.
inline __m512 hsum16(const __m512 a[16]) {
  __m512 b[8], c[4], d[2];
  for (int m = 0; m < 8; ++m)  // [a2m.lo8 + a2m.hi8 | a2m+1.lo8 + a2m+1.hi8]
    b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
  for (int p = 0; p < 4; ++p)  // quarter k: the four 8 -> 4 sums of accumulator 4p + k
    c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0xDD));
  for (int h = 0; h < 2; ++h)  // quarter k: 4 -> 2 sums of accumulators 8h + k and 8h + 4 + k
    d[h] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * h], c[2 * h + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * h], c[2 * h + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Lane 4k + m: the sum of accumulator k + 4m.
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
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
  // 2048 measured 5-15% faster than 1024 on 576x1536 and level on 4096x4096.
  static constexpr int64_t kMaxChunk = 2048;
  static constexpr int kMicroRows = 4;
  static constexpr int kMicroTokens = 6;  // 24 accumulators + 4 weights + 1 activation of 32 zmm
  static constexpr int kReduceRows = 16;
  template <typename W>
  static MicroFn micro(int mr, int mt) { return kMicroFns<W>[mr - 1][mt - 1]; }
  static void reduce(const float* acc, int64_t stride, float* out) {
    __m512 a[16];
    for (int j = 0; j < 16; ++j) a[j] = _mm512_loadu_ps(acc + j * stride);
    _mm512_storeu_ps(out, hsum16(a));
  }
  template <typename W>
  static float finish(const float* acc, const std::byte* row, const float* x, int64_t i,
                      int64_t n) {
    return ::cleave::cpu::detail::finish<W>(_mm512_loadu_ps(acc), row, x, i, n);
  }
};

// tile<F32Weights, 1, 1> without the streaming prefetch: the same chain of 16-lane FMAs (the
// 32-element steps there are two 16-element steps into the same accumulator) and epilogue.
float dot_f32(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  return finish<F32Weights>(acc, reinterpret_cast<const std::byte*>(a), b, i, n);
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
