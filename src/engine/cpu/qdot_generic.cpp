// The portable integer path (kernel_set.h): activation quantisation and the block-format dot
// products, written lane by lane so that the SIMD sets can match them bit for bit.
#include <cmath>

#include "cleave/model/quants.h"
#include "kernel_set.h"

namespace cleave::cpu::detail {

void quantize_acts_generic(const float* x, int64_t x_stride, int64_t n_tokens, int64_t n,
                           int64_t group, int8_t* q, float* d, int16_t* sum16, float* sum32) {
  const int64_t nb = n / kQK, ng = n / group;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* xt = x + t * x_stride;
    for (int64_t g = 0; g < ng; ++g) {
      float amax = 0.0f;
      for (int64_t i = 0; i < group; ++i) amax = std::fmax(amax, std::fabs(xt[g * group + i]));
      const float dg = amax / 127.0f;
      const float id = dg != 0.0f ? 1.0f / dg : 0.0f;
      d[t * ng + g] = dg;
      for (int64_t b = g * group / kQK; b < (g + 1) * group / kQK; ++b) {
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
}

namespace {

float hsum8(const float* as) {
  float v4[4], v2[2];
  for (int j = 0; j < 4; ++j) v4[j] = as[j] + as[j + 4];
  for (int j = 0; j < 2; ++j) v2[j] = v4[j] + v4[j + 2];
  return v2[0] + v2[1];
}

float qdot_legacy(const std::byte* row, DType t, const QuantActs& x, int64_t tok) {
  const int64_t nb = x.n / kQK;
  const int8_t* xq = x.q + tok * x.n;
  const float* dx = x.d + tok * nb;
  const float* xs = x.sum32 + tok * nb;
  float as[8] = {}, am = 0.0f;
  IntBlock w;
  for (int64_t b = 0; b < nb; ++b) {
    int_block(t, row, b, &w);
    const int8_t* xb = xq + b * kQK;
    const float ds = w.d * dx[b];
    for (int j = 0; j < 8; ++j) {
      int32_t s = 0;
      for (int k = 0; k < 4; ++k) s += static_cast<int32_t>(w.q[4 * j + k]) * xb[4 * j + k];
      as[j] = std::fma(ds, static_cast<float>(s), as[j]);
    }
    if (w.m != 0.0f) am = std::fma(w.m * dx[b], xs[b], am);
  }
  return hsum8(as) + am;
}

bool has_min(DType t) {
  return t == DType::kQ4_1 || t == DType::kQ5_1 || t == DType::kQ2_K || t == DType::kQ4_K ||
         t == DType::kQ5_K;
}

float qdot_k(const std::byte* row, DType t, const QuantActs& x, int64_t tok) {
  const int64_t nu = x.n / 256;
  const int8_t* xq = x.q + tok * x.n;
  const float* dx = x.d + tok * nu;
  const int16_t* xs = x.sum16 + tok * (x.n / 16);
  const int o = level_offset(t);
  float as[8] = {};
  IntBlock w;
  for (int64_t u = 0; u < nu; ++u) {
    int32_t isum[8] = {}, bsum[8] = {};
    for (int jb = 0; jb < 8; ++jb) {
      int_block(t, row, u * 8 + jb, &w);
      const int8_t* xb = xq + u * 256 + jb * kQK;
      for (int j = 0; j < 8; ++j)
        for (int k = 0; k < 4; ++k)
          isum[j] += w.sc[j / 4] * (static_cast<int32_t>(w.q[4 * j + k]) + o) * xb[4 * j + k];
      // Lane jb of B and of I's offset term takes the super-block's 16-element groups 2 jb and
      // 2 jb + 1: block jb's.
      const int32_t x0 = xs[u * 16 + 2 * jb], x1 = xs[u * 16 + 2 * jb + 1];
      bsum[jb] = w.mn[0] * x0 + w.mn[1] * x1;
      isum[jb] -= o * (w.sc[0] * x0 + w.sc[1] * x1);
    }
    // w.d and w.m are the super-block's, the same for each of its blocks.
    const float ds = w.d * dx[u];
    for (int j = 0; j < 8; ++j) as[j] = std::fma(ds, static_cast<float>(isum[j]), as[j]);
    if (has_min(t)) {
      const float ms = w.m * dx[u];
      for (int j = 0; j < 8; ++j) as[j] = std::fma(ms, static_cast<float>(bsum[j]), as[j]);
    }
  }
  return hsum8(as);
}

}  // namespace

void qdot_generic(DType t, const std::byte* w, uint64_t row_bytes, int64_t nr,
                  const QuantActs& x, int64_t nt, float* y, int64_t y_stride) {
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t tok = 0; tok < nt; ++tok)
      y[tok * y_stride + r] =
          x.group == 256 ? qdot_k(w + static_cast<uint64_t>(r) * row_bytes, t, x, tok)
                         : qdot_legacy(w + static_cast<uint64_t>(r) * row_bytes, t, x, tok);
}

}  // namespace cleave::cpu::detail
