// The CUDA backend's graph policy (engine/cuda/step_graphs.h), on the CPU: a shape runs eagerly,
// then is recorded, then replays; every field of the shape keeps graphs apart; a full table and
// clear() destroy each graph once.
#include <gtest/gtest.h>

#include <map>

#include "engine/cuda/step_graphs.h"

namespace cleave {
namespace {

using Graphs = StepGraphs<int>;  // a graph is an int here; 0 is "none"

StepShape base_shape() {
  static int pool;
  return StepShape{.n_tokens = 4, .attention_splits = 2, .kv = &pool, .num_blocks = 64,
                   .block_size = 16, .kv_dim = 512, .dtype = 2};
}

TEST(StepGraphsTest, EagerThenRecordedThenReplayed) {
  std::map<int, int> destroyed;
  Graphs g([&](int e) { ++destroyed[e]; });
  int exec = -1;
  EXPECT_EQ(g.lookup(base_shape(), &exec), Graphs::Action::kEager);
  EXPECT_EQ(g.lookup(base_shape(), &exec), Graphs::Action::kRecord);
  EXPECT_EQ(g.lookup(base_shape(), &exec), Graphs::Action::kRecord) << "not recorded yet";
  g.recorded(base_shape(), 7);
  for (int i = 0; i < 3; ++i) {
    exec = -1;
    EXPECT_EQ(g.lookup(base_shape(), &exec), Graphs::Action::kReplay);
    EXPECT_EQ(exec, 7);
  }
  EXPECT_TRUE(destroyed.empty());
  g.recorded(base_shape(), 8);  // a re-recording replaces (and frees) the old graph
  EXPECT_EQ(destroyed[7], 1);
  g.clear();
  EXPECT_EQ(destroyed[8], 1);
  EXPECT_EQ(g.size(), 0u);
  EXPECT_EQ(g.lookup(base_shape(), &exec), Graphs::Action::kEager) << "cleared: seen afresh";
}

// A recorded step holds each of these by value: a step that differs in any of them must not
// replay another's graph (the pool's block count once did: a freed pool's address came back for
// a pool of another size).
TEST(StepGraphsTest, EveryFieldOfTheShapeKeepsGraphsApart) {
  static int other_pool;
  std::vector<StepShape> shapes(8, base_shape());
  shapes[1].n_tokens = 5;
  shapes[2].attention_splits = 3;
  shapes[3].kv = &other_pool;
  shapes[4].num_blocks = 65;
  shapes[5].block_size = 32;
  shapes[6].kv_dim = 256;
  shapes[7].dtype = 1;
  Graphs g([](int) {});
  int exec = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    ASSERT_EQ(g.lookup(shapes[i], &exec), Graphs::Action::kEager) << "shape " << i;
    ASSERT_EQ(g.lookup(shapes[i], &exec), Graphs::Action::kRecord) << "shape " << i;
    g.recorded(shapes[i], static_cast<int>(100 + i));
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    ASSERT_EQ(g.lookup(shapes[i], &exec), Graphs::Action::kReplay) << "shape " << i;
    EXPECT_EQ(exec, static_cast<int>(100 + i)) << "shape " << i;
  }
  EXPECT_EQ(g.size(), shapes.size());
}

TEST(StepGraphsTest, AFullTableIsEmptiedAndEveryGraphDestroyedOnce) {
  std::map<int, int> destroyed;
  {
    Graphs g([&](int e) { ++destroyed[e]; }, /*max=*/3);
    int exec = 0;
    for (int i = 0; i < 3; ++i) {
      StepShape s = base_shape();
      s.n_tokens = i + 1;
      g.lookup(s, &exec);
      g.lookup(s, &exec);
      g.recorded(s, 10 + i);
    }
    EXPECT_EQ(g.size(), 3u);
    StepShape fourth = base_shape();
    fourth.n_tokens = 99;
    EXPECT_EQ(g.lookup(fourth, &exec), Graphs::Action::kEager);
    EXPECT_EQ(g.size(), 1u);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(destroyed[10 + i], 1) << i;
    g.lookup(fourth, &exec);
    g.recorded(fourth, 50);
  }
  EXPECT_EQ(destroyed[50], 1) << "the destructor frees what is left";
  EXPECT_EQ(destroyed.size(), 4u);
}

}  // namespace
}  // namespace cleave
