// AVX2 + FMA + F16C dot kernels, following the reduction order in kernel_set.h.
// This file is compiled with -mavx2 -mfma -mf16c -ffp-contract=off (src/engine/CMakeLists.txt);
// nothing here may run unless cpu_has_avx2_kernels() is true.
#include "kernel_set.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "stream_prefetch.h"
#include "vec_simd.h"

namespace cleave::cpu::detail {
namespace {

inline uint16_t load_u16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// load32(row, i, w) fills w[0..3] with elements [i, i+32), 8 per vector; the default is two
// load16 calls. The main loop consumes them in the same order as two 16-element steps.
template <typename Self>
struct Load32ByHalves {
  static inline void load32(const std::byte* row, int64_t i, __m256* w) {
    Self::load16(row, i, w[0], w[1]);
    Self::load16(row, i + 16, w[2], w[3]);
  }
};

struct F32Weights : Load32ByHalves<F32Weights> {
  static constexpr int64_t kBytesPer32 = 128;
  static inline void load16(const std::byte* row, int64_t i, __m256& w0, __m256& w1) {
    const float* p = reinterpret_cast<const float*>(row) + i;
    w0 = _mm256_loadu_ps(p);
    w1 = _mm256_loadu_ps(p + 8);
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

struct F16Weights : Load32ByHalves<F16Weights> {
  static constexpr int64_t kBytesPer32 = 64;
  static inline void load16(const std::byte* row, int64_t i, __m256& w0, __m256& w1) {
    const std::byte* p = row + i * 2;
    w0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
  static inline __m256 load8(const std::byte* row, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i * 2)));
  }
  static inline float load1(const std::byte* row, int64_t i) {
    return _cvtsh_ss(load_u16(row + i * 2));
  }
};

struct BF16Weights : Load32ByHalves<BF16Weights> {
  static constexpr int64_t kBytesPer32 = 64;
  static inline __m256 widen(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline void load16(const std::byte* row, int64_t i, __m256& w0, __m256& w1) {
    const std::byte* p = row + i * 2;
    w0 = widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w1 = widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
  static inline __m256 load8(const std::byte* row, int64_t i) {
    return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i * 2)));
  }
  static inline float load1(const std::byte* row, int64_t i) {
    return bf16_to_f32(load_u16(row + i * 2));
  }
};

// The fixed horizontal sum: 8 -> 4 -> 2 -> 1 lanes.
inline float hsum(__m256 a0, __m256 a1) {
  const __m256 v = _mm256_add_ps(a0, a1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}

template <typename W, int R, int T>
inline void tile(const std::byte* w, uint64_t row_bytes, const float* x, int64_t x_stride,
                 int64_t n, float* y, int64_t y_stride) {
  __m256 a0[R][T], a1[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) a0[r][t] = a1[r][t] = _mm256_setzero_ps();
  int64_t i = 0;
  // Two 16-element steps per iteration (a0, a1, a0, a1): the same sequence as the loop below.
  // The dequantising loads keep the core's out-of-order window busy, so too few cache misses
  // stay in flight for the bandwidth without explicit prefetches (stream_prefetch.h).
  StreamPrefetch pf(w, row_bytes, R);
  for (; i + 32 <= n; i += 32, pf.advance(W::kBytesPer32)) {
    for (int r = 0; r < R; ++r) {
      __m256 wv[4];
      pf.fetch(r, W::kBytesPer32 > 64 ? 2 : 1);
      W::load32(w + r * row_bytes, i, wv);
      for (int t = 0; t < T; ++t) {
        const float* xt = x + t * x_stride + i;
        a0[r][t] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xt), a0[r][t]);
        a1[r][t] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xt + 8), a1[r][t]);
        a0[r][t] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xt + 16), a0[r][t]);
        a1[r][t] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xt + 24), a1[r][t]);
      }
    }
  }
  for (; i + 16 <= n; i += 16) {
    for (int r = 0; r < R; ++r) {
      __m256 w0, w1;
      W::load16(w + r * row_bytes, i, w0, w1);
      for (int t = 0; t < T; ++t) {
        const float* xt = x + t * x_stride + i;
        a0[r][t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt), a0[r][t]);
        a1[r][t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt + 8), a1[r][t]);
      }
    }
  }
  if (i + 8 <= n) {
    for (int r = 0; r < R; ++r) {
      const __m256 w0 = W::load8(w + r * row_bytes, i);
      for (int t = 0; t < T; ++t)
        a0[r][t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * x_stride + i), a0[r][t]);
    }
    i += 8;
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      float s = hsum(a0[r][t], a1[r][t]);
      for (int64_t j = i; j < n; ++j)
        s = std::fma(W::load1(w + r * row_bytes, j), x[t * x_stride + j], s);
      y[t * y_stride + r] = s;
    }
  }
}

// Register budget (16 ymm): single token, up to 4 rows (8 accumulators); several tokens, up to
// 2 rows x 3 tokens (12 accumulators).
template <typename W>
void dot_tile(const std::byte* w, uint64_t row_bytes, int nr, const float* x, int64_t x_stride,
              int nt, int64_t n, float* y, int64_t y_stride) {
  if (nt == 1) {
    switch (nr) {
      case 1: tile<W, 1, 1>(w, row_bytes, x, x_stride, n, y, y_stride); return;
      case 2: tile<W, 2, 1>(w, row_bytes, x, x_stride, n, y, y_stride); return;
      case 3: tile<W, 3, 1>(w, row_bytes, x, x_stride, n, y, y_stride); return;
      default: tile<W, 4, 1>(w, row_bytes, x, x_stride, n, y, y_stride); return;
    }
  }
  for (int r = 0; r < nr; r += 2) {
    const std::byte* wr = w + r * row_bytes;
    const bool pair = r + 1 < nr;
    for (int t = 0; t < nt; t += 3) {
      const float* xt = x + t * x_stride;
      float* yt = y + t * y_stride + r;
      switch ((nt - t >= 3 ? 3 : nt - t) + (pair ? 10 : 0)) {
        case 1: tile<W, 1, 1>(wr, row_bytes, xt, x_stride, n, yt, y_stride); break;
        case 2: tile<W, 1, 2>(wr, row_bytes, xt, x_stride, n, yt, y_stride); break;
        case 3: tile<W, 1, 3>(wr, row_bytes, xt, x_stride, n, yt, y_stride); break;
        case 11: tile<W, 2, 1>(wr, row_bytes, xt, x_stride, n, yt, y_stride); break;
        case 12: tile<W, 2, 2>(wr, row_bytes, xt, x_stride, n, yt, y_stride); break;
        default: tile<W, 2, 3>(wr, row_bytes, xt, x_stride, n, yt, y_stride); break;
      }
    }
  }
}

// The vector type of vec_simd.h's shared element-wise kernels.
struct Ymm {
  using Reg = __m256;
  static constexpr int64_t kLanes = 8;
  static inline Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static inline Reg set1(float v) { return _mm256_set1_ps(v); }
  static inline Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static inline Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static inline Reg max(Reg a, Reg b) { return _mm256_max_ps(a, b); }
  static inline Reg min(Reg a, Reg b) { return _mm256_min_ps(a, b); }
  static inline Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static inline Reg fnma(Reg a, Reg b, Reg c) { return _mm256_fnmadd_ps(a, b, c); }
  static inline Reg round_even(Reg v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static inline Reg pow2(Reg k) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
  }
};

}  // namespace

const KernelSet& avx2_kernels() {
  static const KernelSet set{"avx2",
                             {&dot_tile<F32Weights>, &dot_tile<F16Weights>,
                              &dot_tile<BF16Weights>},
                             {nullptr, nullptr, nullptr, nullptr},
                             nullptr,
                             nullptr,
                             &vec::axpy_rows<Ymm>,
                             &quantize_acts_avx2,
                             &qdot_avx2,
                             &vec::exp<Ymm>};
  return set;
}

}  // namespace cleave::cpu::detail

#else  // not x86: there is no AVX2 set; dispatch never asks for it.

namespace cleave::cpu::detail {
const KernelSet& avx2_kernels() { return generic_kernels(); }
}  // namespace cleave::cpu::detail

#endif
