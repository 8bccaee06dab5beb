// `cleave tune` pieces that need no server: the candidates of the first dimension within a
// worker budget, their YAML (loaded back by the config loader exactly as `cleave serve --config`
// loads it), and the table and SVG chart of a result.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "cleave/bench/tune.h"
#include "cleave/cli/config.h"

namespace cleave::bench {
namespace {

TEST(Tune, ModeCandidatesStayWithinTheWorkerBudget) {
  const auto one = mode_candidates(1);
  ASSERT_EQ(one.size(), 1u);  // unified x1 only: disaggregation needs two workers
  const auto two = mode_candidates(2);
  ASSERT_EQ(two.size(), 3u);  // unified x1 (2 threads), unified x2, P:D 1:1
  const auto three = mode_candidates(3);
  ASSERT_EQ(three.size(), 4u);  // unified x1, x3, P:D 1:2, 2:1
  for (const auto& c : three) {
    int64_t workers = 0;
    std::string mode;
    for (const auto& [k, v] : c.settings) {
      if (k == "router.mode") mode = v;
      if (k.ends_with(".replicas")) workers += std::stoll(v);
    }
    EXPECT_LE(workers, 3) << c.name;
    EXPECT_FALSE(mode.empty()) << c.name;
  }
}

TEST(Tune, CandidateYamlLoadsAsAServeConfig) {
  const auto dir = std::filesystem::temp_directory_path() / ("cleave-tune-test-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  for (auto c : mode_candidates(2)) {
    c.settings.emplace_back("engine.max_tokens_per_step", "1024");
    c.settings.emplace_back("engine.prefix_caching", "false");
    const std::string yaml = candidate_yaml(c, "/models/my model.gguf");
    const auto path = (dir / "c.yaml").string();
    std::ofstream(path) << yaml;
    Config config;
    SettingsRegistry registry;
    register_settings(config, registry);
    const Status st = load_config(registry, path, {});
    ASSERT_TRUE(st.ok()) << st.to_string() << "\n" << yaml;
    EXPECT_EQ(config.model.path, "/models/my model.gguf");
    EXPECT_EQ(config.engine.max_tokens_per_step, 1024);
    EXPECT_FALSE(config.engine.prefix_caching);
    for (const auto& [k, v] : c.settings) {
      if (k == "router.mode") {
        EXPECT_EQ(config.router.mode, v);
      } else if (k == "pools.unified.replicas") {
        EXPECT_EQ(config.pools.unified.replicas, std::stoll(v));
      } else if (k == "pools.prefill.replicas") {
        EXPECT_EQ(config.pools.prefill.replicas, std::stoll(v));
      } else if (k == "pools.decode.replicas") {
        EXPECT_EQ(config.pools.decode.replicas, std::stoll(v));
      }
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(Tune, TableAndChartNameEveryCandidate) {
  TuneResult r;
  for (int i = 0; i < 3; ++i) {
    TuneRow row;
    row.candidate = mode_candidates(2)[static_cast<size_t>(i)];
    SweepPoint probe;
    probe.rate = 0.5;
    probe.attainment = 0.4 * (i + 1);
    row.probe = probe;
    row.swept = i > 0;
    row.goodput = i > 0 ? 0.5 * (i + 1) : 0;
    row.sweep.best_rate = i > 0 ? 0.6 * (i + 1) : 0;
    r.rows.push_back(row);
  }
  r.rows[0].pruned = true;
  r.rows[0].note = "pruned: under half the best";
  r.best = 2;
  r.predicted_goodput = 1.5;
  r.confirmed_goodput = 1.45;
  r.confirmed_within = true;
  const std::string table = tune_table(r);
  for (const auto& row : r.rows) EXPECT_NE(table.find(row.candidate.name), std::string::npos);
  EXPECT_NE(table.find("**recommended**"), std::string::npos);
  EXPECT_NE(table.find("within 10%"), std::string::npos);
  EXPECT_NE(table.find("pruned"), std::string::npos);
  EXPECT_NE(table.find("| 0.200 at 0.500 | 0.000 | 0.000 | 1 | pruned"), std::string::npos) << table;
  EXPECT_NE(table.find("| 0.400 at 0.500 | 1.200 | 1.000 |"), std::string::npos) << table;
  const std::string svg = tune_svg(r, "goodput <chat>");
  EXPECT_TRUE(svg.starts_with("<svg"));
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("&lt;chat&gt;"), std::string::npos);
  EXPECT_NE(svg.find("1. unified x1 (2 thr) (probe)"), std::string::npos);  // its probe, in grey
  EXPECT_NE(svg.find(">0.20<"), std::string::npos);
  EXPECT_EQ(std::count(svg.begin(), svg.end(), '<') - std::count(svg.begin(), svg.end(), '>'), 0);
  size_t rects = 0;
  for (size_t p = svg.find("<rect"); p != std::string::npos; p = svg.find("<rect", p + 1)) ++rects;
  EXPECT_EQ(rects, 1u + r.rows.size());  // the background and one bar per candidate
}

}  // namespace
}  // namespace cleave::bench
