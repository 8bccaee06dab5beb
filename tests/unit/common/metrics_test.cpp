#include "cleave/common/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <thread>

namespace cleave::metrics {
namespace {

// Lines of the rendering that start with `prefix`.
std::vector<std::string> lines_with(const std::string& text, const std::string& prefix) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(prefix, 0) == 0) out.push_back(line);
  }
  return out;
}

TEST(MetricsTest, CounterAndGaugeRenderExactly) {
  MetricsRegistry reg;
  auto c = reg.counter("cleave:requests_total", "Requests served.", {"role", "outcome"});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto g = reg.gauge("cleave:num_requests_running", "Requests in the running batch.");
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  Counter& ok = c->with({"prefill", "ok"});
  Counter& err = c->with({"decode", "error"});
  ok.inc();
  ok.inc(2.5);
  err.inc(4);
  ok.inc(-7);  // ignored
  EXPECT_DOUBLE_EQ(ok.value(), 3.5);
  Gauge& running = g->get();
  running.set(10);
  running.add(-3);
  EXPECT_DOUBLE_EQ(running.value(), 7);
  EXPECT_EQ(reg.render(),
            "# HELP cleave:requests_total Requests served.\n"
            "# TYPE cleave:requests_total counter\n"
            "cleave:requests_total{role=\"prefill\",outcome=\"ok\"} 3.5\n"
            "cleave:requests_total{role=\"decode\",outcome=\"error\"} 4\n"
            "# HELP cleave:num_requests_running Requests in the running batch.\n"
            "# TYPE cleave:num_requests_running gauge\n"
            "cleave:num_requests_running 7\n");
}

TEST(MetricsTest, ChildrenAreStableAndSharedPerLabelSet) {
  MetricsRegistry reg;
  auto c = reg.counter("x_total", "x", {"a"});
  ASSERT_TRUE(c.ok());
  Counter* first = &c->with({"1"});
  for (int i = 0; i < 100; ++i) c->with({std::to_string(i + 2)});  // many more children
  EXPECT_EQ(first, &c->with({"1"}));
  // A second handle on the same family sees the same children.
  auto again = reg.counter("x_total", "x", {"a"});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(first, &again->with({"1"}));
}

TEST(MetricsTest, EscapingOfHelpAndLabelValues) {
  MetricsRegistry reg;
  auto g = reg.gauge("esc", "a \\ backslash, a \"quote\"\nand a new line", {"path"});
  ASSERT_TRUE(g.ok());
  g->with({"C:\\dir \"q\"\nnext"}).set(1);
  // HELP escapes backslash and line feed only; label values also escape the double quote.
  EXPECT_EQ(reg.render(),
            "# HELP esc a \\\\ backslash, a \"quote\"\\nand a new line\n"
            "# TYPE esc gauge\n"
            "esc{path=\"C:\\\\dir \\\"q\\\"\\nnext\"} 1\n");
}

TEST(MetricsTest, HistogramBucketsAreCumulativeWithInfSumAndCount) {
  MetricsRegistry reg;
  auto h = reg.histogram("cleave:kv_transfer_tail_seconds", "Tail.", {0.25, 0.5, 1}, {"peer"});
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  Histogram& a = h->with({"d0"});
  for (double v : {0.125, 0.25, 0.375, 0.75, 0.75, 3.0}) a.observe(v);  // 0.25 is "le" 0.25
  a.observe(std::nan(""));  // ignored
  EXPECT_EQ(a.count(), 6u);
  EXPECT_EQ(a.cumulative_counts(), (std::vector<uint64_t>{2, 3, 5, 6}));
  EXPECT_EQ(a.sum(), 5.25);
  EXPECT_EQ(reg.render(),
            "# HELP cleave:kv_transfer_tail_seconds Tail.\n"
            "# TYPE cleave:kv_transfer_tail_seconds histogram\n"
            "cleave:kv_transfer_tail_seconds_bucket{peer=\"d0\",le=\"0.25\"} 2\n"
            "cleave:kv_transfer_tail_seconds_bucket{peer=\"d0\",le=\"0.5\"} 3\n"
            "cleave:kv_transfer_tail_seconds_bucket{peer=\"d0\",le=\"1\"} 5\n"
            "cleave:kv_transfer_tail_seconds_bucket{peer=\"d0\",le=\"+Inf\"} 6\n"
            "cleave:kv_transfer_tail_seconds_sum{peer=\"d0\"} 5.25\n"
            "cleave:kv_transfer_tail_seconds_count{peer=\"d0\"} 6\n");
}

TEST(MetricsTest, UnlabelledHistogramAndUntouchedFamilies) {
  MetricsRegistry reg;
  auto h = reg.histogram("lat_seconds", "Latency.", {0.5});
  ASSERT_TRUE(h.ok());
  auto c = reg.counter("labelled_total", "Nothing yet.", {"k"});
  ASSERT_TRUE(c.ok());
  // An unlabelled family renders its zero child at once; a labelled one only its header.
  EXPECT_EQ(reg.render(),
            "# HELP lat_seconds Latency.\n"
            "# TYPE lat_seconds histogram\n"
            "lat_seconds_bucket{le=\"0.5\"} 0\n"
            "lat_seconds_bucket{le=\"+Inf\"} 0\n"
            "lat_seconds_sum 0\n"
            "lat_seconds_count 0\n"
            "# HELP labelled_total Nothing yet.\n"
            "# TYPE labelled_total counter\n");
  h->get().observe(0.25);
  EXPECT_EQ(lines_with(reg.render(), "lat_seconds_sum"), std::vector<std::string>{"lat_seconds_sum 0.25"});
}

TEST(MetricsTest, SpecialValuesUseTheTextFormatSpelling) {
  MetricsRegistry reg;
  auto g = reg.gauge("g", "g", {"v"});
  ASSERT_TRUE(g.ok());
  g->with({"inf"}).set(std::numeric_limits<double>::infinity());
  g->with({"ninf"}).set(-std::numeric_limits<double>::infinity());
  g->with({"nan"}).set(std::nan(""));
  g->with({"small"}).set(1e-9);
  g->with({"big"}).set(123456789012.0);
  auto lines = lines_with(reg.render(), "g{");
  ASSERT_EQ(lines.size(), 5u);
  EXPECT_EQ(lines[0], "g{v=\"inf\"} +Inf");
  EXPECT_EQ(lines[1], "g{v=\"ninf\"} -Inf");
  EXPECT_EQ(lines[2], "g{v=\"nan\"} NaN");
  EXPECT_EQ(std::stod(lines[3].substr(lines[3].find(' ') + 1)), 1e-9);
  EXPECT_EQ(lines[4], "g{v=\"big\"} 123456789012");
}

TEST(MetricsTest, ReRegistrationRules) {
  MetricsRegistry reg;
  ASSERT_TRUE(reg.counter("a_total", "help a", {"x"}).ok());
  EXPECT_TRUE(reg.counter("a_total", "help a", {"x"}).ok());  // identical: the same family
  auto kind = reg.gauge("a_total", "help a", {"x"});
  ASSERT_FALSE(kind.ok());
  EXPECT_EQ(kind.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(kind.status().message().find("kind counter vs gauge"), std::string::npos)
      << kind.status().message();
  auto help = reg.counter("a_total", "other help", {"x"});
  ASSERT_FALSE(help.ok());
  EXPECT_NE(help.status().message().find("help"), std::string::npos);
  auto labels = reg.counter("a_total", "help a", {"y"});
  ASSERT_FALSE(labels.ok());
  EXPECT_NE(labels.status().message().find("labels [x] vs [y]"), std::string::npos)
      << labels.status().message();
  ASSERT_TRUE(reg.histogram("h_seconds", "h", {1, 2}).ok());
  EXPECT_TRUE(reg.histogram("h_seconds", "h", {1, 2}).ok());
  auto bounds = reg.histogram("h_seconds", "h", {1, 3});
  ASSERT_FALSE(bounds.ok());
  EXPECT_NE(bounds.status().message().find("bounds"), std::string::npos);
  // A histogram's sample names belong to it.
  EXPECT_FALSE(reg.counter("h_seconds_count", "c").ok());
  EXPECT_FALSE(reg.gauge("h_seconds_bucket", "c").ok());
  ASSERT_TRUE(reg.gauge("q_sum", "q").ok());
  EXPECT_FALSE(reg.histogram("q", "q", {1}).ok());
  // Failed registrations left nothing behind.
  std::string text = reg.render();
  EXPECT_EQ(lines_with(text, "# TYPE").size(), 3u) << text;
}

TEST(MetricsTest, BadNamesLabelsAndBoundsAreRefused) {
  MetricsRegistry reg;
  for (const char* bad : {"", "1abc", "a-b", "a b", "é", "a.b"}) {
    auto r = reg.counter(bad, "h");
    ASSERT_FALSE(r.ok()) << "'" << bad << "'";
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(reg.counter("_ok:name_1", "h").ok());
  EXPECT_TRUE(reg.counter("cleave:x", "h").ok());
  EXPECT_FALSE(reg.counter("l1", "h", {"a:b"}).ok());  // no colon in label names
  EXPECT_FALSE(reg.counter("l2", "h", {"1a"}).ok());
  EXPECT_FALSE(reg.counter("l3", "h", {"__reserved"}).ok());
  EXPECT_FALSE(reg.counter("l4", "h", {"a", "a"}).ok());
  EXPECT_FALSE(reg.histogram("l5", "h", {1}, {"le"}).ok());
  EXPECT_TRUE(reg.gauge("l6", "h", {"le"}).ok());  // only histograms reserve le
  EXPECT_FALSE(reg.histogram("b1", "h", {2, 1}).ok());
  EXPECT_FALSE(reg.histogram("b2", "h", {1, 1}).ok());
  EXPECT_FALSE(reg.histogram("b3", "h", {1, std::numeric_limits<double>::infinity()}).ok());
  EXPECT_FALSE(reg.histogram("b4", "h", {std::nan("")}).ok());
  auto r = reg.histogram("b5", "h", {-1, 0, 1});
  EXPECT_TRUE(r.ok());
}

TEST(MetricsTest, WrongLabelCountGoesToAnUnexportedChild) {
  MetricsRegistry reg;
  auto c = reg.counter("w_total", "w", {"a", "b"});
  ASSERT_TRUE(c.ok());
  c->with({"only-one"}).inc(5);
  c->with({"1", "2"}).inc(1);
  EXPECT_EQ(lines_with(reg.render(), "w_total{"),
            std::vector<std::string>{"w_total{a=\"1\",b=\"2\"} 1"});
}

TEST(MetricsTest, ConcurrentUpdatesAndRendersLoseNothing) {
  MetricsRegistry reg;
  auto c = reg.counter("conc_total", "c", {"t"});
  auto g = reg.gauge("conc_gauge", "g");
  auto h = reg.histogram("conc_seconds", "h", {0.5, 1.5});
  ASSERT_TRUE(c.ok() && g.ok() && h.ok());
  constexpr int kThreads = 6, kIters = 100000;
  std::atomic<bool> stop{false};
  std::thread renderer([&] {
    while (!stop.load()) {
      std::string text = reg.render();
      // _count always equals the +Inf bucket within one rendering.
      auto inf = lines_with(text, "conc_seconds_bucket{le=\"+Inf\"}");
      auto cnt = lines_with(text, "conc_seconds_count");
      ASSERT_EQ(inf.size(), 1u);
      ASSERT_EQ(cnt.size(), 1u);
      EXPECT_EQ(inf[0].substr(inf[0].rfind(' ')), cnt[0].substr(cnt[0].rfind(' ')));
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Counter& mine = c->with({std::to_string(t % 3)});  // two threads share each child
      Gauge& gauge = g->get();
      Histogram& hist = h->get();
      for (int i = 0; i < kIters; ++i) {
        mine.inc();
        gauge.add(1);
        hist.observe(static_cast<double>(i % 3));  // 0, 1, 2: one per bucket
      }
    });
  }
  for (auto& t : threads) t.join();
  stop = true;
  renderer.join();
  for (int k = 0; k < 3; ++k) EXPECT_EQ(c->with({std::to_string(k)}).value(), 2.0 * kIters);
  EXPECT_EQ(g->get().value(), double{kThreads} * kIters);
  const uint64_t n = static_cast<uint64_t>(kThreads) * kIters;
  EXPECT_EQ(h->get().count(), n);
  auto cum = h->get().cumulative_counts();
  const uint64_t per = static_cast<uint64_t>(kThreads) * ((kIters + 2) / 3);  // i % 3 == 0
  EXPECT_EQ(cum[0], per);
  EXPECT_EQ(cum[2], n);
  // Sum of (i % 3) over i < kIters, per thread.
  double per_thread = 0;
  for (int i = 0; i < kIters; ++i) per_thread += i % 3;
  EXPECT_DOUBLE_EQ(h->get().sum(), per_thread * kThreads);
}

TEST(MetricsTest, LatencyBucketsSpanHalfAMillisecondToAMinute) {
  auto b = latency_buckets_seconds();
  ASSERT_GE(b.size(), 10u);
  EXPECT_DOUBLE_EQ(b.front(), 0.0005);
  EXPECT_DOUBLE_EQ(b.back(), 60.0);
  for (size_t i = 1; i < b.size(); ++i) {
    EXPECT_GT(b[i] / b[i - 1], 1.9) << i;
    EXPECT_LT(b[i] / b[i - 1], 2.7) << i;
  }
  MetricsRegistry reg;
  EXPECT_TRUE(reg.histogram("ok_seconds", "h", b).ok());
}

}  // namespace
}  // namespace cleave::metrics
