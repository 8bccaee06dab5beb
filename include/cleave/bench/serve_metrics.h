// The figures of `cleave bench serve`, defined exactly as vLLM's `vllm bench serve` defines them
// (vllm/benchmarks/serve.py, lib/endpoint_request_func.py), from one record per request.
//
// Per request (SseTimeline): the clock starts when the request is sent. TTFT is the time to the
// first stream event carrying content (non-empty `text`, `delta.content` or
// `delta.reasoning_content`); ITL is the gap between consecutive content events; the latency
// (E2EL) ends at the last event carrying choices. Output tokens come from the final
// `usage.completion_tokens` (the bench asks for it with stream_options.include_usage); a
// stream without usage counts its content events instead. A request fails on a non-200 status,
// a transport error, an error event, or a stream with no content event.
//
// Over the run (compute_metrics), for the completed requests only: TPOT = (E2EL - TTFT) /
// (output tokens - 1) for requests with more than one output token; ITL pooled over all
// requests; mean, median, population standard deviation and linearly interpolated percentiles
// (numpy's defaults); throughputs over the benchmark duration; goodput = completed requests
// meeting every given SLO (metric <= limit; a request with one output token has TPOT 0 there,
// as in vLLM) per second; max_concurrent_requests and max_output_tokens_per_s from one-second
// buckets of the run. Times inside the library are seconds; reports print milliseconds.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"

namespace cleave::bench {

// One request's outcome; times in seconds.
struct RequestRecord {
  bool success = false;
  std::string error;          // why it failed (empty when it succeeded)
  double start_s = 0;         // when it was sent, from the start of the run
  double ttft_s = 0;          // send -> first content event
  double latency_s = 0;       // send -> last event with choices (E2EL)
  std::vector<double> itl_s;  // gaps between consecutive content events
  int64_t output_tokens = 0;  // usage.completion_tokens, else the number of content events
  bool output_from_usage = false;
  int64_t prompt_tokens = -1;  // usage.prompt_tokens; -1 when the server did not say
  // usage.prompt_tokens_details.cached_tokens: prompt tokens the server's prefix cache served;
  // -1 when the server did not say
  int64_t cached_prompt_tokens = -1;
  int64_t input_len = 0;       // the prompt length the workload asked for (tokens)
  std::string generated_text;
};

// Builds a RequestRecord from the bytes of an SSE response body as they arrive. Events are
// separated by a blank line ("\n\n" or "\r\n\r\n"); only `data:` lines are read; "[DONE]" ends
// the stream. Each event is stamped with the time of the feed() that completed it.
class SseTimeline {
 public:
  explicit SseTimeline(double start_s, int64_t input_len = 0);
  // `now_s` on the same clock as `start_s`.
  void feed(double now_s, std::string_view bytes);
  bool done() const { return done_; }
  // The record, given the HTTP status (0 when no response arrived) and, when the transport
  // failed, why. A non-200 status takes `body_for_error` (the response body) as the message.
  RequestRecord finish(int http_status, std::string_view transport_error = {},
                       std::string_view body_for_error = {});

 private:
  void on_event(double now_s, std::string_view data);

  RequestRecord r_;
  std::string pending_;
  bool done_ = false;
  bool have_content_ = false;
  bool have_choices_ = false;
  double last_content_s_ = 0;
  double last_choice_s_ = 0;
  int64_t content_events_ = 0;
  int64_t usage_completion_ = -1;
  std::string error_;
};

// SLO limits in milliseconds (vLLM's --goodput "ttft:MS tpot:MS e2el:MS").
struct GoodputSlo {
  std::optional<double> ttft_ms, tpot_ms, e2el_ms;
  bool any() const { return ttft_ms || tpot_ms || e2el_ms; }
};

// "ttft:500" tokens (one or more, separated by spaces or commas); the key names the bad token.
Result<GoodputSlo> parse_goodput(const std::vector<std::string>& tokens);
// "50,90,99" -> {50, 90, 99}; each in (0, 100].
Result<std::vector<double>> parse_percentiles(std::string_view text);

// True when a completed request meets every SLO (failed requests never do).
bool meets_slo(const RequestRecord& r, const GoodputSlo& slo);

struct Summary {  // in milliseconds
  double mean = 0, median = 0, std = 0;
  std::vector<std::pair<double, double>> percentiles;  // (p, value)
};

// numpy's mean / median / std (ddof 0) / percentile (linear) of `values` (seconds) in ms; an
// empty list summarizes as zeros (np.mean(x or 0)).
Summary summarize_ms(const std::vector<double>& values_s, const std::vector<double>& percentiles);

struct BenchMetrics {
  int64_t completed = 0, failed = 0;
  double duration_s = 0;
  int64_t total_input_tokens = 0, total_output_tokens = 0;
  // Prompt tokens the server's prefix cache served, over the completed requests that said
  // (usage.prompt_tokens_details.cached_tokens), and their share of those requests' prompt
  // tokens (0 when none said).
  int64_t total_cached_input_tokens = 0;
  double prefix_cache_hit_rate = 0;
  double request_throughput = 0, output_throughput = 0, total_token_throughput = 0;
  double request_goodput = 0;  // requests/s meeting every SLO (0 when no SLO is given)
  int64_t good_completed = 0;
  Summary ttft, tpot, itl, e2el;
  double max_output_tokens_per_s = 0;
  int64_t max_concurrent_requests = 0;
};

// `duration_s`: from the first send to the last completion (vLLM's benchmark_duration).
// Input tokens per request: the server's usage.prompt_tokens when it gave one, else input_len.
BenchMetrics compute_metrics(const std::vector<RequestRecord>& records, double duration_s,
                             const GoodputSlo& slo, const std::vector<double>& percentiles);

}  // namespace cleave::bench
