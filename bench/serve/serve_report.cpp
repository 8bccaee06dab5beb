// The result JSON (vLLM's keys) and the printed report of `cleave bench serve`.
#include <cmath>
#include <ctime>

#include <fmt/format.h>

#include "cleave/bench/serve_bench.h"

namespace cleave::bench {
namespace {

struct MetricName {
  const char* key;    // ttft -> mean_ttft_ms...
  const char* title;  // the report's section header
  const char* label;  // "TTFT"
};
constexpr MetricName kMetrics[] = {
    {"ttft", "Time to First Token", "TTFT"},
    {"tpot", "Time per Output Token (excl. 1st token)", "TPOT"},
    {"itl", "Inter-token Latency", "ITL"},
    {"e2el", "End-to-end Latency", "E2EL"},
};

const Summary& summary_of(const BenchMetrics& m, std::string_view key) {
  if (key == "ttft") return m.ttft;
  if (key == "tpot") return m.tpot;
  if (key == "itl") return m.itl;
  return m.e2el;
}

// vLLM names percentile keys p99 / p99.9: integral values without a decimal point.
std::string percentile_word(double p) {
  return p == std::floor(p) ? fmt::format("{}", static_cast<int64_t>(p)) : fmt::format("{}", p);
}

std::string rate_text(double rate) { return std::isinf(rate) ? "inf" : fmt::format("{}", rate); }

std::string centered(std::string_view title, char fill) {
  constexpr size_t kWidth = 50;
  std::string t(title);
  if (t.size() >= kWidth) return t;
  const size_t left = (kWidth - t.size()) / 2;
  return std::string(left, fill) + t + std::string(kWidth - t.size() - left, fill);
}

}  // namespace

nlohmann::ordered_json result_json(const ServeBenchOptions& o, const Workload& w,
                                   const ServeBenchRun& run) {
  const BenchMetrics& m = run.metrics;
  nlohmann::ordered_json j;
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y%m%d-%H%M%S", std::localtime(&now));
  j["date"] = date;
  j["endpoint_type"] = o.endpoint == "chat" ? "openai-chat" : "openai";
  j["backend"] = j["endpoint_type"];
  j["label"] = nullptr;
  j["model_id"] = run.model;
  j["tokenizer_id"] = nullptr;
  j["dataset"] = w.name;
  j["num_prompts"] = w.requests.size();
  if (std::isinf(o.request_rate)) j["request_rate"] = "inf";
  else j["request_rate"] = o.request_rate;
  j["burstiness"] = o.burstiness;
  if (o.max_concurrency > 0) j["max_concurrency"] = o.max_concurrency;
  else j["max_concurrency"] = nullptr;
  nlohmann::ordered_json goodput = nlohmann::ordered_json::object();
  if (o.goodput.ttft_ms) goodput["ttft"] = *o.goodput.ttft_ms;
  if (o.goodput.tpot_ms) goodput["tpot"] = *o.goodput.tpot_ms;
  if (o.goodput.e2el_ms) goodput["e2el"] = *o.goodput.e2el_ms;
  j["goodput"] = o.goodput.any() ? goodput : nlohmann::ordered_json(nullptr);
  j["duration"] = m.duration_s;
  j["completed"] = m.completed;
  j["failed"] = m.failed;
  j["total_input_tokens"] = m.total_input_tokens;
  j["total_output_tokens"] = m.total_output_tokens;
  j["total_cached_input_tokens"] = m.total_cached_input_tokens;
  j["prefix_cache_hit_rate"] = m.prefix_cache_hit_rate;
  j["request_throughput"] = m.request_throughput;
  if (o.goodput.any()) j["request_goodput"] = m.request_goodput;
  else j["request_goodput"] = nullptr;
  j["output_throughput"] = m.output_throughput;
  j["total_token_throughput"] = m.total_token_throughput;
  j["max_output_tokens_per_s"] = m.max_output_tokens_per_s;
  j["max_concurrent_requests"] = m.max_concurrent_requests;
  j["dataset_prefix_reuse"] = w.prefix_reuse;
  for (const auto& name : kMetrics) {
    const Summary& s = summary_of(m, name.key);
    j[fmt::format("mean_{}_ms", name.key)] = s.mean;
    j[fmt::format("median_{}_ms", name.key)] = s.median;
    j[fmt::format("std_{}_ms", name.key)] = s.std;
    for (const auto& [p, v] : s.percentiles) {
      j[fmt::format("p{}_{}_ms", percentile_word(p), name.key)] = v;
    }
  }
  // Per request, in workload order (seconds, as vLLM saves them).
  auto input_lens = nlohmann::ordered_json::array(), output_lens = nlohmann::ordered_json::array(),
       ttfts = nlohmann::ordered_json::array(), itls = nlohmann::ordered_json::array(),
       e2els = nlohmann::ordered_json::array(), start_times = nlohmann::ordered_json::array(),
       texts = nlohmann::ordered_json::array(), errors = nlohmann::ordered_json::array();
  for (const auto& r : run.records) {
    input_lens.push_back(r.prompt_tokens >= 0 ? r.prompt_tokens : r.input_len);
    output_lens.push_back(r.success ? r.output_tokens : 0);
    ttfts.push_back(r.ttft_s);
    itls.push_back(r.itl_s);
    e2els.push_back(r.latency_s);
    start_times.push_back(r.start_s);
    texts.push_back(r.generated_text);
    errors.push_back(r.error);
  }
  j["input_lens"] = std::move(input_lens);
  j["output_lens"] = std::move(output_lens);
  j["ttfts"] = std::move(ttfts);
  j["itls"] = std::move(itls);
  j["e2els"] = std::move(e2els);
  j["start_times"] = std::move(start_times);
  j["generated_texts"] = std::move(texts);
  j["errors"] = std::move(errors);
  return j;
}

std::string format_report(const ServeBenchOptions& o, const Workload& w, const ServeBenchRun& run) {
  const BenchMetrics& m = run.metrics;
  std::string out;
  const auto line = [&out](std::string_view label, const std::string& value) {
    out += fmt::format("{:<40} {:<10}\n", label, value);
  };
  const auto num = [](double v) { return fmt::format("{:.2f}", v); };
  out += centered(" Serving Benchmark Result ", '=') + "\n";
  line("Successful requests:", std::to_string(m.completed));
  line("Failed requests:", std::to_string(m.failed));
  if (o.max_concurrency > 0) line("Maximum request concurrency:", std::to_string(o.max_concurrency));
  line("Request rate configured (RPS):", rate_text(o.request_rate));
  line("Benchmark duration (s):", num(m.duration_s));
  line("Total input tokens:", std::to_string(m.total_input_tokens));
  line("Total generated tokens:", std::to_string(m.total_output_tokens));
  line("Prompt tokens from prefix cache:",
       fmt::format("{} ({:.1f}%)", m.total_cached_input_tokens, 100.0 * m.prefix_cache_hit_rate));
  line("Request throughput (req/s):", num(m.request_throughput));
  if (o.goodput.any()) line("Request goodput (req/s):", num(m.request_goodput));
  line("Output token throughput (tok/s):", num(m.output_throughput));
  line("Peak output token throughput (tok/s):", num(m.max_output_tokens_per_s));
  line("Peak concurrent requests:", std::to_string(m.max_concurrent_requests));
  line("Total Token throughput (tok/s):", num(m.total_token_throughput));
  for (const auto& name : kMetrics) {
    const Summary& s = summary_of(m, name.key);
    out += centered(name.title, '-') + "\n";
    line(fmt::format("Mean {} (ms):", name.label), num(s.mean));
    line(fmt::format("Median {} (ms):", name.label), num(s.median));
    for (const auto& [p, v] : s.percentiles) {
      line(fmt::format("P{} {} (ms):", percentile_word(p), name.label), num(v));
    }
  }
  out += std::string(50, '=') + "\n";
  if (w.name.starts_with("trace:") || w.name == "preset:rag" || w.name == "preset:agentic") {
    out += fmt::format("Prompt words whose prefix was sent before: {:.1f}%\n", 100 * w.prefix_reuse);
  }
  return out;
}

}  // namespace cleave::bench
