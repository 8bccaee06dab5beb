// AVX2 + FMA + F16C dot kernels, following the reduction order in kernel_set.h, and the
// micro-kernels of the multi-token matmul (matmul_block.h, as dot_avx512.cpp).
// This file is compiled with -mavx2 -mfma -mf16c -ffp-contract=off (src/engine/CMakeLists.txt);
// nothing here may run unless cpu_has_avx2_kernels() is true.
#include "kernel_set.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "dot_simd.h"
#include "matmul_block.h"
#include "stream_prefetch.h"
#include "vec_simd.h"

namespace cleave::cpu::detail {
namespace {

// One 8-element chunk k of R rows (rows[r]) against T tokens (x + t * x_stride): the tokens'
// activations loaded once, then per row one widening load and T fused multiply-adds into
// a[r][t]. Every kernel here is a loop of this step, so each (row, token) accumulator sees the
// chunks in increasing order (kernel_set.h).
template <typename W, int R, int T>
[[gnu::always_inline]] inline void step(const std::byte* const* rows, const float* x,
                                        int64_t x_stride, int64_t k, __m256 (&a)[R][T]) {
  __m256 xv[T];
  for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_ps(x + t * x_stride + k);
  for (int r = 0; r < R; ++r) {
    const __m256 wv = W::load8(rows[r], k);
    for (int t = 0; t < T; ++t) a[r][t] = _mm256_fmadd_ps(wv, xv[t], a[r][t]);
  }
}

// R rows from w, `apart` bytes apart (row_bytes: consecutive rows).
template <int R>
struct StridedRows {
  const std::byte* row[R];
  StridedRows(const std::byte* w, uint64_t apart) {
    for (int r = 0; r < R; ++r) row[r] = w + static_cast<uint64_t>(r) * apart;
  }
};

// R rows x T tokens of a several-token call straight from the weights (attention, small calls),
// with the streaming prefetch (stream_prefetch.h): the dequantising loads keep the core's
// out-of-order window busy, so too few cache misses stay in flight without it.
template <typename W, int R, int T>
inline void tile(const std::byte* w, uint64_t row_bytes, const float* x, int64_t x_stride,
                 int64_t n, float* y, int64_t y_stride) {
  const StridedRows<R> rows(w, row_bytes);
  __m256 a[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) a[r][t] = _mm256_setzero_ps();
  int64_t i = 0;
  StreamPrefetch pf(w, row_bytes, R);
  for (; i + 32 <= n; i += 32, pf.advance(4 * W::kBytesPer8)) {
    for (int r = 0; r < R; ++r) pf.fetch(r, W::kBytesPer8 > 16 ? 2 : 1);
    for (int c = 0; c < 32; c += 8) step<W, R, T>(rows.row, x, x_stride, i + c, a);
  }
  for (; i + 8 <= n; i += 8) step<W, R, T>(rows.row, x, x_stride, i, a);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      y[t * y_stride + r] = finish_pair<W>(a[r][t], rows.row[r], x + t * x_stride, i, n);
}

// S rows `apart` bytes apart from w, one token, y[s] = dot(row s, x), without software
// prefetch: one accumulator chain per row, S chains side by side, each row read front to back.
template <typename W, int S>
inline void rows_apart(const std::byte* w, uint64_t apart, const float* x, int64_t n, float* y) {
  const StridedRows<S> rows(w, apart);
  __m256 a[S][1];
  for (int s = 0; s < S; ++s) a[s][0] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int c = 0; c < 32; c += 8) step<W, S, 1>(rows.row, x, 0, i + c, a);
  for (; i + 8 <= n; i += 8) step<W, S, 1>(rows.row, x, 0, i, a);
  for (int s = 0; s < S; ++s) y[s] = finish_pair<W>(a[s][0], rows.row[s], x, i, n);
}

// One token alone (attention, single rows; decode's matmul takes matvec below): the R rows side
// by side (rows_apart). Several tokens: tiles of up to R rows x 3 tokens (12 accumulators of the
// 16 ymm).
template <typename W, int R>
inline void tile_rows(const std::byte* w, uint64_t row_bytes, const float* x, int64_t x_stride,
                      int nt, int64_t n, float* y, int64_t y_stride) {
  if (nt == 1) return rows_apart<W, R>(w, row_bytes, x, n, y);
  for (int t = 0; t < nt; t += 3) {
    const float* xt = x + t * x_stride;
    float* yt = y + t * y_stride;
    switch (nt - t) {
      case 1: tile<W, R, 1>(w, row_bytes, xt, x_stride, n, yt, y_stride); break;
      case 2: tile<W, R, 2>(w, row_bytes, xt, x_stride, n, yt, y_stride); break;
      default: tile<W, R, 3>(w, row_bytes, xt, x_stride, n, yt, y_stride); break;
    }
  }
}

template <typename W>
void dot_tile(const std::byte* w, uint64_t row_bytes, int nr, const float* x, int64_t x_stride,
              int nt, int64_t n, float* y, int64_t y_stride) {
  switch (nr) {
    case 1: return tile_rows<W, 1>(w, row_bytes, x, x_stride, nt, n, y, y_stride);
    case 2: return tile_rows<W, 2>(w, row_bytes, x, x_stride, nt, n, y, y_stride);
    case 3: return tile_rows<W, 3>(w, row_bytes, x, x_stride, nt, n, y, y_stride);
    default: return tile_rows<W, 4>(w, row_bytes, x, x_stride, nt, n, y, y_stride);
  }
}

// Decode's matrix-vector product: decode_runs (dot_simd.h) with kStreams runs, so that each run
// is read as one long sequential stream that the hardware prefetcher follows, and the runs'
// accumulator chains hide each other's latency. On the 2-vCPU Zen 3 host, kernel_bench
// --tokens 1, F16 GB/s at 1 thread: 1 stream 13-15, 2: 17-20, 4: 22-28, 6 and 8 no faster;
// 4 adjacent rows side by side 9-18, the earlier two-accumulator single row 14-18.
constexpr int kStreams = 4;

template <typename W>
void matvec(const std::byte* w, uint64_t row_bytes, int64_t nr, const float* x, int64_t n,
            float* y) {
  decode_runs<kStreams>(w, row_bytes, nr, y,
                        [&]<int S>(const std::byte* wr, uint64_t apart, float* out) {
                          rows_apart<W, S>(wr, apart, x, n, out);
                        });
}

// ---- Multi-token matmul -------------------------------------------------------------------
//
// matmul_block.h's blocking: a micro-kernel of 4 rows x 3 tokens holds one accumulator per
// pair, 12 accumulators, 3 activation vectors and 1 weight vector of the 16 ymm, 7 loads for
// 12 fused multiply-adds per 8 elements. Each accumulator sees its chunks in increasing order,
// as in tile(); between K-chunks it rests in the driver's array.
template <typename W, int R, int T>
void micro(const std::byte* w, uint64_t row_bytes, int64_t k0, int64_t kc, const float* x,
           int64_t x_stride, float* acc, int64_t acc_stride) {
  const StridedRows<R> rows(w, row_bytes);
  __m256 a[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      a[r][t] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + (r * acc_stride + t) * 8);
  for (int64_t k = k0; k < k0 + kc; k += 8) step<W, R, T>(rows.row, x, x_stride, k, a);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(acc + (r * acc_stride + t) * 8, a[r][t]);
}

// kMicroFns<W>[R - 1][T - 1]
template <typename W>
constexpr MicroFn kMicroFns[4][3] = {
    {&micro<W, 1, 1>, &micro<W, 1, 2>, &micro<W, 1, 3>},
    {&micro<W, 2, 1>, &micro<W, 2, 2>, &micro<W, 2, 3>},
    {&micro<W, 3, 1>, &micro<W, 3, 2>, &micro<W, 3, 3>},
    {&micro<W, 4, 1>, &micro<W, 4, 2>, &micro<W, 4, 3>},
};

struct Avx2Block {
  // One chunk up to 4096 columns: the accumulators stay in registers across K. (With two
  // accumulators per pair and two passes per chunk, 1024 had measured faster than 2048.)
  static constexpr int64_t kMaxChunk = 4096;
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
    return finish_pair<W>(_mm256_loadu_ps(acc), row, x, i, n);
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
                             &vec::exp<Ymm>,
                             {&matvec<F32Weights>, &matvec<F16Weights>, &matvec<BF16Weights>}};
  return set;
}

}  // namespace cleave::cpu::detail

#else  // not x86: there is no AVX2 set; dispatch never asks for it.

namespace cleave::cpu::detail {
const KernelSet& avx2_kernels() { return generic_kernels(); }
}  // namespace cleave::cpu::detail

#endif
