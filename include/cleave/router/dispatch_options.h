// Settings of the router's dispatch (dispatcher.h): the worker pools, how their workers are
// found and probed, the policy that picks a worker per request, the admission limit, retries,
// the deadline of every stage of a request, and the factory that builds a Dispatcher.
//
// Units: every duration is std::chrono::milliseconds; counts are requests or blocks as named.
// Thread-safety: plain values; the functions are pure (make_dispatcher starts threads).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/metrics.h"
#include "cleave/common/status.h"
#include "cleave/router/dispatcher.h"

namespace cleave::router {

// unified: one pool of unified workers (Generate). disaggregated: a prefill pool and a decode
// pool (Reserve on decode -> Prefill -> Decode).
enum class DispatchMode : uint8_t { kUnified, kDisaggregated };

// round_robin: each ready worker in turn. least_loaded: power of two choices on the load the
// workers report (waiting + running, corrected by this router's own requests since the last
// report; ties by KV usage). prefix_aware: the worker this router recently sent the longest
// matching prefix of the prompt's full KV blocks to, unless its load exceeds the least loaded
// candidate's by more than DispatcherOptions::prefix_load_slack; else least_loaded.
enum class DispatchPolicyKind : uint8_t { kRoundRobin, kLeastLoaded, kPrefixAware };

std::string_view dispatch_mode_name(DispatchMode mode);               // "unified", "disaggregated"
std::string_view dispatch_policy_name(DispatchPolicyKind policy);     // "round_robin", ...
// InvalidArgument naming the value and the choices.
Result<DispatchMode> parse_dispatch_mode(std::string_view name);
Result<DispatchPolicyKind> parse_dispatch_policy(std::string_view name);

// Where one pool's workers are: the static entries and the addresses `dns_name` resolves to
// (each with `dns_port`), re-resolved every `dns_refresh`. A resolution that fails keeps the
// previous addresses (their probes decide whether they are ready).
struct WorkerPoolOptions {
  std::vector<std::string> workers;  // "host:port" ("[::1]:port" for IPv6)
  std::string dns_name;              // "" = none; e.g. a Kubernetes headless Service name
  int dns_port = 0;                  // required with dns_name
  std::chrono::milliseconds dns_refresh{10000};
  DispatchPolicyKind policy = DispatchPolicyKind::kLeastLoaded;

  bool empty() const { return workers.empty() && dns_name.empty(); }
};

inline WorkerPoolOptions pool_with_policy(DispatchPolicyKind policy) {
  WorkerPoolOptions p;
  p.policy = policy;
  return p;
}

struct DispatchTimeouts {
  // Each probe RPC (grpc.health.v1 Check, GetLoad, GetInfo).
  std::chrono::milliseconds probe{1000};
  // Reserve on a decode worker.
  std::chrono::milliseconds reserve{5000};
  // Prefill on a prefill worker (queueing, compute and the KV transfer of the whole prompt),
  // the wait at the router for room on a prefill worker (prefill_queue_tokens) included.
  std::chrono::milliseconds prefill{120000};
  // Unified: from the start of Generate to its first event (queueing and prefill included).
  std::chrono::milliseconds first_token{120000};
  // Longest wait for the next event of a token stream (Decode, or Generate after its first
  // event); a stream that stays silent longer is cancelled and fails DEADLINE_EXCEEDED.
  std::chrono::milliseconds stream_idle{30000};
  // Abort and Release (best-effort clean-up calls).
  std::chrono::milliseconds cleanup{2000};
};

struct DispatcherOptions {
  DispatchMode mode = DispatchMode::kUnified;
  WorkerPoolOptions unified;  // mode unified
  WorkerPoolOptions prefill = pool_with_policy(DispatchPolicyKind::kPrefixAware);  // disaggregated
  WorkerPoolOptions decode;                                                         // disaggregated

  // Every worker is probed this often; a probe that fails (or an RPC failing UNAVAILABLE)
  // takes it out of its pool until a probe succeeds again. A probe that only timed out (the
  // worker is slow, not gone) does so after probe_failures of them in a row.
  std::chrono::milliseconds health_interval{1000};
  int probe_failures = 3;
  // Requests admitted and not yet finished; submit() beyond it: ResourceExhausted.
  int64_t queue_limit = 1024;
  // Tries of a request before its first token (each on a worker not tried before).
  int max_attempts = 3;
  // Migrations of a started stream (tokens already went to the observer) whose worker failed:
  // each is a new attempt on workers not tried before, resuming from the tokens delivered so far
  // (dispatcher.h). 0: such a stream ends with an error.
  int max_migrations = 2;
  // Disaggregated: the Decode stream opens right after Reserve, beside the Prefill (its first
  // token comes in the KV's notice; dispatch_call.h); false: after the Prefill's answer.
  bool early_decode = true;
  // Disaggregated: the prompt tokens of prefills in flight (from Reserve to the Prefill's
  // answer) one prefill worker may have: this router's, plus the other routers' as the
  // worker's last LoadReport showed them (LoadReport.prefill_tokens beyond this router's own
  // at that probe). A request that would exceed it on every prefill worker that could take it
  // waits at the router, in arrival order, before its Reserve, so that decode blocks are not
  // reserved for prefills that only queue; a worker with none in flight always takes one. The wait counts against timeouts.prefill; when that
  // passes the request fails RESOURCE_EXHAUSTED. 0: no limit (Reserve at once).
  int64_t prefill_queue_tokens = 8192;
  DispatchTimeouts timeouts;
  // Lease of a decode reservation (0: the worker's default).
  std::chrono::milliseconds lease{0};

  // prefix_aware: tokens per hashed block (0: the workers' KV block size, from GetInfo), block
  // hashes remembered per worker (least recently routed dropped first), and how many more
  // requests (waiting + running) than the least loaded candidate a prefix holder may have.
  int64_t prefix_block_size = 0;
  int64_t prefix_blocks_per_worker = 65536;
  int64_t prefix_load_slack = 4;

  // Seed of the least_loaded / prefix_aware random draws (0: a random seed).
  uint64_t policy_seed = 0;

  // When set (not owned; must outlive the dispatcher), the dispatcher registers and updates
  // cleave:kv_transfer_bytes_total, cleave:kv_handoff_tail_seconds (from the prefill workers'
  // answers), cleave:router_dispatch_retries_total, cleave:migrations_total{outcome},
  // cleave:router_lease_renewals_total{outcome}, cleave:router_prefill_queue_requests,
  // cleave:router_prefill_queue_seconds and cleave:router_worker_failures_total.
  metrics::MetricsRegistry* metrics = nullptr;
};

// InvalidArgument naming the field: the mode's pools empty, a malformed static entry, a DNS
// name without a port, non-positive intervals, timeouts, queue limit or attempts.
Status validate_dispatcher_options(const DispatcherOptions& options);

// Validates `options`, builds the pools from the static entries (DNS names are resolved on the
// discovery thread), and starts the threads "dispatch-health" (discovery and probes) and
// "dispatch-watch" (stage deadlines). Returns at once: ready() turns true once the first
// probes have succeeded (wait_ready()).
Result<std::unique_ptr<Dispatcher>> make_dispatcher(const DispatcherOptions& options);

}  // namespace cleave::router
