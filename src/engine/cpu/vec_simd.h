// Internal: the element-wise kernels that the AVX2 and AVX-512 sets share, written once over a
// vector type V and included by dot_avx2.cpp (V = 8 lanes) and dot_avx512.cpp (V = 16 lanes),
// each with its own target flags; everything here has internal linkage, so each includer gets
// code for its own instruction set. Every lane does the same IEEE operations as the portable
// code, so the results do not depend on the width.
//
// V supplies: Reg, kLanes, load, store, set1, add, mul, max, min (the second operand when either
// is NaN, as maxps/minps), fma(a, b, c) = a * b + c and fnma = c - a * b rounded once,
// round_even (to the nearest integer, ties to even) and pow2(k) (2^k for integral k in
// [-126, 127]).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernel_set.h"

namespace cleave::cpu::detail::vec {
namespace {

// C vectors of H outputs at element i: per row r in order, the row's C vectors are loaded once
// and added into each output o as a[o * a_stride + r] times them (mul, then add: axpy's rounded
// product and rounded sum), the outputs held in registers across the rows.
template <class V, int H, int C>
[[gnu::always_inline]] inline void axpy_block(float* y, int64_t y_stride, const float* a,
                                              int64_t a_stride, const float* rows, int64_t stride,
                                              int64_t n_rows, int64_t i) {
  constexpr int64_t L = V::kLanes;
  typename V::Reg acc[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = V::load(y + h * y_stride + i + c * L);
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* x = rows + r * stride + i;
    typename V::Reg xv[C];
    for (int c = 0; c < C; ++c) xv[c] = V::load(x + c * L);
    for (int h = 0; h < H; ++h) {
      const typename V::Reg av = V::set1(a[h * a_stride + r]);
      for (int c = 0; c < C; ++c) acc[h][c] = V::add(acc[h][c], V::mul(av, xv[c]));
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) V::store(y + h * y_stride + i + c * L, acc[h][c]);
}

// H outputs over all n elements: C vectors at a time, then the leftover vectors, then
// the scalar tail, each element the same operations in the same row order.
template <class V, int H>
void axpy_outputs(float* y, int64_t y_stride, const float* a, int64_t a_stride, const float* rows,
                  int64_t stride, int64_t n_rows, int64_t n) {
  // Three outputs x 3 ymm (x 4 zmm): 9 (12) independent add chains per row, which keeps both
  // add ports busy past the add latency, in 14 (18) registers; one or two outputs, 4 vectors.
  constexpr int C = V::kLanes >= 16 || H < 3 ? 4 : 3;
  constexpr int64_t L = V::kLanes;
  int64_t i = 0;
  for (; i + C * L <= n; i += C * L)
    axpy_block<V, H, C>(y, y_stride, a, a_stride, rows, stride, n_rows, i);
  const int64_t tail = (n - i) / L;  // whole vectors left (fewer than C)
  switch (tail) {
    case 3:
      if constexpr (C > 3) axpy_block<V, H, 3>(y, y_stride, a, a_stride, rows, stride, n_rows, i);
      break;
    case 2:
      axpy_block<V, H, 2>(y, y_stride, a, a_stride, rows, stride, n_rows, i);
      break;
    case 1:
      axpy_block<V, H, 1>(y, y_stride, a, a_stride, rows, stride, n_rows, i);
      break;
    default:
      break;
  }
  i += tail * L;
  for (int h = 0; h < H; ++h) {
    float* yh = y + h * y_stride;
    for (int64_t k = i; k < n; ++k) {
      float v = yh[k];
      for (int64_t r = 0; r < n_rows; ++r) v += a[h * a_stride + r] * rows[r * stride + k];
      yh[k] = v;
    }
  }
}

// axpy of each row in turn into each of n_y outputs (kernel_set.h, AxpyRowsFn): the outputs three
// at a time, so that each row is loaded once for three of them.
template <class V>
void axpy_rows(float* y, int64_t y_stride, const float* a, int64_t a_stride, int64_t n_y,
               const float* rows, int64_t stride, int64_t n_rows, int64_t n) {
  for (int64_t o = 0; o < n_y; o += 3) {
    float* yo = y + o * y_stride;
    const float* ao = a + o * a_stride;
    switch (std::min<int64_t>(3, n_y - o)) {
      case 1:
        axpy_outputs<V, 1>(yo, y_stride, ao, a_stride, rows, stride, n_rows, n);
        break;
      case 2:
        axpy_outputs<V, 2>(yo, y_stride, ao, a_stride, rows, stride, n_rows, n);
        break;
      default:
        axpy_outputs<V, 3>(yo, y_stride, ao, a_stride, rows, stride, n_rows, n);
        break;
    }
  }
}

// exp_ref (kernel_set.h) lane by lane: the same operations in the same order; the tail uses
// exp_ref itself.
template <class V>
void exp(const float* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) {
    // A NaN lane is the second operand of both, so it stays NaN through every step below.
    typename V::Reg v = V::min(V::set1(kExpHi), V::max(V::set1(kExpLo), V::load(x + i)));
    const typename V::Reg k = V::round_even(V::mul(v, V::set1(kLog2e)));
    typename V::Reg r = V::fnma(k, V::set1(kExpC1), v);
    r = V::fnma(k, V::set1(kExpC2), r);
    typename V::Reg p = V::set1(kExpP[0]);
    for (int j = 1; j < 6; ++j) p = V::fma(p, r, V::set1(kExpP[j]));
    const typename V::Reg y = V::add(V::fma(p, V::mul(r, r), r), V::set1(1.0f));
    V::store(out + i, V::mul(y, V::pow2(k)));
  }
  for (; i < n; ++i) out[i] = exp_ref(x[i]);
}

}  // namespace
}  // namespace cleave::cpu::detail::vec
