// Datasets read from files: Mooncake traces (JSONL) and ShareGPT (JSON).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "cleave/model/tokenizer.h"
#include "workload_internal.h"

namespace cleave::bench {
namespace {

constexpr int64_t kTraceBlockTokens = 512;

int64_t count_words(std::string_view s) {
  int64_t n = 0;
  bool in_word = false;
  for (char c : s) {
    const bool space = c == ' ' || c == '\n' || c == '\t' || c == '\r';
    if (!space && !in_word) ++n;
    in_word = !space;
  }
  return n;
}

}  // namespace

Result<TraceEntry> parse_trace_line(std::string_view line, int64_t line_no) {
  const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return InvalidArgument(fmt::format("trace line {} is not a JSON object", line_no));
  }
  TraceEntry e;
  const auto number = [&](const char* key, bool required, double* out) -> Status {
    auto it = j.find(key);
    if (it == j.end()) {
      return required ? InvalidArgument(fmt::format("trace line {} has no '{}'", line_no, key))
                      : Status::Ok();
    }
    if (!it->is_number() || it->get<double>() < 0) {
      return InvalidArgument(
          fmt::format("trace line {}: '{}' is {}, not a non-negative number", line_no, key, it->dump()));
    }
    *out = it->get<double>();
    return Status::Ok();
  };
  double in = 0, out = 0;
  CLEAVE_RETURN_IF_ERROR(number("timestamp", true, &e.timestamp_ms));
  CLEAVE_RETURN_IF_ERROR(number("input_length", true, &in));
  CLEAVE_RETURN_IF_ERROR(number("output_length", true, &out));
  e.input_length = static_cast<int64_t>(in);
  e.output_length = static_cast<int64_t>(out);
  if (auto h = j.find("hash_ids"); h != j.end()) {
    if (!h->is_array()) {
      return InvalidArgument(fmt::format("trace line {}: 'hash_ids' is not a list", line_no));
    }
    for (const auto& id : *h) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0) {
        return InvalidArgument(
            fmt::format("trace line {}: hash id {} is not a non-negative integer", line_no, id.dump()));
      }
      e.hash_ids.push_back(id.get<int64_t>());
    }
  }
  return e;
}

WorkloadRequest trace_request(const TraceEntry& e, double time_scale, double length_scale,
                              const WordList& list, std::vector<PromptBlock>* chain) {
  const int64_t block = std::max<int64_t>(1, std::llround(kTraceBlockTokens * length_scale));
  int64_t left = std::max<int64_t>(1, std::llround(static_cast<double>(e.input_length) * length_scale));
  PromptBuilder p(list);
  for (const int64_t id : e.hash_ids) {
    if (left <= 0) break;
    const int64_t words = std::min(block, left);
    p.add(static_cast<uint64_t>(id), words);
    left -= words;
  }
  // Lengths beyond the listed blocks (or no blocks at all): text of its own, shared with no one.
  if (left > 0) {
    p.add((1ull << 63) | (std::hash<double>{}(e.timestamp_ms) ^ static_cast<uint64_t>(e.input_length)),
          left);
  }
  WorkloadRequest r = p.request(std::llround(static_cast<double>(e.output_length) * length_scale));
  r.arrival_s = e.timestamp_ms / 1000.0 * time_scale;
  if (chain) *chain = p.blocks;
  return r;
}

WorkloadRequest trace_request(const TraceEntry& e, double time_scale, double length_scale,
                              const WordList& list) {
  return trace_request(e, time_scale, length_scale, list, nullptr);
}

Result<Workload> trace_workload(const std::string& path, const WorkloadOptions& o,
                                const WordList& list,
                                std::vector<std::vector<PromptBlock>>* chains) {
  if (!(o.time_scale >= 0) || !std::isfinite(o.time_scale)) {
    return InvalidArgument(fmt::format("--time-scale {} is not a non-negative number", o.time_scale));
  }
  if (!(o.length_scale > 0) || !std::isfinite(o.length_scale)) {
    return InvalidArgument(fmt::format("--length-scale {} is not a positive number", o.length_scale));
  }
  if (o.max_requests <= 0) {
    return InvalidArgument(fmt::format("--max-requests {} is not positive", o.max_requests));
  }
  std::ifstream f(path);
  if (!f) return NotFound(fmt::format("cannot open trace file '{}'", path));
  Workload w;
  w.name = "trace:" + path;
  std::string line;
  int64_t line_no = 0;
  double first_ms = -1;
  while (static_cast<int64_t>(w.requests.size()) < o.max_requests && std::getline(f, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto e = parse_trace_line(line, line_no);
    if (!e.ok()) return e.status().with_context(path);
    if (first_ms < 0) first_ms = e->timestamp_ms;
    e->timestamp_ms -= first_ms;  // a slice that starts late still starts at once
    std::vector<PromptBlock> chain;
    w.requests.push_back(trace_request(*e, o.time_scale, o.length_scale, list, &chain));
    chains->push_back(std::move(chain));
  }
  if (w.requests.empty()) return InvalidArgument(fmt::format("trace file '{}' has no requests", path));
  return w;
}

Result<Workload> sharegpt_workload(const std::string& path, const WorkloadOptions& o,
                                   std::vector<std::vector<PromptBlock>>* chains) {
  std::ifstream f(path);
  if (!f) return NotFound(fmt::format("cannot open ShareGPT file '{}'", path));
  std::stringstream ss;
  ss << f.rdbuf();
  const auto j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_array()) {
    return InvalidArgument(fmt::format("ShareGPT file '{}' is not a JSON list", path));
  }
  // Lengths in tokens of the workload's tokenizer (vLLM's way), else in words.
  const auto length_of = [&](const std::string& text) -> int64_t {
    if (!o.tokenizer) return count_words(text);
    return static_cast<int64_t>(o.tokenizer->encode(text, EncodeOptions{}).size());
  };
  struct Pair {
    std::string prompt;
    int64_t in = 0, out = 0;
  };
  std::vector<Pair> pairs;
  for (const auto& conv : j) {
    if (!conv.is_object()) continue;
    auto c = conv.find("conversations");
    if (c == conv.end() || !c->is_array() || c->size() < 2) continue;
    const auto& q = (*c)[0];
    const auto& a = (*c)[1];
    if (!q.is_object() || !a.is_object() || !q.contains("value") || !a.contains("value") ||
        !q["value"].is_string() || !a["value"].is_string()) {
      continue;
    }
    const std::string prompt = q["value"].get<std::string>();
    const int64_t in = length_of(prompt), out = length_of(a["value"].get<std::string>());
    // vLLM's filter: at least 4 tokens each, at most 1024 of prompt and 2048 in all.
    if (in < 4 || out < 4 || in > 1024 || in + out > 2048) continue;
    pairs.push_back({prompt, in, out});
  }
  if (pairs.empty()) {
    return InvalidArgument(fmt::format("ShareGPT file '{}' has no usable conversation", path));
  }
  std::mt19937_64 rng(o.seed);
  std::shuffle(pairs.begin(), pairs.end(), rng);
  Workload w;
  w.name = "sharegpt:" + path;
  for (size_t i = 0; static_cast<int64_t>(w.requests.size()) < o.num_prompts && i < pairs.size(); ++i) {
    WorkloadRequest r;
    r.prompt = pairs[i].prompt;
    r.input_len = pairs[i].in;
    r.output_len = pairs[i].out;
    chains->push_back({PromptBlock{std::hash<std::string>{}(r.prompt), r.input_len}});
    w.requests.push_back(std::move(r));
  }
  return w;
}

}  // namespace cleave::bench
