// The router's request metrics (Prometheus names as vLLM's, with the cleave: prefix):
//   cleave:num_requests_running / cleave:num_requests_waiting   gauges: requests (dispatches,
//       one per choice) in flight at this router that have had their first token / not yet
//   cleave:time_to_first_token_seconds      arrival at the router -> first token
//   cleave:time_per_output_token_seconds    gap between consecutive tokens (inter-token latency)
//   cleave:e2e_request_latency_seconds      arrival -> last token
//   cleave:request_queue_time_seconds       arrival -> first computed by a worker's engine: the
//                                           router's part (parsing, chat template,
//                                           tokenization) plus the wait in the worker engine's
//                                           queue (TokenEvent.queue_seconds of the first token)
//   cleave:prompt_tokens_total, cleave:generation_tokens_total
//   cleave:prompt_tokens_cached_total       prompt tokens the workers' prefix caches served
//                                           (usage.cached_prompt_tokens); over
//                                           prompt_tokens_total, the prefix-cache hit rate
//   cleave:request_success_total{finished_reason="stop|length|abort"}
//   cleave:http_requests_total{handler,status}   every HTTP response by route and status
//   cleave:grpc_requests_total{method,code}      every gRPC API call by method and status code
//   cleave:kv_cache_usage_perc{pool}, cleave:pool_workers_ready{pool}   from Dispatcher::pools()
// Children are looked up once here; updates are lock-free (metrics.h).
#pragma once

#include <memory>
#include <string_view>
#include <vector>

#include "cleave/common/metrics.h"
#include "cleave/common/status.h"
#include "cleave/router/dispatcher.h"

namespace cleave::router {

struct RouterMetrics {
  static Result<std::unique_ptr<RouterMetrics>> create(metrics::MetricsRegistry& registry);

  // One HTTP response (handler: the route, or "other").
  void count_http(std::string_view handler, int status);
  // One gRPC API call that ended (code: the status code's name, e.g. "OK", "INVALID_ARGUMENT").
  void count_grpc(std::string_view method, std::string_view code);
  // Sets the per-pool gauges.
  void refresh_pools(const std::vector<PoolSnapshot>& pools);

  metrics::MetricsRegistry* registry = nullptr;
  metrics::Gauge* requests_running = nullptr;
  metrics::Gauge* requests_waiting = nullptr;
  metrics::Histogram* time_to_first_token = nullptr;
  metrics::Histogram* inter_token_latency = nullptr;
  metrics::Histogram* e2e_latency = nullptr;
  metrics::Histogram* queue_time = nullptr;
  metrics::Counter* prompt_tokens = nullptr;
  metrics::Counter* cached_prompt_tokens = nullptr;
  metrics::Counter* generation_tokens = nullptr;
  metrics::Counter* success_stop = nullptr;
  metrics::Counter* success_length = nullptr;
  metrics::Counter* success_abort = nullptr;

 private:
  std::unique_ptr<metrics::Family<metrics::Counter>> http_requests_;  // {handler, status}
  std::unique_ptr<metrics::Family<metrics::Counter>> grpc_requests_;  // {method, code}
  std::unique_ptr<metrics::Family<metrics::Gauge>> kv_usage_;         // {pool}
  std::unique_ptr<metrics::Family<metrics::Gauge>> workers_ready_;     // {pool}
};

}  // namespace cleave::router
