// Internal: the multi-token matmul of the f32/f16/bf16 weights (kernel_set.h, MatmulBlockFn),
// shared by dot_avx512.cpp and dot_avx2.cpp, which include it under their own target flags and
// give it their micro-kernels (internal linkage, as vec_simd.h).
//
// Rows go in blocks of kBlockRows. K is cut into equal chunks of at most K::kMaxChunk elements
// (fewer chunks, fewer trips of the accumulators through memory, as long as a chunk's weights
// and activations stay in cache); for each chunk, micro-kernels of K::kMicroRows rows x
// K::kMicroTokens tokens run over the weights and the tokens' activations, the row group's
// weights staying in L1 while the tokens pass. The micro-kernels read the weights where they
// lie and widen them to f32 as they load (a widening load costs no more than a plain one there,
// and an f16 or bf16 row takes half the cache of an f32 copy; a converted f32 panel measured
// slower). Per (row, token) the 8-lane accumulator lives in a thread-local array between
// chunks (storing and reloading is exact) and sees the 8-element chunks in increasing order, as
// in tile(); the tail and the horizontal sum are tile()'s epilogue.
//
// K supplies:
//   kMaxChunk            the longest K chunk
//   micro<W>(mr, mt)     the micro-kernel for mr <= kMicroRows rows and mt <= kMicroTokens
//                        tokens: MicroFn(w, row_bytes, k0, kc, x, x_stride, acc, acc_stride)
//                        adds elements [k0, k0 + kc) of rows w, w + row_bytes, ... against
//                        x, x + x_stride, ... into the accumulators at acc + (r * acc_stride + t) * 8,
//                        which it starts from zero instead when k0 == 0
//   kReduceRows, reduce(acc, stride, out)  out[j] = the horizontal sum of the accumulator at
//                        acc + j * stride for j < kReduceRows (no tails)
//   finish<W>(acc, row, x, i, n)  one pair's result: its accumulator over [0, i), then the tails
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace cleave::cpu::detail {
namespace {

constexpr int64_t kBlockRows = 16;
// A multiple of both sets' micro-kernel widths (3 and 6 tokens); it bounds the accumulator array
// to kBlockRows x 48 x 32 B. 48 measured faster than 64 and no slower than 32 (prefill, Zen 4).
constexpr int64_t kTokenGroup = 48;

using MicroFn = void (*)(const std::byte* w, uint64_t row_bytes, int64_t k0, int64_t kc,
                         const float* x, int64_t x_stride, float* acc, int64_t acc_stride);

// [kBlockRows][token group][8 lanes], 24 KiB: the calling thread's, never allocated (attention
// calls matmul_block through dot_rows, and allocates nothing after its reserve).
float* block_acc() {
  alignas(64) thread_local float acc[kBlockRows * kTokenGroup * 8];
  return acc;
}

template <class K, class W>
void matmul_block(const std::byte* w, uint64_t row_bytes, int64_t nr, const float* x,
                  int64_t x_stride, int64_t nt, int64_t n, float* y, int64_t y_stride) {
  const int64_t n8 = n & ~int64_t{7};
  const int64_t n_chunks = std::max<int64_t>(1, (n8 + K::kMaxChunk - 1) / K::kMaxChunk);
  const int64_t kChunk = std::max<int64_t>(8, ((n8 + n_chunks - 1) / n_chunks + 7) / 8 * 8);
  const int64_t tg_max = std::min(nt, kTokenGroup);
  float* const acc = block_acc();

  for (int64_t r0 = 0; r0 < nr; r0 += kBlockRows) {
    const int64_t rb = std::min(kBlockRows, nr - r0);
    const std::byte* wb = w + static_cast<uint64_t>(r0) * row_bytes;
    // The next block's weights are fetched into L2 while this one computes, a slice before each
    // micro-kernel call, so that its first micro-kernels find them in cache. (A slice per row
    // group came in bursts that stalled the core: F16 decode at 16 sequences spent 4% of its
    // time on the prefetch instructions.)
    const char* pf = reinterpret_cast<const char*>(wb + static_cast<uint64_t>(rb) * row_bytes);
    const char* const pf_end =
        pf + static_cast<uint64_t>(std::min(kBlockRows, nr - r0 - rb)) * row_bytes;
    const int64_t steps = ((n8 + kChunk - 1) / kChunk) *
                          ((rb + K::kMicroRows - 1) / K::kMicroRows) *
                          ((tg_max + K::kMicroTokens - 1) / K::kMicroTokens);
    const int64_t pf_step = ((pf_end - pf) / std::max<int64_t>(steps, 1) + 127) / 64 * 64;
    for (int64_t t0 = 0; t0 < nt; t0 += kTokenGroup) {
      const int64_t tb = std::min(kTokenGroup, nt - t0);
      const float* xg = x + t0 * x_stride;
      if (n8 == 0) std::fill(acc, acc + rb * tb * 8, 0.0f);  // no chunk starts them
      for (int64_t k0 = 0; k0 < n8; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, n8 - k0);
        for (int64_t rg = 0; rg < rb; rg += K::kMicroRows) {
          const int mr = static_cast<int>(std::min<int64_t>(K::kMicroRows, rb - rg));
          for (int64_t tg = 0; tg < tb; tg += K::kMicroTokens) {
            for (const char* stop = std::min(pf + pf_step, pf_end); pf < stop; pf += 64)
              _mm_prefetch(pf, _MM_HINT_T1);
            const int mt = static_cast<int>(std::min<int64_t>(K::kMicroTokens, tb - tg));
            K::template micro<W>(mr, mt)(wb + static_cast<uint64_t>(rg) * row_bytes, row_bytes, k0,
                                         kc, xg + tg * x_stride, x_stride,
                                         acc + (rg * tb + tg) * 8, tb);
          }
        }
      }
      int64_t r_done = 0;
      if (n8 == n) {  // no tails: K::kReduceRows rows of a token reduce together
        for (; r_done + K::kReduceRows <= rb; r_done += K::kReduceRows)
          for (int64_t t = 0; t < tb; ++t)
            K::reduce(acc + (r_done * tb + t) * 8, tb * 8, y + (t0 + t) * y_stride + r0 + r_done);
      }
      for (int64_t r = r_done; r < rb; ++r) {
        const std::byte* row = wb + static_cast<uint64_t>(r) * row_bytes;
        for (int64_t t = 0; t < tb; ++t)
          y[(t0 + t) * y_stride + r0 + r] =
              K::template finish<W>(acc + (r * tb + t) * 8, row, xg + t * x_stride, n8, n);
      }
    }
  }
}

}  // namespace
}  // namespace cleave::cpu::detail
