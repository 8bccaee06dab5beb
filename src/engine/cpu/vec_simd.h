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

#include <cstdint>

#include "kernel_set.h"

namespace cleave::cpu::detail::vec {
namespace {

// axpy of each row in turn, y held in registers across the rows: per element the same rounded
// product and rounded sum as axpy, row after row.
template <class V>
void axpy_rows(float* y, const float* a, const float* rows, int64_t stride, int64_t n_rows,
               int64_t n) {
  constexpr int64_t L = V::kLanes;
  int64_t i = 0;
  for (; i + 4 * L <= n; i += 4 * L) {
    typename V::Reg y0 = V::load(y + i), y1 = V::load(y + i + L), y2 = V::load(y + i + 2 * L),
                    y3 = V::load(y + i + 3 * L);
    for (int64_t r = 0; r < n_rows; ++r) {
      const typename V::Reg av = V::set1(a[r]);
      const float* x = rows + r * stride + i;
      y0 = V::add(y0, V::mul(av, V::load(x)));
      y1 = V::add(y1, V::mul(av, V::load(x + L)));
      y2 = V::add(y2, V::mul(av, V::load(x + 2 * L)));
      y3 = V::add(y3, V::mul(av, V::load(x + 3 * L)));
    }
    V::store(y + i, y0);
    V::store(y + i + L, y1);
    V::store(y + i + 2 * L, y2);
    V::store(y + i + 3 * L, y3);
  }
  for (; i + L <= n; i += L) {
    typename V::Reg y0 = V::load(y + i);
    for (int64_t r = 0; r < n_rows; ++r)
      y0 = V::add(y0, V::mul(V::set1(a[r]), V::load(rows + r * stride + i)));
    V::store(y + i, y0);
  }
  for (; i < n; ++i) {
    float v = y[i];
    for (int64_t r = 0; r < n_rows; ++r) v += a[r] * rows[r * stride + i];
    y[i] = v;
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
