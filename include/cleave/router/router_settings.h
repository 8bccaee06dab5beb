// The router's settings (router.*) and the worker pools' (pools.*): plain fields with defaults
// in code, bound to the settings registry (cleave/common/config.h).
#pragma once

#include <cstdint>
#include <string>

#include "cleave/common/config.h"

namespace cleave {

// The router (`cleave router`, `cleave serve`; src/router/app).
struct RouterSettings {
  std::string host = "0.0.0.0";  // HTTP listen address
  int64_t port = 8000;           // HTTP port; 0 picks a free port
  int64_t grpc_port = 8001;      // gRPC API port (same host); 0 picks a free port; -1: off
  std::string api_keys;          // comma-separated bearer tokens for /v1/; empty = no auth
  int64_t max_queue = 1024;      // requests admitted and unfinished; beyond: HTTP 429
  // Disaggregated: prompt tokens of prefills in flight per prefill worker (every router's);
  // more wait at the router before reserving decode KV (0: no limit).
  int64_t prefill_queue_tokens = 8192;
  // Longest a request waits for its first token (queueing, prefill and KV transfer included).
  int64_t request_timeout_ms = 120000;
  // Times a started stream whose worker fails moves to other workers, resuming from the tokens
  // it delivered (the client sees a pause); 0: it ends with an error event.
  int64_t max_migrations = 2;
  // Disaggregated: open the Decode stream right after Reserve, beside the Prefill; the first
  // token reaches the decode worker in the KV's notice instead of through the router.
  bool early_decode = true;
  int64_t io_threads = 1;                    // HTTP I/O threads
  std::string mode = "disaggregated";        // unified | disaggregated
  std::string policy_prefill = "prefix_aware";  // round_robin | least_loaded | prefix_aware
  std::string policy_decode = "least_loaded";
  std::string policy_unified = "least_loaded";
  int64_t health_interval_ms = 1000;  // worker health and load probes
  int64_t health_timeout_ms = 1000;   // each probe RPC
  int64_t health_failures = 3;        // timed-out probes in a row before a worker leaves
  int64_t dns_refresh_ms = 10000;     // DNS names of the pools re-resolved this often
  int64_t max_body_bytes = 16ll << 20;  // larger request bodies: HTTP 413
  // A keep-alive HTTP connection is closed after waiting this long for its next request.
  int64_t idle_timeout_ms = 75000;
  std::string served_model_name;        // empty: the model's own name (else its file name)
};

// One worker pool (pools.prefill, pools.decode, pools.unified). Where its workers are: started
// by `cleave serve` (`replicas` children) unless `workers` or `dns` names them. The engine
// settings apply to the workers `cleave serve` starts; 0 = the engine.* value.
struct PoolSettings {
  int64_t replicas = 1;
  std::string workers;  // comma-separated HOST:PORT list of running workers
  std::string dns;      // NAME:PORT resolving to the workers (e.g. a headless Service)
  int64_t threads = 0;
  int64_t kv_blocks = 0;
  int64_t kv_cache_bytes = 0;
  int64_t max_tokens_per_step = 0;
  int64_t max_num_seqs = 0;
};

struct PoolsSettings {
  PoolSettings prefill;
  PoolSettings decode;
  PoolSettings unified;
};

// Binds router.* to `registry` (the fields must outlive it).
void register_router_settings(RouterSettings& settings, SettingsRegistry& registry);
// Binds pools.prefill.*, pools.decode.* and pools.unified.* to `registry`.
void register_pools_settings(PoolsSettings& settings, SettingsRegistry& registry);

}  // namespace cleave
