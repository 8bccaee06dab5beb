// AVX2 + FMA + F16C dot kernels, following the reduction order in kernel_set.h, and the
// micro-kernels of the multi-token matmul (matmul_block.h, as dot_avx512.cpp).
// This file is compiled with -mavx2 -mfma -mf16c -ffp-contract=off (src/engine/CMakeLists.txt);
// nothing here may run unless cpu_has_avx2_kernels() is true.
#include "kernel_set.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "matmul_block.h"
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

// The epilogue of one (row, token) pair whose accumulators cover elements [0, i): the trailing
// 8-chunk into a0, the fixed horizontal sum, then the scalar tail in order.
template <typename W>
inline float finish_pair(__m256 a0, __m256 a1, const std::byte* row, const float* x, int64_t i,
                         int64_t n) {
  if (i + 8 <= n) {
    a0 = _mm256_fmadd_ps(W::load8(row, i), _mm256_loadu_ps(x + i), a0);
    i += 8;
  }
  float s = hsum(a0, a1);
  for (int64_t j = i; j < n; ++j) s = std::fma(W::load1(row, j), x[j], s);
  return s;
}

template <typename W, int R, int T, bool kPrefetch = true>
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
      if constexpr (kPrefetch) pf.fetch(r, W::kBytesPer32 > 64 ? 2 : 1);
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
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      y[t * y_stride + r] =
          finish_pair<W>(a0[r][t], a1[r][t], w + r * row_bytes, x + t * x_stride, i, n);
}

// One token (decode): one row after another, without software prefetch, so that each thread
// reads its rows as one sequential stream that the hardware prefetcher follows. On the 2-vCPU
// Zen 3 (AVX2) host, SmolLM2 F16 decode ran 76-85 tok/s against 68-69 with four rows side by
// side and StreamPrefetch (72-82 with one row and StreamPrefetch), 4 alternated runs. The AVX-512
// set keeps four rows and StreamPrefetch, which measured faster on Zen 4 (stream_prefetch.h).
// Several tokens, register budget (16 ymm): up to 2 rows x 3 tokens (12 accumulators).
template <typename W>
void dot_tile(const std::byte* w, uint64_t row_bytes, int nr, const float* x, int64_t x_stride,
              int nt, int64_t n, float* y, int64_t y_stride) {
  if (nt == 1) {
    for (int r = 0; r < nr; ++r)
      tile<W, 1, 1, false>(w + r * row_bytes, row_bytes, x, x_stride, n, y + r, y_stride);
    return;
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

// ---- Multi-token matmul -------------------------------------------------------------------
//
// matmul_block.h's blocking, with 8-lane vectors. A (row, token) pair needs two accumulators,
// a0 for the first half of each 16-element chunk and a1 for the second; a micro-kernel of
// 4 rows x 3 tokens makes two passes over its chunk, the first
// half of every 16 elements into the a0s, then the second half into the a1s, so that each pass
// holds one register per pair: 12 accumulators, 3 activation vectors and 1 weight vector of 16
// ymm, 7 loads for 12 fused multiply-adds (one pass with both halves would fit 2 x 3 pairs, 10
// loads for 12). Each accumulator still sees its chunks in increasing order, as in tile().
// Between passes the accumulators rest in the driver's array, a0 and a1 side by side.

// One pass: the half h of every 16-element chunk of [k0, k0 + kc) into the pairs' a_h.
template <typename W, int R, int T>
inline void micro_half(const std::byte* w, uint64_t row_bytes, int64_t k0, int64_t kc,
                       const float* x, int64_t x_stride, float* acc, int64_t acc_stride, int h) {
  __m256 a[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      a[r][t] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + (r * acc_stride + t) * 16 + 8 * h);
  for (int64_t k = k0 + 8 * h; k < k0 + kc; k += 16) {
    __m256 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_ps(x + t * x_stride + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = W::load8(w + static_cast<uint64_t>(r) * row_bytes, k);
      for (int t = 0; t < T; ++t) a[r][t] = _mm256_fmadd_ps(wv, xv[t], a[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(acc + (r * acc_stride + t) * 16 + 8 * h, a[r][t]);
}

template <typename W, int R, int T>
void micro(const std::byte* w, uint64_t row_bytes, int64_t k0, int64_t kc, const float* x,
           int64_t x_stride, float* acc, int64_t acc_stride) {
  micro_half<W, R, T>(w, row_bytes, k0, kc, x, x_stride, acc, acc_stride, 0);
  micro_half<W, R, T>(w, row_bytes, k0, kc, x, x_stride, acc, acc_stride, 1);
}

// kMicroFns<W>[R - 1][T - 1]
template <typename W>
constexpr MicroFn kMicroFns[4][3] = {
    {&micro<W, 1, 1>, &micro<W, 1, 2>, &micro<W, 1, 3>},
    {&micro<W, 2, 1>, &micro<W, 2, 2>, &micro<W, 2, 3>},
    {&micro<W, 3, 1>, &micro<W, 3, 2>, &micro<W, 3, 3>},
    {&micro<W, 4, 1>, &micro<W, 4, 2>, &micro<W, 4, 3>},
};

// Lane j: hsum(a0, a1) of the pair at acc + j * stride (a0 then a1): the same additions of the
// same pairs (lane i + lane i + 4 of a0 + a1, then i + 2, then i + 1), for eight pairs at once
// by transposing as the tree narrows.
inline __m256 hsum8(const float* acc, int64_t stride) {
  __m256 v[8];
  for (int j = 0; j < 8; ++j)
    v[j] = _mm256_add_ps(_mm256_loadu_ps(acc + j * stride), _mm256_loadu_ps(acc + j * stride + 8));
  __m256 h[4];  // h[j] = [4 sums of pair j | 4 sums of pair j + 4]
  for (int j = 0; j < 4; ++j)
    h[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[j], v[j + 4], 0x20),
                         _mm256_permute2f128_ps(v[j], v[j + 4], 0x31));
  // g0 = [2 sums of pairs 0, 1 | of 4, 5], g1 = [of 2, 3 | of 6, 7]
  const __m256 g0 = _mm256_add_ps(_mm256_shuffle_ps(h[0], h[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(h[0], h[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 g1 = _mm256_add_ps(_mm256_shuffle_ps(h[2], h[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(h[2], h[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(g0, g1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(g0, g1, _MM_SHUFFLE(3, 1, 3, 1)));
}

struct Avx2Block {
  // Two passes per chunk read the activations twice: 1024 (two chunks for 1536 columns, four for
  // 4096) measured faster than 2048 here.
  static constexpr int64_t kMaxChunk = 1024;
  static constexpr int kMicroRows = 4;
  static constexpr int kMicroTokens = 3;
  static constexpr int kReduceRows = 8;
  template <typename W>
  static MicroFn micro(int mr, int mt) { return kMicroFns<W>[mr - 1][mt - 1]; }
  static void reduce(const float* acc, int64_t stride, float* out) {
    _mm256_storeu_ps(out, hsum8(acc, stride));
  }
  template <typename W>
  static float finish(const float* acc, const std::byte* row, const float* x, int64_t i,
                      int64_t n) {
    return finish_pair<W>(_mm256_loadu_ps(acc), _mm256_loadu_ps(acc + 8), row, x, i, n);
  }
};

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
                             {&matmul_block<Avx2Block, F32Weights>,
                              &matmul_block<Avx2Block, F16Weights>,
                              &matmul_block<Avx2Block, BF16Weights>},
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
