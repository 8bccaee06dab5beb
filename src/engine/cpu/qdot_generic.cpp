// The portable integer path (kernel_set.h): activation quantisation and the block-format dot
// products, written lane by lane so that the SIMD sets can match them bit for bit.
#include <cmath>

#include "cleave/model/quants.h"
#include "kernel_set.h"

namespace cleave::cpu::detail {

void quantize_acts_generic(const float* x, int64_t x_stride, int64_t n_tokens, int64_t n,
                           int8_t* q, float* d, int16_t* psum) {
  const int64_t nb = n / kQK;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* xt = x + t * x_stride;
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0.0f;
      for (int i = 0; i < kQK; ++i) amax = std::fmax(amax, std::fabs(xt[b * kQK + i]));
      const float db = amax / 127.0f;
      const float id = db != 0.0f ? 1.0f / db : 0.0f;
      d[t * nb + b] = db;
      int8_t* qb = q + t * n + b * kQK;
      for (int i = 0; i < kQK; ++i)
        qb[i] = static_cast<int8_t>(static_cast<int>(std::nearbyint(xt[b * kQK + i] * id)));
      int16_t* pb = psum + t * (n / 2) + b * (kQK / 2);
      for (int i = 0; i < kQK / 2; ++i)
        pb[i] = static_cast<int16_t>(qb[2 * i] + qb[2 * i + 1]);
    }
  }
}

namespace {

float qdot_one(DType t, const std::byte* row, const QuantActs& x, int64_t tok) {
  const int64_t nb = x.n / kQK;
  const int8_t* xq = x.q + tok * x.n;
  const float* dx = x.d + tok * nb;
  float as[8] = {}, am[8] = {};
  IntBlock w;
  for (int64_t b = 0; b < nb; ++b) {
    int_block(t, row, b, &w);
    const int8_t* xb = xq + b * kQK;
    const float ds = w.d * dx[b];
    const float dm = w.m * dx[b];
    for (int j = 0; j < 8; ++j) {
      int32_t s = 0, u = 0;
      for (int k = 0; k < 4; ++k) {
        s += static_cast<int32_t>(w.q[4 * j + k]) * xb[4 * j + k];
        u += xb[4 * j + k];
      }
      as[j] = std::fma(ds, static_cast<float>(s * w.sc[j / 4]), as[j]);
      if (w.m != 0.0f) am[j] = std::fma(dm, static_cast<float>(u * w.mn[j / 4]), am[j]);
    }
  }
  float v8[8], v4[4], v2[2];
  for (int j = 0; j < 8; ++j) v8[j] = as[j] + am[j];
  for (int j = 0; j < 4; ++j) v4[j] = v8[j] + v8[j + 4];
  for (int j = 0; j < 2; ++j) v2[j] = v4[j] + v4[j + 2];
  return v2[0] + v2[1];
}

}  // namespace

void qdot_generic(DType t, const std::byte* w, uint64_t row_bytes, int64_t nr,
                  const QuantActs& x, int64_t nt, float* y, int64_t y_stride) {
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t tok = 0; tok < nt; ++tok)
      y[tok * y_stride + r] = qdot_one(t, w + static_cast<uint64_t>(r) * row_bytes, x, tok);
}

}  // namespace cleave::cpu::detail
