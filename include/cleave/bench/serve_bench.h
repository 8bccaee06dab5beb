// `cleave bench serve`: replays a Workload against one OpenAI-compatible HTTP endpoint and
// measures every request (serve_metrics.h), as vLLM's `vllm bench serve` does.
//
// The client is Boost.Beast over plain HTTP/1.1 with keep-alive connections (at most one per
// request in flight), streaming (`"stream": true` with `stream_options.include_usage`), and it
// connects only to the host and port of `base_url`. Requests are sent at their arrival times
// (the workload's own, or gamma draws from request_rate / burstiness; rate infinity sends all
// at once), at most max_concurrency at a time (later arrivals wait for a slot), agentic turns
// after the turn they follow. The run is bounded: every request has request_timeout, and the
// whole run max_duration; requests not finished by then are cancelled and count as failed.
//
// Threading: run_serve_bench() runs one io_context on the calling thread and returns when the
// run is over; it is not reentrant per call but independent calls may run on different threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cleave/bench/serve_metrics.h"
#include "cleave/bench/workload.h"
#include "cleave/common/status.h"
#include "nlohmann/json.hpp"

namespace cleave::bench {

// http://HOST[:PORT][/PREFIX]
struct BaseUrl {
  std::string host;
  uint16_t port = 80;
  std::string prefix;  // "" or "/something" (no trailing slash)
};
Result<BaseUrl> parse_base_url(std::string_view url);

struct ServeBenchOptions {
  std::string base_url = "http://127.0.0.1:8000";
  std::string endpoint = "completions";  // completions | chat
  std::string model;                     // empty: the first of GET /v1/models
  std::string api_key;
  double request_rate = std::numeric_limits<double>::infinity();
  double burstiness = 1.0;
  int64_t max_concurrency = 0;  // 0: no cap
  uint64_t seed = 0;
  bool ignore_eos = false;
  double temperature = 0.0;
  GoodputSlo goodput;
  std::vector<double> percentiles{99};
  std::chrono::milliseconds request_timeout{std::chrono::minutes(10)};
  std::chrono::milliseconds max_duration{std::chrono::minutes(30)};
  bool progress = true;  // a progress bar on stderr
};

// Checks the options that do not need the server (InvalidArgument names the bad value).
Status validate(const ServeBenchOptions& options);

// The model the server lists first (GET {base}/v1/models), for an empty --model.
Result<std::string> first_served_model(const ServeBenchOptions& options);

struct ServeBenchRun {
  std::string model;
  std::vector<RequestRecord> records;  // in workload order
  double duration_s = 0;               // first send -> last completion
  BenchMetrics metrics;
};

// Runs the workload (options.model must be set; see first_served_model()).
Result<ServeBenchRun> run_serve_bench(const ServeBenchOptions& options, const Workload& workload);

// vLLM's result JSON (its keys, plus the run's settings and the per-request lists).
nlohmann::ordered_json result_json(const ServeBenchOptions& options, const Workload& workload,
                                   const ServeBenchRun& run);
// vLLM's "Serving Benchmark Result" report.
std::string format_report(const ServeBenchOptions& options, const Workload& workload,
                          const ServeBenchRun& run);

}  // namespace cleave::bench
