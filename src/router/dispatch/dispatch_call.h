// One request in flight through the dispatcher: the asynchronous run of its attempts over the
// workers on gRPC's callback API, the delivery of its events to the observer, retries before
// the first token, cancellation and stage deadlines.
//
//   unified:        Generate (stream)                       deadline: first_token, stream_idle
//   disaggregated:  decode.Reserve                          deadline: reserve
//                   -> prefill.Prefill(destination)         deadline: prefill
//                   -> the first token to the observer
//                   -> decode.Decode (stream), unless the first token finished the request
//                                                           deadline: stream_idle per event
//   early decode (options.early_decode, the default): the Decode opens right after Reserve,
//                   beside the Prefill; the prefill's notice carries the first token to the
//                   decode worker, so the second token does not wait for a router round trip.
//                   The stream's events and its end are held back ("gated") until the Prefill's
//                   answer has delivered the first token, then go out in order; the stream's
//                   idle deadline starts then. A Prefill that fails or ends the request cancels
//                   the stream; a stream of an earlier attempt is ignored when it ends.
// Room on a prefill worker (DispatcherOptions::prefill_queue_tokens): an attempt whose request
// no prefill worker has room for waits in the core's queue ("queued", in arrival order) before
// its Reserve; a new request queues behind those already waiting. The queue is tried whenever
// a prefill's tokens leave a worker and on every watchdog round; the head that still finds no
// room stops the round (strict order: a long prompt is not passed by short ones for ever). The
// wait is bounded by timeouts.prefill (then RESOURCE_EXHAUSTED) and the Prefill's own deadline
// is what is left of it. A Reserve that the decode worker refuses for want of free blocks, when
// the request fits its whole pool, waits in the same queue (its blocks are only held: by
// running sequences and by reservations of prefills that run) and tries again after a backoff
// (50 ms, doubling to 800 ms) while it heads the queue, instead of failing with 429.
// A prefill that fails or finishes the request releases the reservation. A failure before any
// event went to the observer is retried on workers not tried yet (max_attempts in all); after
// one, it is migrated (max_migrations in all): a new attempt on workers not tried yet whose
// requests carry the tokens delivered so far as resume tokens, so that its first event is the
// next token; when none is left, the observer hears on_error(started = true). Every failure and
// every cancellation sends Abort (or Release) to the workers concerned so that their blocks
// come back.
//
// Locks: `mu_` guards the stage state; `deliver_mu_` is held while an observer callback runs.
// Neither is held while an RPC is started or cancelled, since gRPC may run a completion inline
// on the calling thread. A cancel() from inside an observer callback is deferred until that
// callback returns.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "cleave/common/metrics.h"
#include "cleave/router/dispatch_options.h"
#include "cleave/router/dispatcher.h"
#include "dispatch/worker_pools.h"

namespace cleave::router {

class DispatchCall;

// A steady-clock instant as the nanoseconds the calls' atomic deadlines hold.
inline int64_t steady_ns(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// What every request of one dispatcher shares. Held by shared_ptr from each request, so that a
// request finishing after the dispatcher was destroyed still finds it.
struct DispatchCore {
  explicit DispatchCore(const DispatcherOptions& options);

  uint64_t next_request_id() { return next_id.fetch_add(1, std::memory_order_relaxed); }
  void add_call(const std::shared_ptr<DispatchCall>& call);
  void remove_call(const std::shared_ptr<DispatchCall>& call);
  // Copies the calls in flight into `out` (cleared first).
  void calls_in_flight(std::vector<std::shared_ptr<DispatchCall>>& out);
  // Waits until no call is in flight or `timeout` passes; true when none is.
  bool wait_no_calls(std::chrono::milliseconds timeout);

  // ---- requests waiting for room on a prefill worker (prefill_queue_tokens) ----
  void enqueue(std::shared_ptr<DispatchCall> call);
  // Takes `call` out of the queue; false when it is not there (admitted meanwhile).
  bool take_waiting(const DispatchCall* call);
  bool has_waiting() const { return waiting_count_.load(std::memory_order_acquire) > 0; }
  int64_t waiting() const { return waiting_count_.load(std::memory_order_acquire); }
  // Starts, in order, the waiting requests that a prefill worker has room for now (outside
  // every lock, on the caller's thread). A call while another thread (or this one, from a
  // request it starts) is inside makes that one look again instead.
  void admit_waiting();

  // The watchdog's resolution: fine enough for the shortest stream deadline.
  static std::chrono::milliseconds watch_period_for(const DispatcherOptions& options);

  const DispatcherOptions options;
  const std::chrono::milliseconds watch_period;  // of check_deadline's calls
  WorkerPools pools;
  std::atomic<int64_t> admitted{0};  // requests submitted and not ended
  std::atomic<bool> stopping{false};
  std::atomic<uint64_t> next_id;

  // Metrics (null without DispatcherOptions::metrics).
  metrics::Counter* kv_transfer_bytes = nullptr;
  metrics::Histogram* kv_handoff_tail_seconds = nullptr;
  metrics::Histogram* kv_transfer_seconds = nullptr;
  metrics::Counter* retries = nullptr;
  metrics::Counter* worker_failures = nullptr;
  // cleave:migrations_total{outcome}: resumed (a migration's attempt began), completed (a
  // migrated request finished), refused (a started stream's failure not migrated: none left,
  // no worker, or an error every worker would repeat).
  metrics::Counter* migrations_resumed = nullptr;
  metrics::Counter* migrations_completed = nullptr;
  metrics::Counter* migrations_refused = nullptr;
  metrics::Counter* lease_renewed = nullptr;
  metrics::Counter* lease_renewal_lost = nullptr;
  metrics::Gauge* prefill_queue_requests = nullptr;
  metrics::Histogram* prefill_queue_seconds = nullptr;

 private:
  // One pass over the queue: admits from its head while they find room.
  void admit_round();
  // waiting_count_ and the gauge follow waiting_ (under waiting_mu_).
  void publish_waiting_locked();

  std::mutex calls_mu_;
  std::condition_variable calls_cv_;
  std::unordered_set<std::shared_ptr<DispatchCall>> calls_;
  std::mutex waiting_mu_;  // before a call's mu_ and the pools' mutex, never after
  std::deque<std::shared_ptr<DispatchCall>> waiting_;
  std::atomic<int64_t> waiting_count_{0};
  std::atomic<bool> admitting_{false};
  std::atomic<bool> admit_again_{false};
};

class TokenStream;

class DispatchCall final : public DispatchHandle,
                           public std::enable_shared_from_this<DispatchCall> {
 public:
  DispatchCall(std::shared_ptr<DispatchCore> core, DispatchRequest request,
               std::shared_ptr<RequestObserver> observer);
  ~DispatchCall() override;

  // Runs the first attempt on `workers` (the caller registered the call with the core).
  void start(Assignment workers);
  // The first attempt waits for room on a prefill worker (the caller registered the call).
  void start_queued();
  void cancel() override;
  // The dispatcher shuts down: the observer hears on_error(`why`) and the request is cancelled.
  void abandon(const Status& why);
  // The watchdog: cancels the stream in flight when its stage deadline has passed, and renews
  // the decode reservation's lease while the Prefill runs.
  void check_deadline(std::chrono::steady_clock::time_point now);

 private:
  friend class TokenStream;
  friend struct DispatchCore;
  enum class Stage : uint8_t { kIdle, kQueued, kReserve, kPrefill, kDecode, kGenerate };

  // ---- attempts (dispatch_call.cpp) ----
  void begin_attempt(Assignment workers);
  // The attempt failed at `worker`: a retry before the first token, a migration after it, or
  // the end of the request. UNAVAILABLE takes the worker out of its pool until a probe
  // succeeds (WorkerPools::mark_failed); retry_without leaves the pools as they are.
  void attempt_failed(const std::shared_ptr<WorkerEndpoint>& worker, Status error);
  void retry_without(const std::shared_ptr<WorkerEndpoint>& worker, Status error);
  // The next attempt's workers, or why there is none (the error to end with); *busy when it
  // only lacks room on a prefill worker.
  Result<Assignment> next_attempt(const Status& error, bool* busy);
  // The next attempt's workers as the pools see them now (the queue's test).
  Result<Assignment> choose_workers(bool* busy);
  // Into the core's queue until a prefill worker has room (or the wait's deadline passes).
  void wait_for_room();
  // Out of the queue: the attempt begins on `workers` (their prefill tokens already held), or
  // the request fails with why there are none.
  void leave_queue(Result<Assignment> workers);
  // The decode worker refused the Reserve for want of free blocks (`why`): wait and try again.
  void wait_for_decode_room(Status why);
  // Whether a waiting request may be tried now (its backoff has passed).
  bool due(std::chrono::steady_clock::time_point now) const {
    return steady_ns(now) >= not_before_ns_.load(std::memory_order_relaxed);
  }
  // The tokens this request's next prefill computes: the prompt and, for a migration, the
  // tokens delivered so far (begin_attempt: resume_).
  int64_t prefill_token_count() const {
    return static_cast<int64_t>(prompt_.size() + delivered_tokens_.size());
  }
  // The error of a request that waited `waited` for room in vain.
  Status room_timeout(std::chrono::steady_clock::duration waited);
  void fail(Status error);
  // The request is over (success, failure or cancellation): counters, registry, observer.
  void end();
  // Registers the RPC about to start as the one in flight (with its watchdog deadline, or none
  // when `deadline` is zero); false when the request was cancelled meanwhile.
  bool arm(std::shared_ptr<grpc::ClientContext> ctx, Stage stage,
           std::chrono::milliseconds watch_deadline);
  // The RPC in flight has completed; returns the watchdog's reason when it cancelled it.
  std::string disarm();
  void hold(const std::shared_ptr<WorkerEndpoint>& worker);
  void unhold(const std::shared_ptr<WorkerEndpoint>& worker);
  void unhold_all();
  // Stops the RPC in flight and aborts the request on the attempt's workers.
  void stop_in_flight();
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

  // ---- observer (dispatch_call.cpp) ----
  // false when nothing may be delivered any more (cancelled, or the request has ended).
  bool deliver(const v1::TokenEvent& event);
  void deliver_error(const Status& error);
  void deliver_prefilled(const PrefillFigures& figures);

  // ---- RPC stages (dispatch_stages.cpp) ----
  // The current attempt's resume tokens into a request's repeated field.
  template <typename Field>
  void set_resume(Field* field) const {
    field->Assign(resume_.begin(), resume_.end());
  }
  void start_reserve();
  void start_prefill(v1::KvDestination destination, bool early);
  // While the Prefill runs, every third of the lease: RenewLease on the decode worker, then
  // (when it renewed) on the prefill worker (worker.proto). A lease too short for the
  // watchdog's resolution (under 6 watch periods) is not renewed.
  void renew_lease_if_due(std::chrono::steady_clock::time_point now);
  void renew_on_prefill(std::chrono::steady_clock::time_point asked, int attempt);
  // One RenewLease for `lease`, within renewal_deadline(full_lease); `then` gets whether it
  // renewed (a failure is logged, naming `not_found` when the worker had nothing under the id).
  void send_renewal(const std::shared_ptr<WorkerEndpoint>& worker, uint64_t id,
                    std::chrono::milliseconds lease, std::chrono::milliseconds full_lease,
                    const char* not_found, std::function<void(bool)> then);
  std::chrono::milliseconds renewal_deadline(std::chrono::milliseconds lease) const;
  void renewal_done(bool renewed);
  // first_token < 0: an early Decode (its first token comes in the notice), gated.
  void start_decode(int32_t first_token);
  // The Prefill delivered the first token: the early stream's held-back events go out in
  // order, then its end if it came; afterwards its events go out as they come.
  void open_gate();
  // An early stream the Prefill's outcome makes useless: cancelled, its end ignored.
  void drop_early_stream();
  void start_generate();
  void on_stream_event(TokenStream& stream, v1::TokenEvent& event);
  // A stream event the observer gets now (from the stream, or from open_gate's held-back
  // queue): the idle deadline moves, a decode's final usage gets the prefill's cache hits.
  void deliver_streamed(PoolRole role, v1::TokenEvent& event);
  void on_stream_done(TokenStream& stream, const grpc::Status& status, bool finished_seen);
  // A stream's end as the request's flow acts on it (at once, or after the gate opened).
  void stream_ended(const std::shared_ptr<WorkerEndpoint>& worker, const char* rpc, uint64_t id,
                    const grpc::Status& status, bool finished_seen);
  // Best-effort clean-up RPCs; their failures are logged.
  void abort_on(const std::shared_ptr<WorkerEndpoint>& worker, uint64_t id);
  void release_on(const std::shared_ptr<WorkerEndpoint>& worker, uint64_t id);

  const std::shared_ptr<DispatchCore> core_;
  const std::vector<int32_t> prompt_;
  v1::SamplingParams params_;
  const std::optional<uint64_t> first_id_;  // the caller's id for the first attempt

  // Observer side.
  std::mutex deliver_mu_;
  std::shared_ptr<RequestObserver> observer_;     // reset when the request ends
  std::atomic<std::thread::id> delivering_{};     // thread inside an observer callback
  bool delivered_terminal_ = false;               // under deliver_mu_
  // The tokens of the events delivered, in order: a migration's resume tokens. Written by
  // deliver() and read by begin_attempt(), both on the request's own flow (one step at a time).
  std::vector<int32_t> delivered_tokens_;
  std::atomic<bool> started_{false};              // an event went to the observer
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> cancel_deferred_{false};      // cancel() from inside a callback

  // Stage side: written under mu_ by the request's own flow (one step at a time), read
  // without the lock by that flow and under it by cancel() and the watchdog.
  std::mutex mu_;
  Stage stage_ = Stage::kIdle;
  std::atomic<int> attempt_{0};  // read by stream callbacks of earlier attempts too
  int migrations_ = 0;  // attempts begun after the first token went out
  uint64_t id_ = 0;  // the worker-side request id of the current attempt
  std::vector<int32_t> resume_;  // the current attempt's resume tokens (delivered before it)
  std::atomic<bool> attempt_streamed_{false};  // the current attempt's stream sent an event
  Assignment workers_;
  bool held_[3] = {false, false, false};  // unified, prefill, decode: inflight counted
  int64_t held_prefill_tokens_ = 0;       // added to the prefill worker's prefill_tokens
  std::chrono::steady_clock::time_point queued_at_;  // under mu_
  // In all attempts: written under mu_ by the request's flow, read by it and the watchdog.
  std::chrono::milliseconds queue_waited_{0};
  // Waits for decode room: their count (not counted as attempts), the last refusal, and the
  // backoff's end (steady clock ns; 0: none).
  int decode_waits_ = 0;
  std::string decode_refusal_;  // under mu_
  std::atomic<int64_t> not_before_ns_{0};
  std::vector<uint64_t> excluded_;        // workers that failed this request
  std::shared_ptr<grpc::ClientContext> active_;
  std::string timeout_reason_;
  // The early Decode of the current attempt (null when none) and its gate.
  struct GatedEnd {
    std::shared_ptr<WorkerEndpoint> worker;
    uint64_t id = 0;
    grpc::Status status;
    bool finished_seen = false;
  };
  std::shared_ptr<grpc::ClientContext> early_ctx_;
  std::atomic<int> early_attempt_{0};       // the attempt it belongs to; 0: dropped
  std::atomic<bool> gate_closed_{false};     // its events are held back
  std::vector<v1::TokenEvent> gated_events_;  // under mu_
  std::optional<GatedEnd> gated_end_;         // under mu_
  bool ended_ = false;
  int64_t cached_prompt_tokens_ = 0;  // the prefill's, for the finished event's usage
  std::atomic<int64_t> watch_deadline_ns_{0};  // steady clock; 0: no watchdog deadline
  // Lease renewal of the current attempt's reservation (dispatch_stages.cpp): the next one's
  // time (steady clock ns; 0: none) and the lease. Each round sends its own RenewLease, whether
  // or not the last one was answered (renewal_deadline bounds how many are in flight).
  std::atomic<int64_t> renew_at_ns_{0};
  std::chrono::milliseconds lease_{0};  // under mu_
};

}  // namespace cleave::router
