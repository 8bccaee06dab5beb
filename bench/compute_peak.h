// The f32 multiply-add rate this machine sustains at the active kernel set's vector width
// (AVX-512: 16 lanes, AVX2: 8), on every thread of a pool. Not measured for the generic set,
// whose portable code has no fixed instruction to measure (flops_per_s stays 0). Prefill is bound
// by multiply-adds as decode is by weight bytes: benches state prefill rates as a fraction of
// this figure, measured in the same run, as they state decode rates against the read bandwidth
// (copy_bandwidth.h).
//
// Each thread runs kChains independent chains of fused multiply-adds (more than an FMA's latency
// times its throughput, so the chains never wait on each other) on values that stay exact, and
// the sum they return is checked against the count of operations: a loop the compiler shortened
// cannot pass for a fast one.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string_view>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "cleave/common/thread_pool.h"

namespace cleave::bench {

struct ComputePeak {
  double flops_per_s = 0;  // 2 flops per lane per fused multiply-add, all threads together
  int lanes = 0;           // f32 lanes per instruction; 0: not measured (generic set)
  int threads = 1;
  bool checked = false;    // every thread's sum matched its operation count
};

namespace peak_detail {

inline constexpr int kChains = 10;
// Per thread and round: kIters multiply-adds of 1 x 1 into each lane of each chain c, which
// starts at c (distinct starts, so that no compiler can merge the chains into one) and so ends
// at exactly c + kIters (below 2^24, where f32 still counts by ones).
inline constexpr int64_t kIters = 16'000'000;

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2,fma"))) inline double chains_avx2(float one) {
  const __m256 x = _mm256_set1_ps(one);
  __m256 a[kChains];
  for (int c = 0; c < kChains; ++c) a[c] = _mm256_set1_ps(static_cast<float>(c));
  for (int64_t i = 0; i < kIters; ++i)
    for (auto& v : a) v = _mm256_fmadd_ps(x, x, v);
  double sum = 0;
  for (auto& v : a) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (float f : lanes) sum += f;
  }
  return sum;
}

__attribute__((target("avx512f"))) inline double chains_avx512(float one) {
  const __m512 x = _mm512_set1_ps(one);
  __m512 a[kChains];
  for (int c = 0; c < kChains; ++c) a[c] = _mm512_set1_ps(static_cast<float>(c));
  for (int64_t i = 0; i < kIters; ++i)
    for (auto& v : a) v = _mm512_fmadd_ps(x, x, v);
  double sum = 0;
  for (auto& v : a) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, v);
    for (float f : lanes) sum += f;
  }
  return sum;
}
#endif

}  // namespace peak_detail

// isa: cpu::kernel_isa() ("avx512", "avx2" or "generic"). Best of `rounds`.
inline ComputePeak measure_fma_peak(ThreadPool& pool, std::string_view isa, int rounds = 5) {
  using namespace peak_detail;
  ComputePeak peak;
  peak.threads = pool.size();
#if defined(__x86_64__) || defined(__i386__)
  peak.lanes = isa == "avx512" ? 16 : isa == "avx2" ? 8 : 0;
#else
  peak.lanes = 0;
#endif
  if (peak.lanes == 0) return peak;
  volatile float one_source = 1.0f;  // not a constant the compiler could fold
  const float one = one_source;
  // The lanes' end values: sum over chains of (c + kIters).
  const double expect = peak.lanes * (kChains * (kChains - 1) / 2.0 +
                                      static_cast<double>(kChains) * static_cast<double>(kIters));
  const double flops = 2.0 * kChains * peak.lanes * static_cast<double>(kIters) * peak.threads;
  std::atomic<int> wrong{0};
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    // One chunk per thread (grain 1): every thread runs its chains at once.
    pool.parallel_for(
        peak.threads,
        [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) {
            double sum = 0;
#if defined(__x86_64__) || defined(__i386__)
            sum = peak.lanes == 16 ? chains_avx512(one) : chains_avx2(one);
#endif
            if (sum != expect) wrong.fetch_add(1);
          }
        },
        1);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    peak.flops_per_s = std::max(peak.flops_per_s, flops / s);
  }
  peak.checked = wrong.load() == 0;
  return peak;
}

}  // namespace cleave::bench
