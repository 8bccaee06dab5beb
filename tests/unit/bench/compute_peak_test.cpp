// bench/compute_peak.h: the FMA peak that kernel_bench states prefill rates against.
#include "compute_peak.h"

#include <gtest/gtest.h>

#include "cleave/common/thread_pool.h"
#include "cleave/engine/cpu_kernels.h"

namespace cleave::bench {
namespace {

// Every thread's chains add up to their operation count (no chain merged or cut short), and the
// rate counts 2 flops per lane per multiply-add of every thread.
TEST(ComputePeakTest, TheActiveSetsPeakIsMeasuredOnEveryThreadAndChecked) {
  ThreadPool pool(2);
  const std::string_view isa = cpu::kernel_isa();
  const ComputePeak peak = measure_fma_peak(pool, isa, 2);
  EXPECT_EQ(peak.threads, 2);
  if (isa == "generic") {
    EXPECT_EQ(peak.lanes, 0);
    EXPECT_EQ(peak.flops_per_s, 0.0);
    return;
  }
  EXPECT_EQ(peak.lanes, isa == "avx512" ? 16 : 8);
  EXPECT_TRUE(peak.checked);
  // Far below any core that runs these instructions (1 GFLOP/s), far above a bogus figure.
  EXPECT_GT(peak.flops_per_s, 1e9);
  EXPECT_LT(peak.flops_per_s, 1e13);
}

// The generic set has no instruction to measure: no figure, so no ratio against it.
TEST(ComputePeakTest, TheGenericSetIsNotMeasured) {
  ThreadPool pool(1);
  const ComputePeak peak = measure_fma_peak(pool, "generic");
  EXPECT_EQ(peak.lanes, 0);
  EXPECT_EQ(peak.flops_per_s, 0.0);
}

}  // namespace
}  // namespace cleave::bench
