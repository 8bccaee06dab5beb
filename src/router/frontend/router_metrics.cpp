// Registration of the router's request metrics.
#include "frontend/router_metrics.h"

#include <string>

namespace cleave::router {

Result<std::unique_ptr<RouterMetrics>> RouterMetrics::create(metrics::MetricsRegistry& registry) {
  auto m = std::make_unique<RouterMetrics>();
  m->registry = &registry;
  const std::vector<double> latency = metrics::latency_buckets_seconds();

  CLEAVE_ASSIGN_OR_RETURN(auto running,
                          registry.gauge("cleave:num_requests_running",
                                         "Requests in flight at the router that have had their "
                                         "first token (one per choice)."));
  CLEAVE_ASSIGN_OR_RETURN(auto waiting,
                          registry.gauge("cleave:num_requests_waiting",
                                         "Requests dispatched by the router and waiting for their "
                                         "first token (one per choice)."));
  CLEAVE_ASSIGN_OR_RETURN(auto ttft, registry.histogram(
                                         "cleave:time_to_first_token_seconds",
                                         "Seconds from a request's arrival at the router to its "
                                         "first token.",
                                         latency));
  CLEAVE_ASSIGN_OR_RETURN(auto itl, registry.histogram(
                                        "cleave:time_per_output_token_seconds",
                                        "Seconds between consecutive tokens of a request "
                                        "(inter-token latency).",
                                        latency));
  CLEAVE_ASSIGN_OR_RETURN(auto e2e, registry.histogram(
                                        "cleave:e2e_request_latency_seconds",
                                        "Seconds from a request's arrival at the router to its "
                                        "last token.",
                                        latency));
  CLEAVE_ASSIGN_OR_RETURN(auto queue, registry.histogram(
                                          "cleave:request_queue_time_seconds",
                                          "Seconds from a request's arrival at the router until "
                                          "a worker's engine first computed it (the router's "
                                          "parsing, chat template and tokenization, and the "
                                          "wait in the worker engine's queue).",
                                          latency));
  CLEAVE_ASSIGN_OR_RETURN(auto prompt,
                          registry.counter("cleave:prompt_tokens_total",
                                           "Prompt tokens of finished requests."));
  CLEAVE_ASSIGN_OR_RETURN(auto cached,
                          registry.counter("cleave:prompt_tokens_cached_total",
                                           "Prompt tokens of finished requests that a worker's "
                                           "prefix cache served instead of computing them (over "
                                           "cleave:prompt_tokens_total: the prefix-cache hit "
                                           "rate)."));
  CLEAVE_ASSIGN_OR_RETURN(auto generation,
                          registry.counter("cleave:generation_tokens_total",
                                           "Tokens generated for finished requests."));
  CLEAVE_ASSIGN_OR_RETURN(auto success,
                          registry.counter("cleave:request_success_total",
                                           "Requests that ended, by finish reason (abort: the "
                                           "client went away).",
                                           {"finished_reason"}));
  CLEAVE_ASSIGN_OR_RETURN(auto http,
                          registry.counter("cleave:http_requests_total",
                                           "HTTP responses by route and status code.",
                                           {"handler", "status"}));
  CLEAVE_ASSIGN_OR_RETURN(auto grpc_calls,
                          registry.counter("cleave:grpc_requests_total",
                                           "gRPC API calls by method and status code.",
                                           {"method", "code"}));
  CLEAVE_ASSIGN_OR_RETURN(auto kv, registry.gauge("cleave:kv_cache_usage_perc",
                                                  "Fraction of the KV blocks in use over the "
                                                  "pool's ready workers (0 to 1).",
                                                  {"pool"}));
  CLEAVE_ASSIGN_OR_RETURN(auto ready, registry.gauge("cleave:pool_workers_ready",
                                                     "Workers of the pool that pass their health "
                                                     "probes.",
                                                     {"pool"}));

  m->requests_running = &running.get();
  m->requests_waiting = &waiting.get();
  m->time_to_first_token = &ttft.get();
  m->inter_token_latency = &itl.get();
  m->e2e_latency = &e2e.get();
  m->queue_time = &queue.get();
  m->prompt_tokens = &prompt.get();
  m->cached_prompt_tokens = &cached.get();
  m->generation_tokens = &generation.get();
  m->success_stop = &success.with({"stop"});
  m->success_length = &success.with({"length"});
  m->success_abort = &success.with({"abort"});
  m->http_requests_ = std::make_unique<metrics::Family<metrics::Counter>>(std::move(http));
  m->grpc_requests_ = std::make_unique<metrics::Family<metrics::Counter>>(std::move(grpc_calls));
  m->kv_usage_ = std::make_unique<metrics::Family<metrics::Gauge>>(std::move(kv));
  m->workers_ready_ = std::make_unique<metrics::Family<metrics::Gauge>>(std::move(ready));
  return m;
}

void RouterMetrics::count_http(std::string_view handler, int status) {
  http_requests_->with({std::string(handler), std::to_string(status)}).inc();
}

void RouterMetrics::count_grpc(std::string_view method, std::string_view code) {
  grpc_requests_->with({std::string(method), std::string(code)}).inc();
}

void RouterMetrics::refresh_pools(const std::vector<PoolSnapshot>& pools) {
  for (const auto& p : pools) {
    kv_usage_->with({p.name}).set(p.kv_usage);
    workers_ready_->with({p.name}).set(static_cast<double>(p.workers_ready));
  }
}

}  // namespace cleave::router
