// K/V element stores and loads for f32, f16 and bf16 KV pools (see kv_convert.h).
#include "kv_convert.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CLEAVE_KV_X86 1
#endif

#include "kernel_set.h"

namespace cleave::cpu {
namespace {

void load_f16_generic(const std::byte* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, sizeof h);
    dst[i] = f16_to_f32(h);
  }
}

#ifdef CLEAVE_KV_X86
// F16C converts exactly, as f16_to_f32 does.
__attribute__((target("avx2,f16c"))) void load_f16_f16c(const std::byte* src, float* dst,
                                                         int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  load_f16_generic(src + 2 * i, dst + i, n - i);
}

// The AVX2 kernel set's check (AVX2, FMA and F16C, F16C through cpuid: clang's
// __builtin_cpu_supports does not know "f16c").
bool have_f16c() { return detail::cpu_has_avx2_kernels(); }
#endif

}  // namespace

bool kv_dtype_supported(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}

size_t kv_element_bytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

void kv_store(DType dtype, const float* src, std::byte* dst, int64_t n) {
  switch (dtype) {
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_f16(src[i]);
        std::memcpy(dst + 2 * i, &h, sizeof h);
      }
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_bf16(src[i]);
        std::memcpy(dst + 2 * i, &h, sizeof h);
      }
      return;
    default:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
  }
}

void kv_load(DType dtype, const std::byte* src, float* dst, int64_t n) {
  switch (dtype) {
    case DType::kF16:
#ifdef CLEAVE_KV_X86
      if (have_f16c()) {
        load_f16_f16c(src, dst, n);
        return;
      }
#endif
      load_f16_generic(src, dst, n);
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, sizeof h);
        const uint32_t u = static_cast<uint32_t>(h) << 16;
        std::memcpy(dst + i, &u, sizeof u);
      }
      return;
    default:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
  }
}

}  // namespace cleave::cpu
