// The router's dispatch (DESIGN.md §1 step 1, issue 6 "Dispatch"): worker pools, discovery and
// health, the choice of workers per request, retries before the first token, and the
// asynchronous run of one request over its workers.
//
// Pools come from the configuration: a unified pool only, or a prefill pool and a decode pool.
// Each pool's workers are found from a static list of "host:port" or a DNS name resolving to
// several addresses (a Kubernetes headless Service), re-resolved periodically. Each worker is
// probed (grpc.health.v1 + GetLoad) periodically; a worker that fails its probe or an RPC with
// UNAVAILABLE leaves the pool until a probe succeeds again. Prefill/decode pairs are checked
// once (check_pairing, worker_client.h); a pair that is refused is never used and logged.
//
// Policies per pool: round_robin; least_loaded (power of two choices on the reported load:
// waiting + running, then KV usage); prefix_aware (for prefill or unified pools: prefer the
// worker that served the longest matching prefix of block hashes recently, unless its load
// exceeds the least loaded one's by more than a bound, then least_loaded). dispatch_policy.h.
//
// A request that has produced no token yet is retried on other workers (at most
// max_attempts, bounded in time). Once a token went out, a failure of its worker (UNAVAILABLE,
// a broken stream, a stream idle timeout; not an error that any worker would repeat, such as
// INVALID_ARGUMENT) migrates it: a new attempt on workers not tried before, with the prompt and
// the tokens delivered so far as resume tokens and the same parameters (DESIGN.md §3
// "Resumable sampling"), at most max_migrations times. The observer sees a pause: no token
// twice, none missing, the same text as an undisturbed run (greedy or seeded), and the
// finished event's usage counts the whole request. When no migration is left or no worker can
// take it, the observer hears on_error with started = true. Requests beyond the queue limit are
// refused with ResourceExhausted (HTTP 429); no ready worker: Unavailable (HTTP 503).
// Disaggregated, a request waits at the router (in arrival order, within timeouts.prefill)
// while no prefill worker has room for its prompt (prefill_queue_tokens) or its decode worker
// refused the Reserve for blocks that are only held; a wait that runs out ends
// ResourceExhausted.
//
// Threading: submit() never blocks on I/O. The RPCs run on gRPC's callback API (no thread is
// held per request); RequestObserver callbacks run on gRPC threads, one at a time per request,
// in order, and must not block (post to your own executor). A callback may run before submit()
// has returned (a first attempt that fails at once may even report on the calling thread):
// do not hold, around submit(), a lock that the callbacks take.
//
// Settings and the factory: dispatch_options.h (DispatcherOptions, make_dispatcher). One request
// run to its end by a blocking caller: run_request.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/request/sampling_params.h"
#include "cleave/v1/worker.pb.h"

namespace cleave::router {

struct DispatchRequest {
  std::vector<int32_t> prompt{};   // token ids (BOS included when the model wants one)
  SamplingParams params{};         // validated, max_tokens and seed resolved
  std::string prefix_key_hint{};   // unused by the dispatcher's hash-based prefix policy; free
  // The worker-side request id of the first attempt (unset: one of the dispatcher's). It must
  // be unique among the requests in flight on the workers it goes to. A retry draws one of the
  // dispatcher's, so that it never meets what the failed attempt left on a worker.
  std::optional<uint64_t> request_id{};
};

// What a prefill worker reported of the KV it wrote into the decode worker (its
// PrefillResponse), for a disaggregated request.
struct PrefillFigures {
  uint64_t kv_bytes = 0;           // KV bytes written into the decode worker's blocks
  double kv_tail_seconds = 0;      // end of the last layer's compute -> the KV in place
  double kv_transfer_seconds = 0;  // first KV write -> the KV in place
};

// What the HTTP or gRPC frontend hears about one request.
class RequestObserver {
 public:
  virtual ~RequestObserver() = default;
  // A token event (has_token, text, logprobs); the last one has finished = true with the
  // finish reason and the usage (prompt, completion and cached tokens).
  virtual void on_event(const v1::TokenEvent& event) = 0;
  // The request failed; `started` says whether any event was delivered before. Nothing follows.
  virtual void on_error(const Status& error, bool started) = 0;
  // Disaggregated: the prefill has answered; called once, just before its first token goes to
  // on_event (not for an attempt that failed, nor for a migration's prefill, nor in unified
  // mode). Default: ignored.
  virtual void on_prefilled(const PrefillFigures& figures) { (void)figures; }
};

// A request in flight; cancel() ends it on its workers (client disconnect) and frees their
// blocks; the observer hears nothing more after cancel() returns (a callback already running
// finishes first). Idempotent.
class DispatchHandle {
 public:
  virtual ~DispatchHandle() = default;
  virtual void cancel() = 0;
};

struct PoolSnapshot {
  std::string name;  // "unified", "prefill", "decode"
  int64_t workers_ready = 0;
  int64_t workers_known = 0;
  int64_t waiting = 0;
  int64_t running = 0;
  int64_t blocks_total = 0;
  int64_t blocks_used = 0;
  double kv_usage = 0;  // blocks_used / blocks_total over the ready workers
};

class Dispatcher {
 public:
  virtual ~Dispatcher() = default;
  // ResourceExhausted when the queue is full; Unavailable when no worker can take it now.
  // The dispatcher drops its reference to `observer` once the request is over (finished,
  // failed, or cancelled and its RPC in flight ended), and holds no other.
  virtual Result<std::shared_ptr<DispatchHandle>> submit(DispatchRequest request,
                                                         std::shared_ptr<RequestObserver> observer) = 0;
  // Every pool has at least one ready worker (and, disaggregated, one accepted pair).
  virtual bool ready() const = 0;
  // Why ready() is false: OK when ready; FailedPrecondition with what differs when the ready
  // prefill and decode workers are all refused as pairs (check_pairing, worker_client.h);
  // otherwise Unavailable naming the pools without a ready worker and each worker's last reason
  // (e.g. its address and the connection error). The default knows no reasons.
  virtual Status readiness() const {
    return ready() ? Status::Ok() : Unavailable("no worker is ready");
  }
  // Waits until ready() or `timeout` passes; returns ready().
  virtual bool wait_ready(std::chrono::milliseconds timeout) const {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (!ready() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return ready();
  }
  virtual std::vector<PoolSnapshot> pools() const = 0;
  // The served model's facts, from the workers' GetInfo (empty before ready()).
  virtual v1::WorkerInfo model_info() const = 0;
  // Stops discovery and probes, refuses new requests (Unavailable), cancels the requests in
  // flight (each observer hears on_error Unavailable unless it has finished or was cancelled)
  // and waits a bounded time for their RPCs to end. Idempotent; the destructor calls it.
  virtual void shutdown() = 0;
};

}  // namespace cleave::router
