// The portable integer path (kernel_set.h): activation quantisation and the block-format dot
// products, written lane by lane so that the SIMD sets can match them bit for bit.
#include <cmath>

#include "cleave/model/quants.h"
#include "kernel_set.h"

namespace cleave::cpu::detail {

void quantize_acts_generic(const float* x, int64_t x_stride, int64_t n_tokens, int64_t n,
                           int8_t* q, float* d, int16_t* sum16, float* sum32) {
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
      int total = 0;
      for (int h = 0; h < 2; ++h) {
        int sum = 0;
        for (int i = 0; i < 16; ++i) sum += qb[16 * h + i];
        sum16[t * (n / 16) + 2 * b + h] = static_cast<int16_t>(sum);
        total += sum;
      }
      sum32[t * nb + b] = static_cast<float>(total);
    }
  }
}

namespace {

float qdot_one(DType t, const std::byte* row, const QuantActs& x, int64_t tok) {
  const int64_t nb = x.n / kQK;
  const int8_t* xq = x.q + tok * x.n;
  const float* dx = x.d + tok * nb;
  const int16_t* xs = x.sum16 + tok * (x.n / 16);
  const bool sub16 = sub16_scales(t);
  float as[8] = {}, am = 0.0f;
  IntBlock w;
  for (int64_t b = 0; b < nb; ++b) {
    int_block(t, row, b, &w);
    const int8_t* xb = xq + b * kQK;
    const float ds = sub16 ? w.d * dx[b] : (w.d * static_cast<float>(w.sc[0])) * dx[b];
    for (int j = 0; j < 8; ++j) {
      int32_t s = 0;
      for (int k = 0; k < 4; ++k) s += static_cast<int32_t>(w.q[4 * j + k]) * xb[4 * j + k];
      if (sub16) s *= w.sc[j / 4];
      as[j] = std::fma(ds, static_cast<float>(s), as[j]);
    }
    if (w.m != 0.0f) {
      const int32_t u = w.mn[0] * xs[2 * b] + w.mn[1] * xs[2 * b + 1];
      am = std::fma(w.m * dx[b], static_cast<float>(u), am);
    }
  }
  float v4[4], v2[2];
  for (int j = 0; j < 4; ++j) v4[j] = as[j] + as[j + 4];
  for (int j = 0; j < 2; ++j) v2[j] = v4[j] + v4[j + 2];
  return (v2[0] + v2[1]) + am;
}

}  // namespace

void qdot_generic(DType t, const std::byte* w, uint64_t row_bytes, int64_t nr,
                  const QuantActs& x, int64_t nt, float* y, int64_t y_stride) {
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t tok = 0; tok < nt; ++tok)
      y[tok * y_stride + r] = qdot_one(t, w + static_cast<uint64_t>(r) * row_bytes, x, tok);
}

}  // namespace cleave::cpu::detail
