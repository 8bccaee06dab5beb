// The arithmetic of `cleave bench serve` on hand-built event timelines: TTFT, ITL, E2EL and
// output tokens from SSE bytes; TPOT, pooled ITL, numpy-style summaries, throughputs, goodput
// and the one-second buckets over a run; the --goodput and --percentiles parsers.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "cleave/bench/serve_metrics.h"

namespace cleave::bench {
namespace {

std::string chunk(std::string_view text, bool chat = false) {
  if (chat) return "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"" + std::string(text) + "\"}}]}\n\n";
  return "data: {\"choices\":[{\"index\":0,\"text\":\"" + std::string(text) + "\"}]}\n\n";
}
std::string usage(int completion, int prompt = 7) {
  return "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":" + std::to_string(prompt) +
         ",\"completion_tokens\":" + std::to_string(completion) + ",\"total_tokens\":0}}\n\n";
}

TEST(SseTimeline, TimesAreFromTheSendToContentEvents) {
  SseTimeline t(/*start_s=*/1.0, /*input_len=*/5);
  t.feed(1.25, ": comment line\n\n");  // no data: ignored
  t.feed(1.5, chunk("Once"));
  t.feed(1.7, chunk(" upon"));
  t.feed(2.0, chunk(" a") + chunk(" time"));  // two events in one read share its time
  // A last chunk with choices but no text: ends E2EL, is no ITL gap.
  t.feed(2.25, "data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"length\"}]}\n\n");
  t.feed(2.3, usage(4));
  EXPECT_FALSE(t.done());
  t.feed(2.3, "data: [DONE]\n\n");
  EXPECT_TRUE(t.done());
  const RequestRecord r = t.finish(200);
  ASSERT_TRUE(r.success) << r.error;
  EXPECT_DOUBLE_EQ(r.start_s, 1.0);
  EXPECT_DOUBLE_EQ(r.ttft_s, 0.5);
  ASSERT_EQ(r.itl_s.size(), 3u);
  EXPECT_NEAR(r.itl_s[0], 0.2, 1e-12);
  EXPECT_NEAR(r.itl_s[1], 0.3, 1e-12);
  EXPECT_NEAR(r.itl_s[2], 0.0, 1e-12);
  EXPECT_DOUBLE_EQ(r.latency_s, 1.25);
  EXPECT_EQ(r.output_tokens, 4);
  EXPECT_TRUE(r.output_from_usage);
  EXPECT_EQ(r.prompt_tokens, 7);
  EXPECT_EQ(r.input_len, 5);
  EXPECT_EQ(r.generated_text, "Once upon a time");
}

TEST(SseTimeline, EventsSplitAcrossReadsAndCrlfAndChat) {
  SseTimeline t(0.0);
  const std::string first = "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Hi\"}}]}\r\n\r\n";
  t.feed(0.1, first.substr(0, 20));
  t.feed(0.4, first.substr(20));  // the event completes here
  t.feed(0.5, chunk("!", true).substr(0, 10));
  t.feed(0.9, chunk("!", true).substr(10));
  // No usage: the output is counted in content events.
  const RequestRecord r = t.finish(200);
  ASSERT_TRUE(r.success) << r.error;
  EXPECT_DOUBLE_EQ(r.ttft_s, 0.4);
  ASSERT_EQ(r.itl_s.size(), 1u);
  EXPECT_NEAR(r.itl_s[0], 0.5, 1e-12);
  EXPECT_EQ(r.output_tokens, 2);
  EXPECT_FALSE(r.output_from_usage);
  EXPECT_EQ(r.prompt_tokens, -1);
  EXPECT_EQ(r.generated_text, "Hi!");
}

TEST(SseTimeline, FailuresAreCountedWithTheirReason) {
  {
    SseTimeline t(0);
    const RequestRecord r = t.finish(503, {}, "{\"error\":{\"message\":\"no worker is ready\"}}");
    EXPECT_FALSE(r.success);
    EXPECT_NE(r.error.find("HTTP 503"), std::string::npos) << r.error;
    EXPECT_NE(r.error.find("no worker is ready"), std::string::npos) << r.error;
  }
  {
    SseTimeline t(0);
    t.feed(0.1, chunk("a"));
    t.feed(0.2, "data: {\"error\":{\"message\":\"the worker died\",\"type\":\"server_error\"}}\n\n");
    const RequestRecord r = t.finish(200);
    EXPECT_FALSE(r.success);
    EXPECT_EQ(r.error, "the worker died");
    EXPECT_EQ(r.output_tokens, 0);
    EXPECT_TRUE(r.itl_s.empty());
  }
  {
    SseTimeline t(0);
    t.feed(0.1, usage(0));
    t.feed(0.1, "data: [DONE]\n\n");
    const RequestRecord r = t.finish(200);
    EXPECT_FALSE(r.success);
    EXPECT_NE(r.error.find("no content"), std::string::npos);
  }
  {
    SseTimeline t(0);
    t.feed(0.1, chunk("a"));
    const RequestRecord r = t.finish(0, "the stream broke: end of stream");
    EXPECT_FALSE(r.success);
    EXPECT_EQ(r.error, "the stream broke: end of stream");
  }
  {
    SseTimeline t(0);
    t.feed(0.1, "data: {not json\n\n");
    t.feed(0.2, chunk("a"));
    EXPECT_FALSE(t.finish(200).success);
  }
}

TEST(SseTimeline, CachedPromptTokensComeFromTheUsageDetails) {
  SseTimeline t(0);
  t.feed(0.1, chunk("a"));
  t.feed(0.2, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":1,"
              "\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n");
  t.feed(0.3, "data: [DONE]\n\n");
  const RequestRecord r = t.finish(200);
  EXPECT_TRUE(r.success) << r.error;
  EXPECT_EQ(r.prompt_tokens, 40);
  EXPECT_EQ(r.cached_prompt_tokens, 32);

  SseTimeline silent(0);  // a usage without details: the server did not say
  silent.feed(0.1, chunk("a") + usage(1));
  EXPECT_EQ(silent.finish(200).cached_prompt_tokens, -1);
}

TEST(ComputeMetrics, PrefixCacheHitRateIsOverTheRequestsThatReportedIt) {
  std::vector<RequestRecord> rs(3);
  for (auto& r : rs) {
    r.success = true;
    r.ttft_s = r.latency_s = 0.1;
    r.output_tokens = 1;
  }
  rs[0].prompt_tokens = 64;
  rs[0].cached_prompt_tokens = 48;
  rs[1].prompt_tokens = 36;
  rs[1].cached_prompt_tokens = 0;
  rs[2].prompt_tokens = 50;  // no cache report: in the input tokens, not in the rate
  const BenchMetrics m = compute_metrics(rs, 1.0, GoodputSlo{}, {50});
  EXPECT_EQ(m.total_input_tokens, 150);
  EXPECT_EQ(m.total_cached_input_tokens, 48);
  EXPECT_DOUBLE_EQ(m.prefix_cache_hit_rate, 0.48);

  const BenchMetrics none = compute_metrics({rs[2]}, 1.0, GoodputSlo{}, {50});
  EXPECT_EQ(none.total_cached_input_tokens, 0);
  EXPECT_EQ(none.prefix_cache_hit_rate, 0);
}

RequestRecord done(double start, double ttft, std::vector<double> itl, double latency,
                   int64_t output, int64_t prompt) {
  RequestRecord r;
  r.success = true;
  r.start_s = start;
  r.ttft_s = ttft;
  r.itl_s = std::move(itl);
  r.latency_s = latency;
  r.output_tokens = output;
  r.prompt_tokens = prompt;
  return r;
}

TEST(ComputeMetrics, VllmDefinitionsOnAHandBuiltRun) {
  std::vector<RequestRecord> rs;
  // 0: TTFT 100 ms, 5 tokens over 0.5 s after the first: TPOT 125 ms.
  rs.push_back(done(0.0, 0.1, {0.1, 0.1, 0.1, 0.2}, 0.6, 5, 10));
  // 1: one output token: no TPOT sample (0 for goodput), no ITL.
  rs.push_back(done(0.5, 0.2, {}, 0.2, 1, 20));
  // 2: TTFT 300 ms, 3 tokens, E2EL 0.7: TPOT 200 ms.
  rs.push_back(done(1.2, 0.3, {0.15, 0.25}, 0.7, 3, -1));
  rs.back().input_len = 30;  // the server gave no prompt_tokens: the workload's length counts
  RequestRecord failed;
  failed.error = "HTTP 500: boom";
  failed.input_len = 99;
  rs.push_back(failed);

  const BenchMetrics m = compute_metrics(rs, /*duration_s=*/2.0, GoodputSlo{}, {50, 90, 99.5});
  EXPECT_EQ(m.completed, 3);
  EXPECT_EQ(m.failed, 1);
  EXPECT_EQ(m.total_input_tokens, 60);
  EXPECT_EQ(m.total_output_tokens, 9);
  EXPECT_DOUBLE_EQ(m.request_throughput, 1.5);
  EXPECT_DOUBLE_EQ(m.output_throughput, 4.5);
  EXPECT_DOUBLE_EQ(m.total_token_throughput, 34.5);
  EXPECT_EQ(m.request_goodput, 0);  // no SLO given

  // TTFT [100, 200, 300] ms: mean 200, median 200, population std sqrt(20000/3).
  EXPECT_NEAR(m.ttft.mean, 200, 1e-9);
  EXPECT_NEAR(m.ttft.median, 200, 1e-9);
  EXPECT_NEAR(m.ttft.std, std::sqrt(20000.0 / 3.0), 1e-9);
  ASSERT_EQ(m.ttft.percentiles.size(), 3u);
  EXPECT_NEAR(m.ttft.percentiles[1].second, 280, 1e-9);   // linear: 100 + 0.9*2*100
  EXPECT_NEAR(m.ttft.percentiles[2].second, 299, 1e-9);   // p99.5
  // TPOT only of requests with more than one token: [125, 200].
  EXPECT_NEAR(m.tpot.mean, 162.5, 1e-9);
  EXPECT_NEAR(m.tpot.median, 162.5, 1e-9);
  // ITL pooled over requests: [100, 100, 100, 200, 150, 250].
  EXPECT_NEAR(m.itl.mean, 150, 1e-9);
  EXPECT_NEAR(m.itl.median, 125, 1e-9);
  EXPECT_NEAR(m.itl.percentiles[1].second, 225, 1e-9);  // rank 4.5 of sorted 100,100,100,150,200,250
  // E2EL [600, 200, 700].
  EXPECT_NEAR(m.e2el.mean, 500, 1e-9);
  EXPECT_NEAR(m.e2el.median, 600, 1e-9);

  // Buckets from t=0: request 0 is active in second 0, 1 in second 0, 2 in seconds 1; tokens
  // at 0.1,0.2,0.3,0.4,0.6 | 0.7 | 1.5,1.65,1.9: 6 in second 0, 3 in second 1.
  EXPECT_EQ(m.max_concurrent_requests, 2);
  EXPECT_DOUBLE_EQ(m.max_output_tokens_per_s, 6);
}

TEST(ComputeMetrics, GoodputCountsRequestsMeetingEverySlo) {
  std::vector<RequestRecord> rs;
  rs.push_back(done(0.0, 0.1, {0.1, 0.1, 0.1, 0.2}, 0.6, 5, 10));  // TTFT 100, TPOT 125, E2EL 600
  rs.push_back(done(0.5, 0.2, {}, 0.2, 1, 20));                    // TTFT 200, TPOT 0, E2EL 200
  rs.push_back(done(1.2, 0.3, {0.15, 0.25}, 0.7, 3, 5));           // TTFT 300, TPOT 200, E2EL 700
  RequestRecord failed;
  failed.error = "x";
  rs.push_back(failed);

  GoodputSlo ttft;
  ttft.ttft_ms = 200;  // <= counts: requests 0 and 1
  BenchMetrics m = compute_metrics(rs, 4.0, ttft, {99});
  EXPECT_EQ(m.good_completed, 2);
  EXPECT_DOUBLE_EQ(m.request_goodput, 0.5);

  GoodputSlo tpot;
  tpot.tpot_ms = 150;  // 0 (125) and 1 (one token: TPOT 0)
  EXPECT_EQ(compute_metrics(rs, 4.0, tpot, {99}).good_completed, 2);

  GoodputSlo all;
  all.ttft_ms = 250;
  all.tpot_ms = 150;
  all.e2el_ms = 500;  // only request 1 meets all three
  m = compute_metrics(rs, 4.0, all, {99});
  EXPECT_EQ(m.good_completed, 1);
  EXPECT_DOUBLE_EQ(m.request_goodput, 0.25);
  EXPECT_FALSE(meets_slo(failed, GoodputSlo{}));
  EXPECT_TRUE(meets_slo(rs[2], GoodputSlo{}));
}

TEST(ComputeMetrics, NothingCompletedSummarizesAsZeros) {
  RequestRecord failed;
  failed.error = "x";
  const BenchMetrics m = compute_metrics({failed, failed}, 1.0, GoodputSlo{}, {99});
  EXPECT_EQ(m.completed, 0);
  EXPECT_EQ(m.failed, 2);
  EXPECT_EQ(m.ttft.mean, 0);
  EXPECT_EQ(m.ttft.percentiles.at(0).second, 0);
  EXPECT_EQ(m.max_concurrent_requests, 0);
}

TEST(Flags, GoodputAndPercentiles) {
  auto g = parse_goodput({"ttft:500", "tpot:50,e2el:2000.5"});
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_EQ(*g->ttft_ms, 500);
  EXPECT_EQ(*g->tpot_ms, 50);
  EXPECT_EQ(*g->e2el_ms, 2000.5);
  EXPECT_FALSE(parse_goodput({}).value().any());
  auto bad = parse_goodput({"ttfx:5"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("ttfx"), std::string::npos);
  bad = parse_goodput({"ttft:fast"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("fast"), std::string::npos);
  EXPECT_FALSE(parse_goodput({"ttft"}).ok());
  EXPECT_FALSE(parse_goodput({"tpot:-1"}).ok());

  auto p = parse_percentiles("50,90, 99.9");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p, (std::vector<double>{50, 90, 99.9}));
  auto bp = parse_percentiles("50,101");
  ASSERT_FALSE(bp.ok());
  EXPECT_NE(bp.status().message().find("101"), std::string::npos);
  EXPECT_FALSE(parse_percentiles("").ok());
  EXPECT_FALSE(parse_percentiles("0").ok());
}

}  // namespace
}  // namespace cleave::bench
