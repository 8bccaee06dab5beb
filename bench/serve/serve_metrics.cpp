// Per-request timelines from SSE bytes, and the run's figures as vLLM computes them.
#include "cleave/bench/serve_metrics.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace cleave::bench {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

// The text a choice carries: completions' `text`, chat's `delta.content` and
// `delta.reasoning_content`.
std::string choice_text(const nlohmann::json& choice) {
  std::string out;
  const auto take = [&out](const nlohmann::json& obj, const char* key) {
    auto it = obj.find(key);
    if (it != obj.end() && it->is_string()) out += it->get<std::string>();
  };
  take(choice, "text");
  if (auto d = choice.find("delta"); d != choice.end() && d->is_object()) {
    take(*d, "reasoning_content");
    take(*d, "content");
  }
  return out;
}

}  // namespace

SseTimeline::SseTimeline(double start_s, int64_t input_len) {
  r_.start_s = start_s;
  r_.input_len = input_len;
  last_content_s_ = start_s;
}

void SseTimeline::feed(double now_s, std::string_view bytes) {
  if (done_) return;
  pending_.append(bytes.data(), bytes.size());
  for (;;) {
    size_t end = pending_.find("\n\n");
    size_t sep = 2;
    const size_t crlf = pending_.find("\r\n\r\n");
    if (crlf != std::string::npos && (end == std::string::npos || crlf < end)) {
      end = crlf;
      sep = 4;
    }
    if (end == std::string::npos) return;
    std::string event = pending_.substr(0, end);
    pending_.erase(0, end + sep);
    std::string data;
    size_t pos = 0;
    while (pos <= event.size()) {
      size_t nl = event.find('\n', pos);
      if (nl == std::string::npos) nl = event.size();
      std::string_view line = trim(std::string_view(event).substr(pos, nl - pos));
      if (line.starts_with("data:")) {
        if (!data.empty()) data += '\n';
        data += trim(line.substr(5));
      }
      pos = nl + 1;
    }
    if (!data.empty()) on_event(now_s, data);
    if (done_) return;
  }
}

void SseTimeline::on_event(double now_s, std::string_view data) {
  if (data == "[DONE]") {
    done_ = true;
    return;
  }
  const nlohmann::json j = nlohmann::json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    if (error_.empty()) error_ = fmt::format("a stream event is not JSON: {}", data.substr(0, 200));
    return;
  }
  if (auto e = j.find("error"); e != j.end() && !e->is_null()) {
    if (error_.empty()) {
      error_ = e->is_object() && e->contains("message") && (*e)["message"].is_string()
                   ? (*e)["message"].get<std::string>()
                   : e->dump();
    }
    return;
  }
  if (auto c = j.find("choices"); c != j.end() && c->is_array() && !c->empty()) {
    have_choices_ = true;
    last_choice_s_ = now_s;
    const std::string text = choice_text((*c)[0]);
    if (!text.empty()) {
      if (!have_content_) {
        have_content_ = true;
        r_.ttft_s = now_s - r_.start_s;
      } else {
        r_.itl_s.push_back(now_s - last_content_s_);
      }
      last_content_s_ = now_s;
      ++content_events_;
      r_.generated_text += text;
    }
  }
  if (auto u = j.find("usage"); u != j.end() && u->is_object()) {
    if (auto ct = u->find("completion_tokens"); ct != u->end() && ct->is_number_integer()) {
      usage_completion_ = ct->get<int64_t>();
    }
    if (auto pt = u->find("prompt_tokens"); pt != u->end() && pt->is_number_integer()) {
      r_.prompt_tokens = pt->get<int64_t>();
    }
    if (auto d = u->find("prompt_tokens_details"); d != u->end() && d->is_object()) {
      if (auto ct = d->find("cached_tokens"); ct != d->end() && ct->is_number_integer()) {
        r_.cached_prompt_tokens = ct->get<int64_t>();
      }
    }
  }
}

RequestRecord SseTimeline::finish(int http_status, std::string_view transport_error,
                                  std::string_view body_for_error) {
  RequestRecord r = r_;
  r.success = false;
  if (http_status != 0 && http_status != 200) {
    r.error = fmt::format("HTTP {}: {}", http_status, trim(body_for_error.substr(0, 500)));
  } else if (!transport_error.empty()) {
    r.error = std::string(transport_error);
  } else if (!error_.empty()) {
    r.error = error_;
  } else if (!have_content_) {
    r.error = "the stream carried no content";
  } else {
    r.success = true;
  }
  if (!r.success) {
    r.ttft_s = 0;
    r.itl_s.clear();
    r.latency_s = 0;
    r.output_tokens = 0;
    return r;
  }
  r.latency_s = std::max(last_choice_s_, last_content_s_) - r.start_s;
  r.output_from_usage = usage_completion_ >= 0;
  r.output_tokens = r.output_from_usage ? usage_completion_ : content_events_;
  return r;
}

Result<GoodputSlo> parse_goodput(const std::vector<std::string>& tokens) {
  GoodputSlo slo;
  std::vector<std::string> items;
  for (const auto& t : tokens) {
    size_t pos = 0;
    while (pos <= t.size()) {
      size_t end = t.find_first_of(", ", pos);
      if (end == std::string::npos) end = t.size();
      if (end > pos) items.push_back(t.substr(pos, end - pos));
      pos = end + 1;
    }
  }
  for (const auto& item : items) {
    const size_t colon = item.find(':');
    if (colon == std::string::npos) {
      return InvalidArgument(fmt::format("goodput '{}' is not KEY:MS (ttft, tpot or e2el)", item));
    }
    const std::string key = item.substr(0, colon);
    const std::string value = item.substr(colon + 1);
    char* end = nullptr;
    const double ms = std::strtod(value.c_str(), &end);
    if (value.empty() || end != value.c_str() + value.size() || !std::isfinite(ms) || ms < 0) {
      return InvalidArgument(
          fmt::format("goodput '{}': '{}' is not a non-negative number of milliseconds", item, value));
    }
    if (key == "ttft") slo.ttft_ms = ms;
    else if (key == "tpot") slo.tpot_ms = ms;
    else if (key == "e2el") slo.e2el_ms = ms;
    else
      return InvalidArgument(
          fmt::format("goodput '{}': unknown metric '{}' (ttft, tpot or e2el)", item, key));
  }
  return slo;
}

Result<std::vector<double>> parse_percentiles(std::string_view text) {
  std::vector<double> out;
  size_t pos = 0;
  const std::string s(text);
  while (pos <= s.size()) {
    size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    const std::string item(trim(std::string_view(s).substr(pos, end - pos)));
    char* e = nullptr;
    const double p = std::strtod(item.c_str(), &e);
    if (item.empty() || e != item.c_str() + item.size() || !(p > 0 && p <= 100)) {
      return InvalidArgument(fmt::format("percentile '{}' is not a number in (0, 100]", item));
    }
    out.push_back(p);
    pos = end + 1;
  }
  return out;
}

namespace {

double tpot_of(const RequestRecord& r) {
  return r.output_tokens > 1 ? (r.latency_s - r.ttft_s) / static_cast<double>(r.output_tokens - 1)
                             : 0.0;
}

// numpy.percentile, method "linear", on sorted values.
double percentile_sorted(const std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  const double rank = p / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - static_cast<double>(lo));
}

}  // namespace

bool meets_slo(const RequestRecord& r, const GoodputSlo& slo) {
  if (!r.success) return false;
  if (slo.ttft_ms && r.ttft_s * 1000.0 > *slo.ttft_ms) return false;
  if (slo.tpot_ms && tpot_of(r) * 1000.0 > *slo.tpot_ms) return false;
  if (slo.e2el_ms && r.latency_s * 1000.0 > *slo.e2el_ms) return false;
  return true;
}

Summary summarize_ms(const std::vector<double>& values_s, const std::vector<double>& percentiles) {
  Summary s;
  std::vector<double> v = values_s;
  for (auto& x : v) x *= 1000.0;
  std::sort(v.begin(), v.end());
  if (!v.empty()) {
    s.mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
    double sq = 0;
    for (double x : v) sq += (x - s.mean) * (x - s.mean);
    s.std = std::sqrt(sq / static_cast<double>(v.size()));
    s.median = percentile_sorted(v, 50);
  }
  for (double p : percentiles) s.percentiles.emplace_back(p, percentile_sorted(v, p));
  return s;
}

BenchMetrics compute_metrics(const std::vector<RequestRecord>& records, double duration_s,
                             const GoodputSlo& slo, const std::vector<double>& percentiles) {
  BenchMetrics m;
  m.duration_s = duration_s;
  std::vector<double> ttfts, tpots, itls, e2els;
  int64_t input_of_cache_reports = 0;  // prompt tokens of the requests that reported a cache
  for (const auto& r : records) {
    if (!r.success) {
      ++m.failed;
      continue;
    }
    ++m.completed;
    const int64_t input = r.prompt_tokens >= 0 ? r.prompt_tokens : r.input_len;
    m.total_input_tokens += input;
    if (r.cached_prompt_tokens >= 0) {
      m.total_cached_input_tokens += r.cached_prompt_tokens;
      input_of_cache_reports += input;
    }
    m.total_output_tokens += r.output_tokens;
    if (r.output_tokens > 1) tpots.push_back(tpot_of(r));
    itls.insert(itls.end(), r.itl_s.begin(), r.itl_s.end());
    ttfts.push_back(r.ttft_s);
    e2els.push_back(r.latency_s);
    if (slo.any() && meets_slo(r, slo)) ++m.good_completed;
  }
  if (duration_s > 0) {
    m.request_throughput = static_cast<double>(m.completed) / duration_s;
    m.output_throughput = static_cast<double>(m.total_output_tokens) / duration_s;
    m.total_token_throughput =
        static_cast<double>(m.total_input_tokens + m.total_output_tokens) / duration_s;
    m.request_goodput = static_cast<double>(m.good_completed) / duration_s;
  }
  if (input_of_cache_reports > 0) {
    m.prefix_cache_hit_rate = static_cast<double>(m.total_cached_input_tokens) /
                              static_cast<double>(input_of_cache_reports);
  }
  m.ttft = summarize_ms(ttfts, percentiles);
  m.tpot = summarize_ms(tpots, percentiles);
  m.itl = summarize_ms(itls, percentiles);
  m.e2el = summarize_ms(e2els, percentiles);

  // One-second buckets from the first send of a completed request: tokens that arrived in each
  // (the first at TTFT, then one per ITL gap) and requests active during each.
  double t0 = 0, t1 = 0;
  bool any = false;
  for (const auto& r : records) {
    if (!r.success) continue;
    t0 = any ? std::min(t0, r.start_s) : r.start_s;
    t1 = any ? std::max(t1, r.start_s + r.latency_s) : r.start_s + r.latency_s;
    any = true;
  }
  if (any) {
    const size_t buckets = static_cast<size_t>(std::ceil(t1 - t0)) + 1;
    std::vector<double> tokens(buckets, 0), active(buckets, 0);
    for (const auto& r : records) {
      if (!r.success) continue;
      double t = r.start_s + r.ttft_s;
      const auto add_token = [&](double at) {
        const double b = std::floor(at - t0);
        if (b >= 0 && b < static_cast<double>(buckets)) tokens[static_cast<size_t>(b)] += 1;
      };
      add_token(t);
      for (double gap : r.itl_s) {
        t += gap;
        add_token(t);
      }
      const size_t first = static_cast<size_t>(r.start_s - t0);
      const size_t last = std::min(buckets - 1, static_cast<size_t>(r.start_s + r.latency_s - t0));
      for (size_t b = first; b <= last; ++b) active[b] += 1;
    }
    m.max_output_tokens_per_s = *std::max_element(tokens.begin(), tokens.end());
    m.max_concurrent_requests = static_cast<int64_t>(*std::max_element(active.begin(), active.end()));
  }
  return m;
}

}  // namespace cleave::bench
