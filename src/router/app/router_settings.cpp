#include "cleave/router/router_settings.h"

#include <utility>
#include <vector>

#include "fmt/format.h"

namespace cleave {

void register_router_settings(RouterSettings& rs, SettingsRegistry& r) {
  r.add_string("router.host", &rs.host,
               "Address the router's HTTP API listens on (IPv4 or IPv6 literal).", "--host");
  r.add_int("router.port", &rs.port, "HTTP port of the router; 0 picks a free port.", 0,
            65535, "--port");
  r.add_int("router.grpc_port", &rs.grpc_port,
            "Port of the router's gRPC API (cleave.v1.Inference, on router.host); 0 picks a free "
            "port, -1 turns it off.",
            -1, 65535, "--grpc-port");
  r.add_string("router.api_keys", &rs.api_keys,
               "Comma-separated API keys accepted as `Authorization: Bearer KEY` on /v1/; empty "
               "= no authentication.",
               "--api-keys");
  r.add_int("router.max_queue", &rs.max_queue,
            "Requests admitted and not yet finished; beyond it requests get HTTP 429.", 1,
            1 << 24, "--max-queue");
  r.add_int("router.prefill_queue_tokens", &rs.prefill_queue_tokens,
            "Disaggregated: prompt tokens of prefills in flight one prefill worker may have "
            "(this router's, and other routers' as the worker last reported them); further "
            "requests wait at the router, in arrival order and within "
            "router.request_timeout_ms, before they reserve decode KV (a worker with none in "
            "flight always takes one); 0: no limit.",
            0, int64_t{1} << 40);
  r.add_int("router.request_timeout_ms", &rs.request_timeout_ms,
            "Longest a request waits for its first token (queueing, prefill, KV transfer).", 1,
            86400000);
  r.add_int("router.max_migrations", &rs.max_migrations,
            "Times a started stream whose worker fails (dies, breaks the stream, goes silent) "
            "moves to other workers, resuming from the tokens it sent (the client sees a pause, "
            "not an error); 0: such a stream ends with an error event.",
            0, 100, "--max-migrations");
  r.add_bool("router.early_decode", &rs.early_decode,
             "Disaggregated: open the Decode stream right after Reserve, beside the Prefill, so "
             "that the first token reaches the decode worker in the KV's notice and the second "
             "token does not wait for a router round trip; false: Decode after the Prefill "
             "answered.");
  r.add_int("router.io_threads", &rs.io_threads, "HTTP I/O threads of the router.", 1, 256);
  r.add_enum("router.mode", &rs.mode, {"unified", "disaggregated"},
             "Pools: unified workers only, or a prefill pool and a decode pool.", "--mode");
  const std::vector<std::string> policies = {"round_robin", "least_loaded", "prefix_aware"};
  r.add_enum("router.policy_prefill", &rs.policy_prefill, policies,
             "How a prefill worker is chosen per request.");
  r.add_enum("router.policy_decode", &rs.policy_decode, policies,
             "How a decode worker is chosen per request.");
  r.add_enum("router.policy_unified", &rs.policy_unified, policies,
             "How a unified worker is chosen per request.");
  r.add_int("router.health_interval_ms", &rs.health_interval_ms,
            "Every worker's health and load are probed this often.", 10, 3600000);
  r.add_int("router.health_timeout_ms", &rs.health_timeout_ms,
            "Each health/load probe RPC of a worker times out after this long.", 10, 600000);
  r.add_int("router.health_failures", &rs.health_failures,
            "Probes in a row that time out before a busy worker leaves its pool (a refused or "
            "failed probe, or an RPC failing UNAVAILABLE, takes it out at once).",
            1, 1000);
  r.add_int("router.dns_refresh_ms", &rs.dns_refresh_ms,
            "Pools given by a DNS name (pools.*.dns) are re-resolved this often.", 100, 86400000);
  r.add_int("router.max_body_bytes", &rs.max_body_bytes,
            "Largest HTTP request body; larger ones get HTTP 413.", 1024, int64_t{1} << 32);
  r.add_int("router.idle_timeout_ms", &rs.idle_timeout_ms,
            "A keep-alive HTTP connection is closed after waiting this long for its next request "
            "(behind a load balancer: longer than the balancer's own idle timeout).",
            100, 3600000);
  r.add_string("router.served_model_name", &rs.served_model_name,
               "Model name of the API; empty = the model's own name (else its file name).",
               "--served-model-name");
}

void register_pools_settings(PoolsSettings& p, SettingsRegistry& r) {
  const std::pair<const char*, PoolSettings*> pools[] = {
      {"prefill", &p.prefill}, {"decode", &p.decode}, {"unified", &p.unified}};
  for (const auto& [name, pool] : pools) {
    const std::string k = std::string("pools.") + name + ".";
    r.add_int(k + "replicas", &pool->replicas,
              fmt::format("{} workers `cleave serve` starts (when no workers or dns is set).",
                          name),
              0, 1024);
    r.add_string(k + "workers", &pool->workers,
                 fmt::format("Comma-separated HOST:PORT of running {} workers; set: `cleave "
                             "serve` starts none and the router dials these.",
                             name));
    r.add_string(k + "dns", &pool->dns,
                 fmt::format("NAME:PORT resolving to the {} workers (e.g. a Kubernetes headless "
                             "Service), re-resolved every router.dns_refresh_ms.",
                             name));
    r.add_int(k + "threads", &pool->threads,
              "Compute threads of each started worker; 0 = engine.threads (when that is 0 too, "
              "`cleave serve` shares the CPUs among its workers).",
              0, 1024);
    r.add_int(k + "kv_blocks", &pool->kv_blocks,
              "KV blocks of each started worker; 0 = engine.kv_blocks.", 0, 1 << 30);
    r.add_int(k + "kv_cache_bytes", &pool->kv_cache_bytes,
              "KV memory budget of each started worker; 0 = engine.kv_cache_bytes.", 0,
              int64_t{1} << 50);
    r.add_int(k + "max_tokens_per_step", &pool->max_tokens_per_step,
              "Token budget of one engine step of each started worker; 0 = "
              "engine.max_tokens_per_step.",
              0, 1 << 20);
    r.add_int(k + "max_num_seqs", &pool->max_num_seqs,
              "Most sequences running at once on each started worker; 0 = engine.max_num_seqs.",
              0, 1 << 16);
  }
}

}  // namespace cleave
