#include <gtest/gtest.h>

#include "cleave/engine/engine_settings.h"
#include "cleave/worker/engine_loop.h"

namespace cleave {
namespace {

TEST(EngineOptionsTest, ConfigEngineSectionSizesThePoolAndTheScheduler) {
  EngineSettings engine;
  SettingsRegistry r;
  register_engine_settings(engine, r);
  ASSERT_TRUE(r.load_yaml_string("engine:\n  block_size: 32\n  kv_blocks: 1000\n"
                                 "  max_tokens_per_step: 512\n  max_num_seqs: 8\n"
                                 "  prefix_caching: false\n  kv_cache_bytes: 1048576\n",
                                 "t.yaml").ok());
  EngineLoopOptions o = engine_loop_options(engine);
  EXPECT_EQ(o.block_size, 32);
  EXPECT_EQ(o.num_blocks, 1000);
  EXPECT_EQ(o.kv_cache_bytes, 1048576u);
  EXPECT_EQ(o.scheduler.max_tokens_per_step, 512);
  EXPECT_EQ(o.scheduler.max_num_seqs, 8);
  EXPECT_FALSE(o.scheduler.prefix_caching);
  EXPECT_FALSE(r.set("engine.block_size", "0", "flag").ok());
  EXPECT_FALSE(r.set("engine.kv_cache_bytes", "10", "flag").ok());
}

TEST(EngineOptionsTest, DefaultsMatchTheEngineLoopDefaults) {
  EngineLoopOptions from_config = engine_loop_options(EngineSettings{});
  EngineLoopOptions plain;
  EXPECT_EQ(from_config.block_size, plain.block_size);
  EXPECT_EQ(from_config.num_blocks, plain.num_blocks);
  EXPECT_EQ(from_config.kv_cache_bytes, plain.kv_cache_bytes);
  EXPECT_EQ(from_config.scheduler.max_tokens_per_step, plain.scheduler.max_tokens_per_step);
  EXPECT_EQ(from_config.scheduler.max_num_seqs, plain.scheduler.max_num_seqs);
  EXPECT_EQ(from_config.scheduler.prefix_caching, plain.scheduler.prefix_caching);
}

}  // namespace
}  // namespace cleave
