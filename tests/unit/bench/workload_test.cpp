// Workloads of `cleave bench serve`: gamma arrivals and their rescaling, Mooncake trace lines
// and their hash_ids -> shared prompt prefixes, the presets, ShareGPT, prompts sized in a real
// tokenizer's tokens, and bad input.
#include "cleave/bench/workload.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "cleave/model/default_model.h"
#include "cleave/model/tokenizer.h"

namespace cleave::bench {
namespace {

std::filesystem::path temp_file(const std::string& name, const std::string& text) {
  const auto p = std::filesystem::temp_directory_path() /
                 ("cleave-workload-test-" + std::to_string(::getpid()) + "-" + name);
  std::ofstream(p) << text;
  return p;
}

// Words separated by single spaces (block text ends with one; a prompt does not).
int64_t words(const std::string& s) {
  int64_t n = 0;
  bool in_word = false;
  for (char c : s) {
    n += !in_word && c != ' ';
    in_word = c != ' ';
  }
  return n;
}

TEST(GammaArrivals, MeanGapIsOneOverRateAndShapeSetsTheSpread) {
  const auto inf = gamma_arrivals(5, std::numeric_limits<double>::infinity(), 1.0, 1);
  EXPECT_EQ(inf, std::vector<double>(5, 0.0));

  const int64_t n = 20000;
  for (const double burstiness : {1.0, 4.0, 0.25}) {
    const auto a = gamma_arrivals(n, /*rate=*/4.0, burstiness, /*seed=*/7);
    ASSERT_EQ(a.size(), static_cast<size_t>(n));
    EXPECT_EQ(a[0], 0.0);
    std::vector<double> gaps;
    for (size_t i = 1; i < a.size(); ++i) {
      ASSERT_GE(a[i], a[i - 1]);
      gaps.push_back(a[i] - a[i - 1]);
    }
    const double mean = std::accumulate(gaps.begin(), gaps.end(), 0.0) / gaps.size();
    double var = 0;
    for (double g : gaps) var += (g - mean) * (g - mean);
    const double cv = std::sqrt(var / gaps.size()) / mean;
    EXPECT_NEAR(mean, 0.25, 0.25 * 0.05) << "burstiness " << burstiness;
    // A gamma with shape k has a coefficient of variation of 1/sqrt(k).
    EXPECT_NEAR(cv, 1.0 / std::sqrt(burstiness), 0.1 / std::sqrt(burstiness)) << burstiness;
  }
  EXPECT_EQ(gamma_arrivals(50, 2.0, 1.0, 3), gamma_arrivals(50, 2.0, 1.0, 3));
  EXPECT_NE(gamma_arrivals(50, 2.0, 1.0, 3), gamma_arrivals(50, 2.0, 1.0, 4));
}

TEST(BlockText, SameIdSameWordsAndShorterIsAPrefix) {
  EXPECT_EQ(block_text(42, 30), block_text(42, 30));
  EXPECT_NE(block_text(42, 30), block_text(43, 30));
  EXPECT_TRUE(block_text(42, 30).starts_with(block_text(42, 11)));
  EXPECT_EQ(words(block_text(42, 30)), 30);
  EXPECT_EQ(block_text(42, 0), "");
}

TEST(Trace, LinesParseAndBadOnesNameTheProblem) {
  auto e = parse_trace_line(
      R"({"timestamp": 27482, "input_length": 1100, "output_length": 52, "hash_ids": [46, 47, 9]})", 3);
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  EXPECT_EQ(e->timestamp_ms, 27482);
  EXPECT_EQ(e->input_length, 1100);
  EXPECT_EQ(e->output_length, 52);
  EXPECT_EQ(e->hash_ids, (std::vector<int64_t>{46, 47, 9}));

  auto bad = parse_trace_line(R"({"timestamp": 1, "output_length": 5})", 7);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("line 7"), std::string::npos);
  EXPECT_NE(bad.status().message().find("input_length"), std::string::npos);
  bad = parse_trace_line(R"({"timestamp": 1, "input_length": 5, "output_length": 5, "hash_ids": [1, "x"]})", 2);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("\"x\""), std::string::npos);
  EXPECT_FALSE(parse_trace_line("not json", 1).ok());
  EXPECT_FALSE(parse_trace_line(R"({"timestamp": -5, "input_length": 5, "output_length": 5})", 1).ok());
}

TEST(Trace, HashIdsBecomeSharedPromptPrefixesAndTimesRescale) {
  // 1/64 of the lengths: 512-token blocks become 8 words.
  TraceEntry a{.timestamp_ms = 2000, .input_length = 1280, .output_length = 640, .hash_ids = {0, 1, 2}};
  TraceEntry b{.timestamp_ms = 3000, .input_length = 1536, .output_length = 64, .hash_ids = {0, 1, 5}};
  TraceEntry c{.timestamp_ms = 3000, .input_length = 1024, .output_length = 64, .hash_ids = {7, 1}};
  const auto ra = trace_request(a, /*time_scale=*/0.5, /*length_scale=*/1.0 / 64);
  const auto rb = trace_request(b, 0.5, 1.0 / 64);
  const auto rc = trace_request(c, 0.5, 1.0 / 64);
  EXPECT_EQ(ra.input_len, 20);  // 8 + 8 + 4 (the last block is partial)
  EXPECT_EQ(words(ra.prompt), 20);
  EXPECT_EQ(rb.input_len, 24);
  EXPECT_EQ(ra.output_len, 10);
  EXPECT_EQ(rb.output_len, 1);
  ASSERT_TRUE(ra.arrival_s && rb.arrival_s);
  EXPECT_DOUBLE_EQ(*ra.arrival_s, 1.0);
  EXPECT_DOUBLE_EQ(*rb.arrival_s, 1.5);
  // Blocks 0 and 1 shared: the first 16 words are the same text; the third block differs.
  const std::string blocks = block_text(0, 8) + block_text(1, 8) + block_text(2, 4);
  EXPECT_EQ(ra.prompt, blocks.substr(0, blocks.size() - 1));  // without the last space
  EXPECT_TRUE(rb.prompt.starts_with(block_text(0, 8) + block_text(1, 8)));
  EXPECT_NE(ra.prompt.substr(0, block_text(0, 8).size() * 3), rb.prompt.substr(0, block_text(0, 8).size() * 3));
  // Sharing a block id away from the start shares no prefix.
  EXPECT_FALSE(rc.prompt.starts_with(block_text(0, 8)));
  // Length scale 1: whole 512-word blocks.
  EXPECT_EQ(trace_request(a, 1.0, 1.0).input_len, 1280);
  EXPECT_DOUBLE_EQ(*trace_request(a, 1.0, 1.0).arrival_s, 2.0);
}

TEST(Trace, FileSliceStartsAtZeroAndCountsPrefixReuse) {
  const auto p = temp_file("trace.jsonl",
                           "{\"timestamp\": 1000, \"input_length\": 1024, \"output_length\": 64, \"hash_ids\": [0, 1]}\n"
                           "\n"
                           "{\"timestamp\": 1500, \"input_length\": 1024, \"output_length\": 64, \"hash_ids\": [0, 1]}\n"
                           "{\"timestamp\": 4000, \"input_length\": 1024, \"output_length\": 64, \"hash_ids\": [0, 2]}\n"
                           "{\"timestamp\": 9000, \"input_length\": 1024, \"output_length\": 64, \"hash_ids\": [3, 4]}\n");
  WorkloadOptions o;
  o.dataset = "trace:" + p.string();
  o.max_requests = 3;
  o.length_scale = 1.0 / 64;
  o.time_scale = 2.0;
  auto w = build_workload(o);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  ASSERT_EQ(w->requests.size(), 3u);
  EXPECT_DOUBLE_EQ(*w->requests[0].arrival_s, 0.0);
  EXPECT_DOUBLE_EQ(*w->requests[1].arrival_s, 1.0);
  EXPECT_DOUBLE_EQ(*w->requests[2].arrival_s, 6.0);
  // 48 block words; reused: both blocks of request 1, the first of request 2.
  EXPECT_NEAR(w->prefix_reuse, 24.0 / 48.0, 1e-12);

  const auto bad = temp_file("bad.jsonl", "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\n{oops\n");
  o.dataset = "trace:" + bad.string();
  auto e = build_workload(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("line 2"), std::string::npos) << e.status().message();
  o.dataset = "trace:/nonexistent/trace.jsonl";
  EXPECT_EQ(build_workload(o).status().code(), StatusCode::kNotFound);
  std::filesystem::remove(p);
  std::filesystem::remove(bad);
}

TEST(Trace, MooncakeConversationSliceReusesPrefixes) {
  const std::filesystem::path f =
      std::filesystem::path(CLEAVE_SOURCE_DIR) / ".." / "shared" / "traces" / "mooncake-conversation.jsonl";
  if (!std::filesystem::exists(f)) GTEST_SKIP() << f << " is absent";
  WorkloadOptions o;
  o.dataset = "trace:" + f.string();
  o.max_requests = 300;
  o.length_scale = 1.0 / 32;
  auto w = build_workload(o);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  EXPECT_EQ(w->requests.size(), 300u);
  EXPECT_GT(w->prefix_reuse, 0.05);  // the conversations re-send their history
  EXPECT_LT(w->prefix_reuse, 1.0);
}

TEST(Presets, ShapesScaleAndAgenticTurnsGrowTheirContext) {
  WorkloadOptions o;
  o.num_prompts = 40;
  o.scale = 0.05;
  for (const char* name : {"chat", "rag", "reasoning", "agentic"}) {
    o.dataset = std::string("preset:") + name;
    auto w = build_workload(o);
    ASSERT_TRUE(w.ok()) << name << ": " << w.status().to_string();
    EXPECT_EQ(w->requests.size(), 40u) << name;
    for (const auto& r : w->requests) {
      EXPECT_EQ(words(r.prompt), r.input_len) << name;
      EXPECT_GE(r.output_len, 1);
    }
  }
  o.dataset = "preset:rag";
  auto rag = build_workload(o).value();
  for (const auto& r : rag.requests) EXPECT_GE(r.input_len, static_cast<int64_t>(0.05 * 2048));
  // Only the shared instruction is a common prefix: passages come in varying order.
  EXPECT_GT(rag.prefix_reuse, 0.0);
  EXPECT_LT(rag.prefix_reuse, 0.2);
  o.dataset = "preset:reasoning";
  auto reasoning = build_workload(o).value();
  for (const auto& r : reasoning.requests) EXPECT_GT(r.output_len, r.input_len);

  o.dataset = "preset:agentic";
  auto ag = build_workload(o).value();
  int sessions = 0;
  for (size_t i = 0; i < ag.requests.size(); ++i) {
    const auto& r = ag.requests[i];
    if (r.depends_on < 0) {
      ++sessions;
      continue;
    }
    ASSERT_EQ(r.depends_on, static_cast<int64_t>(i) - 1);
    const auto& prev = ag.requests[i - 1];
    EXPECT_TRUE(r.prompt.starts_with(prev.prompt)) << i;  // the whole context is re-sent
    EXPECT_GT(r.input_len, prev.input_len + prev.output_len - 1);
  }
  EXPECT_GE(sessions, 4);
  EXPECT_LE(sessions, 8);  // 5-10 turns each
  EXPECT_GT(ag.prefix_reuse, 0.5);

  o.scale = 1.0;
  o.dataset = "preset:chat";
  const auto big = build_workload(o).value();
  o.scale = 0.1;
  const auto small = build_workload(o).value();
  int64_t big_in = 0, small_in = 0;
  for (const auto& r : big.requests) big_in += r.input_len;
  for (const auto& r : small.requests) small_in += r.input_len;
  EXPECT_NEAR(static_cast<double>(small_in) / big_in, 0.1, 0.01);
}

TEST(Random, LengthsFollowTheRangeRatio) {
  WorkloadOptions o;
  o.num_prompts = 200;
  o.random_input_len = 100;
  o.random_output_len = 10;
  o.random_range_ratio = 0.5;
  auto w = build_workload(o).value();
  ASSERT_EQ(w.requests.size(), 200u);
  int64_t lo = 1000, hi = 0;
  for (const auto& r : w.requests) {
    lo = std::min(lo, r.input_len);
    hi = std::max(hi, r.input_len);
    EXPECT_GE(r.output_len, 5);
    EXPECT_LE(r.output_len, 15);
    EXPECT_FALSE(r.arrival_s.has_value());
  }
  EXPECT_GE(lo, 50);
  EXPECT_LE(hi, 150);
  EXPECT_LT(lo, 60);
  EXPECT_GT(hi, 140);
  EXPECT_EQ(w.prefix_reuse, 0);
  o.random_range_ratio = 0;
  const auto fixed = build_workload(o);  // kept: a range-for over .value() of a temporary dangles
  ASSERT_TRUE(fixed.ok()) << fixed.status().to_string();
  for (const auto& r : fixed.value().requests) EXPECT_EQ(r.input_len, 100);
}

TEST(ShareGpt, FirstTurnIsThePromptAndTheReplySetsTheLength) {
  const auto p = temp_file("sharegpt.json", R"([
    {"id": "a", "conversations": [{"from": "human", "value": "tell me a story about a big red dog"},
                                  {"from": "gpt", "value": "once upon a time there was a dog"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there you"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "only one turn here at all"}]}
  ])");
  WorkloadOptions o;
  o.dataset = "sharegpt:" + p.string();
  o.num_prompts = 10;
  auto w = build_workload(o);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  ASSERT_EQ(w->requests.size(), 1u);  // "b" is too short, "c" has no reply
  EXPECT_EQ(w->requests[0].prompt, "tell me a story about a big red dog");
  EXPECT_EQ(w->requests[0].input_len, 9);
  EXPECT_EQ(w->requests[0].output_len, 8);
  const auto bad = temp_file("bad.json", "{\"not\": \"a list\"}");
  o.dataset = "sharegpt:" + bad.string();
  EXPECT_FALSE(build_workload(o).ok());
  std::filesystem::remove(p);
  std::filesystem::remove(bad);
}

// The tokenizers of the real models the tests have: stories260K (SPM) and, when the install
// put it in the cache, SmolLM2 (byte-level BPE).
std::vector<std::pair<std::string, std::string>> model_files() {
  std::vector<std::pair<std::string, std::string>> out;
  const auto stories =
      std::filesystem::path(CLEAVE_SOURCE_DIR) / ".." / "shared" / "models" / "stories260K.gguf";
  if (std::filesystem::exists(stories)) out.emplace_back("stories260K", stories.string());
  if (std::filesystem::exists(packaged_default_model_path())) {
    out.emplace_back("SmolLM2", packaged_default_model_path());
  }
  return out;
}

TEST(Tokens, OneTokenWordsAreOneTokenAloneAndInARow) {
  const auto models = model_files();
  if (models.empty()) GTEST_SKIP() << "no model with a tokenizer here";
  for (const auto& [name, path] : models) {
    auto tok = load_tokenizer(path);
    ASSERT_TRUE(tok.ok()) << name << ": " << tok.status().to_string();
    auto list = one_token_words(**tok, 1024);
    ASSERT_TRUE(list.ok()) << name << ": " << list.status().to_string();
    EXPECT_GE(list->size(), 16u) << name;
    EXPECT_LE(list->size(), 1024u) << name;
    for (const auto& w : *list) {
      ASSERT_EQ((*tok)->encode(w, {}).size(), 1u) << name << ": '" << w << "'";
      ASSERT_EQ((*tok)->encode(w + " " + w, {}).size(), 2u) << name << ": '" << w << "'";
    }
  }
}

TEST(Tokens, PromptsOfEveryKindEncodeToTheirInputLength) {
  const auto models = model_files();
  if (models.empty()) GTEST_SKIP() << "no model with a tokenizer here";
  const auto trace = temp_file(
      "tokens.jsonl",
      "{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 9, \"hash_ids\": [0, 1, 2]}\n"
      "{\"timestamp\": 10, \"input_length\": 1300, \"output_length\": 9, \"hash_ids\": [0, 1, "
      "3]}\n");
  for (const auto& [name, path] : models) {
    auto tok = load_tokenizer(path);
    ASSERT_TRUE(tok.ok()) << name << ": " << tok.status().to_string();
    WorkloadOptions o;
    o.tokenizer = std::shared_ptr<const Tokenizer>(std::move(*tok));
    o.num_prompts = 12;
    o.scale = 0.05;
    o.random_input_len = 77;
    o.random_range_ratio = 0.5;
    o.length_scale = 1.0 / 16;
    for (const std::string& d : std::vector<std::string>{
             "random", "preset:chat", "preset:rag", "preset:agentic", "trace:" + trace.string()}) {
      o.dataset = d;
      auto w = build_workload(o);
      ASSERT_TRUE(w.ok()) << name << " " << d << ": " << w.status().to_string();
      ASSERT_FALSE(w->requests.empty());
      for (const auto& r : w->requests) {
        EXPECT_EQ(static_cast<int64_t>(o.tokenizer->encode(r.prompt, {}).size()), r.input_len)
            << name << " " << d << ": '" << r.prompt.substr(0, 80) << "'";
      }
      if (d.starts_with("trace:")) {
        // Shared blocks are a shared prefix in tokens too.
        const auto a = o.tokenizer->encode(w->requests[0].prompt, {});
        const auto b = o.tokenizer->encode(w->requests[1].prompt, {});
        const size_t shared = 2 * 32;  // two 512-token blocks at 1/16
        ASSERT_GT(a.size(), shared);
        EXPECT_TRUE(std::equal(a.begin(), a.begin() + shared, b.begin())) << name;
      }
    }
  }
  std::filesystem::remove(trace);
}

TEST(Workload, BadOptionsNameTheValue) {
  WorkloadOptions o;
  o.dataset = "preset:poetry";
  auto e = build_workload(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("poetry"), std::string::npos);
  o.dataset = "imagenet";
  e = build_workload(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("imagenet"), std::string::npos);
  o.dataset = "random";
  o.num_prompts = 0;
  EXPECT_FALSE(build_workload(o).ok());
  o.num_prompts = 5;
  o.random_range_ratio = 1.5;
  EXPECT_NE(build_workload(o).status().message().find("1.5"), std::string::npos);
  o.random_range_ratio = 0;
  o.dataset = "preset:chat";
  o.scale = -1;
  EXPECT_FALSE(build_workload(o).ok());
}

}  // namespace
}  // namespace cleave::bench
