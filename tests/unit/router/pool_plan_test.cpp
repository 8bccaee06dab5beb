// `cleave serve`'s pool planning (pool_plan.h): which pools it starts and each child's command.
#include "cleave/router/pool_plan.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "cleave/engine/engine_settings.h"

namespace cleave::router {
namespace {

bool has_set(const WorkerProcessSpec& spec, const std::string& assignment) {
  for (size_t i = 0; i + 1 < spec.args.size(); ++i) {
    if (spec.args[i] == "--set" && spec.args[i + 1] == assignment) return true;
  }
  return false;
}

TEST(PoolPlanTest, ThePoolsOfTheModeAndWhichAreStartedHere) {
  PoolsSettings pools;
  pools.decode.workers = "127.0.0.1:7000";
  std::vector<PoolPlan> plan = plan_pools(pools, DispatchMode::kDisaggregated);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].name, "prefill");
  EXPECT_TRUE(plan[0].started_here);
  EXPECT_EQ(plan[1].name, "decode");
  EXPECT_FALSE(plan[1].started_here);
  EXPECT_EQ(describe_plan(DispatchMode::kDisaggregated, plan),
            "disaggregated: 1 prefill worker, the decode workers of the config");
  EXPECT_TRUE(check_pools(plan).ok());
  pools.prefill.replicas = 0;
  Status s = check_pools(plan);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("pools.prefill.replicas"), std::string::npos) << s.message();

  pools.unified.dns = "workers.svc:9000";
  plan = plan_pools(pools, DispatchMode::kUnified);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].name, "unified");
  EXPECT_FALSE(plan[0].started_here);
}

TEST(PoolPlanTest, WorkerSpecsCarryTheSettingsGivenToServe) {
  EngineSettings engine;
  PoolsSettings pools;
  SettingsRegistry registry;
  register_engine_settings(engine, registry);
  register_pools_settings(pools, registry);
  ASSERT_TRUE(registry.set("engine.block_size", "32", "flag").ok());
  ASSERT_TRUE(registry.set("pools.decode.replicas", "2", "flag").ok());
  pools.decode.max_num_seqs = 8;
  std::vector<PoolPlan> plan = plan_pools(pools, DispatchMode::kDisaggregated);
  std::vector<WorkerProcessSpec> specs = worker_specs(registry, plan, {"/m.gguf", 3, "auto"});
  ASSERT_EQ(specs.size(), 3u);
  EXPECT_EQ(specs[0].id, "prefill-0");
  EXPECT_EQ(specs[2].id, "decode-1");
  EXPECT_EQ(specs[2].pool, "decode");
  const std::vector<std::string> head = {"worker", "--role", "decode", "--id", "decode-1",
                                         "--model", "/m.gguf"};
  ASSERT_GE(specs[2].args.size(), head.size());
  EXPECT_TRUE(std::equal(head.begin(), head.end(), specs[2].args.begin()));
  for (const WorkerProcessSpec& spec : specs) {
    EXPECT_TRUE(has_set(spec, "engine.block_size=32"));  // given to serve: forwarded
    EXPECT_FALSE(has_set(spec, "pools.decode.replicas=2"));  // the pools' own: not
    EXPECT_TRUE(has_set(spec, "engine.threads=3"));
    EXPECT_TRUE(has_set(spec, "transfer.provider=shm"));
  }
  EXPECT_TRUE(has_set(specs[1], "engine.max_num_seqs=8"));
  EXPECT_FALSE(has_set(specs[0], "engine.max_num_seqs=8"));

  // A provider named explicitly is left to the workers.
  specs = worker_specs(registry, plan, {"/m.gguf", 3, "tcp;ofi_rxm"});
  EXPECT_FALSE(has_set(specs[0], "transfer.provider=shm"));
}

}  // namespace
}  // namespace cleave::router
