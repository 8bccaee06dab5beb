// The K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): 256-element super-blocks with 6- or 4-bit
// sub-block scales, laid out as ggml's block_q*_K. Element order within a super-block follows
// ggml's dequantize_row_q*_K; int_block_k describes each 32-element block of it.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "quants_k.h"

namespace cleave::detail {
namespace {

int nearest(float v) { return static_cast<int>(std::lround(v)); }
int clampi(int v, int lo, int hi) { return std::min(hi, std::max(lo, v)); }

// Scale and min j (0..7) of the 12-byte Q4_K / Q5_K scale array, as ggml's get_scale_min_k4.
void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void pack_scale_min_k4(const int sc[8], const int m[8], uint8_t* q) {
  std::memset(q, 0, 12);
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      q[j] = static_cast<uint8_t>(sc[j]);
      q[j + 4] = static_cast<uint8_t>(m[j]);
    } else {
      q[j + 4] = static_cast<uint8_t>((sc[j] & 0x0F) | ((m[j] & 0x0F) << 4));
      q[j - 4] = static_cast<uint8_t>(q[j - 4] | ((sc[j] >> 4) << 6));
      q[j] = static_cast<uint8_t>(q[j] | ((m[j] >> 4) << 6));
    }
  }
}

// Biased 6-bit scale j (0..15) of a Q3_K block.
int q3k_scale(const uint8_t* s, int j) {
  const int low = j < 8 ? s[j] & 0x0F : s[j - 8] >> 4;
  const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
  return low | (high << 4);
}

// The scale s >= 0 and min m >= 0 of one sub-block for values s * q - m, q in [0, levels - 1],
// that give the least squared error among a set of candidates: for each candidate step (the
// block's range over levels - 1 + delta, delta in [-1, 1]: a smaller step clips the extremes
// to resolve the bulk better), the levels are rounded and (s, m) refitted by least squares on
// them. delta = 0 is plain range-over-levels rounding, so the result is never worse than it.
struct SubAffine {
  float scale, min;
};
SubAffine fit_sub_affine(const float* x, int n, int levels) {
  float lo = 0.0f, hi = x[0];
  for (int i = 0; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  hi = std::max(hi, lo);
  if (hi == lo) return {0.0f, -lo};
  SubAffine best{(hi - lo) / static_cast<float>(levels - 1), -lo};
  double best_err = -1.0;
  constexpr int kSteps = 20;
  for (int k = 0; k <= kSteps; ++k) {
    const float delta = -1.0f + 2.0f * static_cast<float>(k) / kSteps;
    const float iscale = (static_cast<float>(levels - 1) + delta) / (hi - lo);
    double sq = 0, sx = 0, sqq = 0, sqx = 0;
    int q[32];
    for (int i = 0; i < n; ++i) {
      q[i] = clampi(nearest(iscale * (x[i] - lo)), 0, levels - 1);
      sq += q[i];
      sx += x[i];
      sqq += static_cast<double>(q[i]) * q[i];
      sqx += static_cast<double>(q[i]) * x[i];
    }
    const double det = n * sqq - sq * sq;
    if (det <= 0) continue;
    double sc = (n * sqx - sq * sx) / det;
    double off = (sx - sc * sq) / n;  // x ~ sc * q + off, off = -min <= 0
    if (off > 0) {
      off = 0;
      sc = sqq > 0 ? sqx / sqq : 0;
    }
    if (sc <= 0) continue;
    double err = 0;
    for (int i = 0; i < n; ++i) {
      const double d = sc * q[i] + off - x[i];
      err += d * d;
    }
    if (best_err < 0 || err < best_err) {
      best_err = err;
      best = {static_cast<float>(sc), static_cast<float>(-off)};
    }
  }
  return best;
}

// Sub-block fits to integer sub-scales and mins on one super-block grid: for formats whose
// values are d * sc * q - dmin * m with q in [0, levels - 1] and sc, m in [0, smax].
struct AffineGrid {
  float d, dmin;
  int sc[16], m[16];
};
AffineGrid affine_grid(const float* x, int sub, int nsub, int levels, int smax) {
  float scale[16], min[16], max_scale = 0.0f, max_min = 0.0f;
  for (int j = 0; j < nsub; ++j) {
    const SubAffine f = fit_sub_affine(x + j * sub, sub, levels);
    scale[j] = f.scale;
    min[j] = f.min;
    max_scale = std::max(max_scale, scale[j]);
    max_min = std::max(max_min, min[j]);
  }
  AffineGrid g{};
  g.d = f16_to_f32(f32_to_f16(max_scale / static_cast<float>(smax)));
  g.dmin = f16_to_f32(f32_to_f16(max_min / static_cast<float>(smax)));
  for (int j = 0; j < nsub; ++j) {
    g.sc[j] = g.d > 0.0f ? clampi(nearest(scale[j] / g.d), 0, smax) : 0;
    g.m[j] = g.dmin > 0.0f ? clampi(nearest(min[j] / g.dmin), 0, smax) : 0;
  }
  return g;
}

// Level of x on the grid d * sc * q - dmin * m.
int affine_level(float x, float dl, float ml, int levels) {
  return dl > 0.0f ? clampi(nearest((x + ml) / dl), 0, levels - 1) : 0;
}

// Signed sub-scales for formats whose values are d * sc * q with q in [-half, half - 1] and
// sc in [-smax - 1, smax].
struct SymmetricGrid {
  float d;
  int sc[16];
};
// The scale of one 16-element sub-block for values s * q, q in [-half, half - 1], with the
// least squared error among candidates: the value of largest magnitude mapped onto
// -(half + delta), delta in [-1, 1], levels rounded and s refitted by least squares on them
// (delta = 0 is plain max-over-half rounding, so the result is never worse than it).
float fit_sub_symmetric(const float* x, int half) {
  float amax = 0.0f, max = 0.0f;
  for (int i = 0; i < 16; ++i) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  }
  if (amax == 0.0f) return 0.0f;
  float best = max / -static_cast<float>(half);
  double best_err = -1.0;
  constexpr int kSteps = 20;
  for (int k = 0; k <= kSteps; ++k) {
    const float delta = -1.0f + 2.0f * static_cast<float>(k) / kSteps;
    const float iscale = -(static_cast<float>(half) + delta) / max;
    double sqq = 0, sqx = 0;
    int q[16];
    for (int i = 0; i < 16; ++i) {
      q[i] = clampi(nearest(iscale * x[i]), -half, half - 1);
      sqq += static_cast<double>(q[i]) * q[i];
      sqx += static_cast<double>(q[i]) * x[i];
    }
    if (sqq <= 0) continue;
    const double sc = sqx / sqq;
    double err = 0;
    for (int i = 0; i < 16; ++i) {
      const double d = sc * q[i] - x[i];
      err += d * d;
    }
    if (best_err < 0 || err < best_err) {
      best_err = err;
      best = static_cast<float>(sc);
    }
  }
  return best;
}

SymmetricGrid symmetric_grid(const float* x, int half, int smax) {
  float scale[16], max_scale = 0.0f;
  for (int j = 0; j < 16; ++j) {
    scale[j] = fit_sub_symmetric(x + j * 16, half);
    if (std::fabs(scale[j]) > std::fabs(max_scale)) max_scale = scale[j];
  }
  SymmetricGrid g{};
  g.d = f16_to_f32(f32_to_f16(max_scale / -static_cast<float>(smax + 1)));
  for (int j = 0; j < 16; ++j)
    g.sc[j] = g.d != 0.0f ? clampi(nearest(scale[j] / g.d), -smax - 1, smax) : 0;
  return g;
}

int symmetric_level(float x, float dl, int half) {
  return dl != 0.0f ? clampi(nearest(x / dl), -half, half - 1) : 0;
}

void encode_q2_k(const float* x, std::byte* row, int64_t b) {
  const AffineGrid g = affine_grid(x, 16, 16, 4, 15);
  BlockQ2_K blk{};
  blk.d = f32_to_f16(g.d);
  blk.dmin = f32_to_f16(g.dmin);
  for (int j = 0; j < 16; ++j) blk.scales[j] = static_cast<uint8_t>(g.sc[j] | (g.m[j] << 4));
  for (int i = 0; i < kQK_K; ++i) {
    const int jb = i / 32, l = i % 32, j = i / 16;
    const int q = affine_level(x[i], g.d * static_cast<float>(g.sc[j]),
                               g.dmin * static_cast<float>(g.m[j]), 4);
    blk.qs[32 * (jb / 4) + l] = static_cast<uint8_t>(blk.qs[32 * (jb / 4) + l] | (q << (2 * (jb % 4))));
  }
  store_block(blk, row, b);
}

void encode_q3_k(const float* x, std::byte* row, int64_t b) {
  const SymmetricGrid g = symmetric_grid(x, 4, 31);
  BlockQ3_K blk{};
  blk.d = f32_to_f16(g.d);
  for (int j = 0; j < 16; ++j) {
    const int l = g.sc[j] + 32;
    if (j < 8) {
      blk.scales[j] = static_cast<uint8_t>(l & 0x0F);
    } else {
      blk.scales[j - 8] = static_cast<uint8_t>(blk.scales[j - 8] | ((l & 0x0F) << 4));
    }
    blk.scales[8 + j % 4] = static_cast<uint8_t>(blk.scales[8 + j % 4] | ((l >> 4) << (2 * (j / 4))));
  }
  for (int i = 0; i < kQK_K; ++i) {
    const int jb = i / 32, l = i % 32;
    const int q = symmetric_level(x[i], g.d * static_cast<float>(g.sc[i / 16]), 4) + 4;
    blk.qs[32 * (jb / 4) + l] =
        static_cast<uint8_t>(blk.qs[32 * (jb / 4) + l] | ((q & 3) << (2 * (jb % 4))));
    if (q >= 4) blk.hmask[l] = static_cast<uint8_t>(blk.hmask[l] | (1 << jb));
  }
  store_block(blk, row, b);
}

template <typename B, int kLevels>
void encode_q45_k(const float* x, std::byte* row, int64_t b) {
  const AffineGrid g = affine_grid(x, 32, 8, kLevels, 63);
  B blk{};
  blk.d = f32_to_f16(g.d);
  blk.dmin = f32_to_f16(g.dmin);
  pack_scale_min_k4(g.sc, g.m, blk.scales);
  for (int i = 0; i < kQK_K; ++i) {
    const int jb = i / 32, l = i % 32;
    const int q = affine_level(x[i], g.d * static_cast<float>(g.sc[jb]),
                               g.dmin * static_cast<float>(g.m[jb]), kLevels);
    uint8_t& byte = blk.qs[32 * (jb / 2) + l];
    byte = static_cast<uint8_t>(byte | ((q & 0x0F) << (jb % 2 == 0 ? 0 : 4)));
    if constexpr (kLevels == 32) {
      if (q >= 16) blk.qh[l] = static_cast<uint8_t>(blk.qh[l] | (1 << jb));
    }
  }
  store_block(blk, row, b);
}

void encode_q6_k(const float* x, std::byte* row, int64_t b) {
  const SymmetricGrid g = symmetric_grid(x, 32, 127);
  BlockQ6_K blk{};
  blk.d = f32_to_f16(g.d);
  for (int j = 0; j < 16; ++j) blk.scales[j] = static_cast<int8_t>(g.sc[j]);
  for (int i = 0; i < kQK_K; ++i) {
    const int jb = i / 32, l = i % 32, half = jb / 4, k = jb % 4;
    const int q = symmetric_level(x[i], g.d * static_cast<float>(g.sc[i / 16]), 32) + 32;
    uint8_t& low = blk.ql[64 * half + (k & 1) * 32 + l];
    low = static_cast<uint8_t>(low | ((q & 0x0F) << (k < 2 ? 0 : 4)));
    uint8_t& high = blk.qh[32 * half + l];
    high = static_cast<uint8_t>(high | ((q >> 4) << (2 * k)));
  }
  store_block(blk, row, b);
}

}  // namespace

void encode_k_block(DType t, const float* x, std::byte* row, int64_t b) {
  switch (t) {
    case DType::kQ2_K: return encode_q2_k(x, row, b);
    case DType::kQ3_K: return encode_q3_k(x, row, b);
    case DType::kQ4_K: return encode_q45_k<BlockQ4_K, 16>(x, row, b);
    case DType::kQ5_K: return encode_q45_k<BlockQ5_K, 32>(x, row, b);
    case DType::kQ6_K: return encode_q6_k(x, row, b);
    default: return;
  }
}

void int_block_k(DType t, const std::byte* row, int64_t b, IntBlock* o) {
  const int64_t sb = b / 8;  // super-block
  const int jb = static_cast<int>(b % 8);
  o->m = 0.0f;
  o->mn[0] = o->mn[1] = 0;
  switch (t) {
    case DType::kQ2_K: {
      const auto blk = load_block<BlockQ2_K>(row, sb);
      o->d = f16_to_f32(blk.d);
      o->m = -f16_to_f32(blk.dmin);
      for (int h = 0; h < 2; ++h) {
        o->sc[h] = static_cast<int16_t>(blk.scales[2 * jb + h] & 0x0F);
        o->mn[h] = static_cast<int16_t>(blk.scales[2 * jb + h] >> 4);
      }
      for (int l = 0; l < 32; ++l)
        o->q[l] = static_cast<int8_t>((blk.qs[32 * (jb / 4) + l] >> (2 * (jb % 4))) & 3);
      return;
    }
    case DType::kQ3_K: {
      const auto blk = load_block<BlockQ3_K>(row, sb);
      o->d = f16_to_f32(blk.d);
      for (int h = 0; h < 2; ++h) o->sc[h] = static_cast<int16_t>(q3k_scale(blk.scales, 2 * jb + h) - 32);
      for (int l = 0; l < 32; ++l) {
        const int low = (blk.qs[32 * (jb / 4) + l] >> (2 * (jb % 4))) & 3;
        o->q[l] = static_cast<int8_t>(low - ((blk.hmask[l] >> jb) & 1 ? 0 : 4));
      }
      return;
    }
    case DType::kQ4_K:
    case DType::kQ5_K: {
      // Q4_K and Q5_K share their first 16 bytes (d, dmin, scales) and the qs layout.
      const bool five = t == DType::kQ5_K;
      BlockQ5_K blk;
      if (five) {
        blk = load_block<BlockQ5_K>(row, sb);
      } else {
        const auto b4 = load_block<BlockQ4_K>(row, sb);
        std::memcpy(&blk, &b4, 16);
        std::memcpy(blk.qs, b4.qs, sizeof blk.qs);
        std::memset(blk.qh, 0, sizeof blk.qh);
      }
      int sc = 0, m = 0;
      scale_min_k4(jb, blk.scales, &sc, &m);
      o->d = f16_to_f32(blk.d);
      o->m = -f16_to_f32(blk.dmin);
      o->sc[0] = o->sc[1] = static_cast<int16_t>(sc);
      o->mn[0] = o->mn[1] = static_cast<int16_t>(m);
      for (int l = 0; l < 32; ++l) {
        const uint8_t byte = blk.qs[32 * (jb / 2) + l];
        const int low = jb % 2 == 0 ? byte & 0x0F : byte >> 4;
        o->q[l] = static_cast<int8_t>(low + (((blk.qh[l] >> jb) & 1) << 4));
      }
      return;
    }
    case DType::kQ6_K: {
      const auto blk = load_block<BlockQ6_K>(row, sb);
      const int half = jb / 4, k = jb % 4;
      o->d = f16_to_f32(blk.d);
      for (int h = 0; h < 2; ++h) o->sc[h] = blk.scales[8 * half + 2 * k + h];
      for (int l = 0; l < 32; ++l) {
        const uint8_t low = blk.ql[64 * half + (k & 1) * 32 + l];
        const int q = (k < 2 ? low & 0x0F : low >> 4) | (((blk.qh[32 * half + l] >> (2 * k)) & 3) << 4);
        o->q[l] = static_cast<int8_t>(q - 32);
      }
      return;
    }
    default: return;
  }
}

// As ggml's dequantize_row_q*_K: value = (d * sc) * q - (dmin * m), each product rounded to f32.
void decode_k_block(DType t, const std::byte* row, int64_t b, float* out) {
  for (int jb = 0; jb < 8; ++jb) {
    IntBlock ib;
    int_block_k(t, row, b * 8 + jb, &ib);
    for (int l = 0; l < 32; ++l) {
      const int h = l / 16;
      float v = (ib.d * static_cast<float>(ib.sc[h])) * static_cast<float>(ib.q[l]);
      if (ib.m != 0.0f) v = v - (-ib.m * static_cast<float>(ib.mn[h]));
      out[jb * 32 + l] = v;
    }
  }
}

}  // namespace cleave::detail
