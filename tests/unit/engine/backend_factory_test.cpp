// engine.device names and the backend factory (backend.h make_backend), and the KV pool's
// storage split (kv_storage.h): what runs on every machine, with or without a GPU.
#include <gtest/gtest.h>

#include <cstring>

#include "cleave/engine/backend.h"
#include "cleave/engine/gpu_monitor.h"
#include "cleave/kvcache/kv_block_pool.h"

namespace cleave {
namespace {

TEST(BackendFactoryTest, DeviceNames) {
  for (const char* good : {"cpu", "cuda", "cuda:0", "cuda:7"}) EXPECT_TRUE(valid_device_name(good)) << good;
  for (const char* bad : {"", "gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1x", "CPU", "cuda0"}) {
    EXPECT_FALSE(valid_device_name(bad)) << bad;
  }
}

TEST(BackendFactoryTest, CpuGivesTheCpuBackendAndABadNameIsNamed) {
  ThreadPool pool(1, "t");
  auto cpu = make_backend("cpu", pool);
  ASSERT_TRUE(cpu.ok()) << cpu.status().to_string();
  EXPECT_STREQ((*cpu)->name(), "cpu");
  EXPECT_EQ((*cpu)->device(), -1);
  auto bad = make_backend("tpu", pool);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'tpu'"), std::string::npos) << bad.status().to_string();
}

// Without a usable GPU (CI, this machine) a cuda device is refused with the reason; with one, it
// is the CUDA backend.
TEST(BackendFactoryTest, CudaIsTheCudaBackendOrUnavailableWithAReason) {
  ThreadPool pool(1, "t");
  auto be = make_backend("cuda:0", pool);
  if (be.ok()) {
    EXPECT_STREQ((*be)->name(), "cuda");
    EXPECT_EQ((*be)->device(), 0);
    return;
  }
  EXPECT_EQ(be.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(be.status().message().find("cuda"), std::string::npos) << be.status().to_string();
}

TEST(BackendFactoryTest, TheCpuBackendsMemoryIsHostMemoryAndNeedsNoStaging) {
  ThreadPool pool(1, "t");
  auto be = make_backend("cpu", pool);
  ASSERT_TRUE(be.ok());
  auto x = (*be)->alloc(10);
  ASSERT_TRUE(x.ok());
  for (int i = 0; i < 10; ++i) EXPECT_EQ((*x)[i], 0.0f);
  const float v[] = {1.5f, -2.0f};
  auto up = (*be)->upload(v);
  ASSERT_TRUE(up.ok());
  EXPECT_EQ(std::memcmp(*up, v, sizeof v), 0);
  EXPECT_EQ((*be)->to_host(*up, 2), *up);
  auto storage = (*be)->make_kv_storage(4096);
  ASSERT_TRUE(storage.ok());
  EXPECT_EQ((*storage)->device(), -1);
  EXPECT_GE((*storage)->size_bytes(), 4096u);
  auto staging = (*be)->make_kv_staging(**storage);
  ASSERT_FALSE(staging.ok());
  EXPECT_EQ(staging.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*be)->kv_written(3, false));
  EXPECT_TRUE((*be)->check().ok());
}

// The GPU metrics' source: with a GPU and its driver, figures that make sense; without (CI),
// Unavailable with the reason, never a crash.
TEST(GpuMonitorTest, ReadsTheDeviceOrSaysWhyNot) {
  auto m = GpuMonitor::open(0);
  if (m.ok()) {
    auto s = (*m)->sample();
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    EXPECT_GT(s->memory_total, 0u);
    EXPECT_LE(s->memory_used, s->memory_total);
    EXPECT_GE(s->utilization, 0.0);
    EXPECT_LE(s->utilization, 1.0);
    return;
  }
  EXPECT_EQ(m.status().code(), StatusCode::kUnavailable);
  EXPECT_FALSE(m.status().message().empty());
  auto bad = GpuMonitor::open(999);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kUnavailable);
}

TEST(KvStorageTest, APoolOverGivenStorageUsesItAndATooSmallOneIsRefused) {
  KvLayout l;
  l.n_layers = 2;
  l.block_size = 4;
  l.num_blocks = 3;
  l.n_kv_heads = 1;
  l.head_dim = 8;
  auto small = make_host_kv_storage(l.total_bytes() - 1);
  ASSERT_TRUE(small.ok());
  auto refused = KvBlockPool::create(l, std::move(*small));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  auto storage = make_host_kv_storage(l.total_bytes());
  ASSERT_TRUE(storage.ok());
  std::byte* data = (*storage)->data();
  auto pool = KvBlockPool::create(l, std::move(*storage));
  ASSERT_TRUE(pool.ok()) << pool.status().to_string();
  EXPECT_EQ((*pool)->data(), data);
  EXPECT_FALSE((*pool)->storage().on_device());
  auto dflt = KvBlockPool::create(l);
  ASSERT_TRUE(dflt.ok());
  EXPECT_EQ((*dflt)->storage().device(), -1);
}

}  // namespace
}  // namespace cleave
