// A request's attempts, retries, delivery to the observer, cancellation and stage deadlines.
// The RPC stages themselves are in dispatch_stages.cpp.
#include "dispatch/dispatch_call.h"

#include <algorithm>
#include <random>

#include "cleave/common/log.h"
#include "cleave/control/proto_convert.h"
#include "fmt/format.h"

namespace cleave::router {

namespace {

uint64_t random_id_base() {
  std::random_device rd;
  // Random high bits: two routers in front of the same workers do not reuse each other's ids.
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return (v & ~0xffffffffull) | 1;
}

// Errors that another worker would answer the same way are not retried.
bool retryable(StatusCode code) {
  switch (code) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kUnauthenticated:
    case StatusCode::kPermissionDenied:
      return false;
    default:
      return true;
  }
}

}  // namespace

std::chrono::milliseconds DispatchCore::watch_period_for(const DispatcherOptions& opts) {
  const auto shortest = std::min(opts.timeouts.first_token, opts.timeouts.stream_idle);
  return std::clamp(shortest / 8, std::chrono::milliseconds(5), std::chrono::milliseconds(50));
}

DispatchCore::DispatchCore(const DispatcherOptions& opts)
    : options(opts), watch_period(watch_period_for(opts)), pools(opts), next_id(random_id_base()) {
  if (opts.metrics == nullptr) return;
  metrics::MetricsRegistry& r = *opts.metrics;
  if (auto f = r.counter("cleave:kv_transfer_bytes_total",
                         "KV cache bytes written from prefill to decode workers");
      f.ok()) {
    kv_transfer_bytes = &f->get();
  }
  if (auto f = r.histogram("cleave:kv_handoff_tail_seconds",
                           "Seconds from a prefill's last layer computed to its KV in place at "
                           "the decode worker (as the prefill worker reports it)",
                           metrics::latency_buckets_seconds());
      f.ok()) {
    kv_handoff_tail_seconds = &f->get();
  }
  if (auto f = r.histogram("cleave:kv_transfer_seconds",
                           "Seconds from a prefill's first KV write to its KV in place at the "
                           "decode worker (as the prefill worker reports it)",
                           metrics::latency_buckets_seconds());
      f.ok()) {
    kv_transfer_seconds = &f->get();
  }
  if (auto f = r.counter("cleave:router_dispatch_retries_total",
                         "Requests sent to another worker after a failure before their first token");
      f.ok()) {
    retries = &f->get();
  }
  if (auto f = r.counter("cleave:migrations_total",
                         "Started streams whose worker failed, by outcome: resumed (an attempt "
                         "on other workers began from the tokens delivered so far), completed "
                         "(a migrated request finished), refused (ended with an error instead)",
                         {"outcome"});
      f.ok()) {
    migrations_resumed = &f->with({"resumed"});
    migrations_completed = &f->with({"completed"});
    migrations_refused = &f->with({"refused"});
  }
  if (auto f = r.counter("cleave:router_lease_renewals_total",
                         "Renewals of a decode reservation's lease while its prefill waited or "
                         "ran, by outcome: renewed (on both workers), lost (the reservation or "
                         "the prefill was gone, or a worker did not answer)",
                         {"outcome"});
      f.ok()) {
    lease_renewed = &f->with({"renewed"});
    lease_renewal_lost = &f->with({"lost"});
  }
  if (auto f = r.gauge("cleave:router_prefill_queue_requests",
                       "Requests waiting at the router for room on a prefill worker "
                       "(router.prefill_queue_tokens) before their Reserve");
      f.ok()) {
    prefill_queue_requests = &f->get();
  }
  if (auto f = r.histogram("cleave:router_prefill_queue_seconds",
                           "Seconds requests waited at the router for room on a prefill worker "
                           "(only requests that waited)",
                           metrics::latency_buckets_seconds());
      f.ok()) {
    prefill_queue_seconds = &f->get();
  }
  if (auto f = r.counter("cleave:router_worker_failures_total",
                         "RPCs to workers that failed UNAVAILABLE (the worker left its pool)");
      f.ok()) {
    worker_failures = &f->get();
  }
}

void DispatchCore::add_call(const std::shared_ptr<DispatchCall>& call) {
  std::lock_guard<std::mutex> lock(calls_mu_);
  calls_.insert(call);
}

void DispatchCore::remove_call(const std::shared_ptr<DispatchCall>& call) {
  std::lock_guard<std::mutex> lock(calls_mu_);
  calls_.erase(call);
  if (calls_.empty()) calls_cv_.notify_all();
}

void DispatchCore::calls_in_flight(std::vector<std::shared_ptr<DispatchCall>>& out) {
  out.clear();
  std::lock_guard<std::mutex> lock(calls_mu_);
  out.insert(out.end(), calls_.begin(), calls_.end());
}

bool DispatchCore::wait_no_calls(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(calls_mu_);
  return calls_cv_.wait_for(lock, timeout, [&] { return calls_.empty(); });
}

void DispatchCore::publish_waiting_locked() {
  waiting_count_.store(static_cast<int64_t>(waiting_.size()), std::memory_order_release);
  if (prefill_queue_requests) prefill_queue_requests->set(static_cast<double>(waiting_.size()));
}

void DispatchCore::enqueue(std::shared_ptr<DispatchCall> call) {
  std::lock_guard<std::mutex> lock(waiting_mu_);
  waiting_.push_back(std::move(call));
  publish_waiting_locked();
}

bool DispatchCore::take_waiting(const DispatchCall* call) {
  std::lock_guard<std::mutex> lock(waiting_mu_);
  auto it = std::find_if(waiting_.begin(), waiting_.end(),
                         [&](const auto& c) { return c.get() == call; });
  if (it == waiting_.end()) return false;
  waiting_.erase(it);
  publish_waiting_locked();
  return true;
}

void DispatchCore::admit_waiting() {
  while (has_waiting() && !stopping.load(std::memory_order_acquire)) {
    if (admitting_.exchange(true, std::memory_order_acq_rel)) {
      admit_again_.store(true, std::memory_order_release);  // the thread inside looks again
      return;
    }
    do {
      admit_again_.store(false, std::memory_order_release);
      admit_round();
    } while (admit_again_.load(std::memory_order_acquire));
    admitting_.store(false, std::memory_order_release);
    // A call that came between the last look and the store above found admitting_ set.
    if (!admit_again_.load(std::memory_order_acquire)) return;
  }
}

void DispatchCore::admit_round() {
  struct Admitted {
    std::shared_ptr<DispatchCall> call;
    Result<Assignment> workers;
  };
  std::vector<Admitted> go;
  {
    std::lock_guard<std::mutex> lock(waiting_mu_);
    const auto now = std::chrono::steady_clock::now();
    while (!waiting_.empty() && waiting_.front()->due(now)) {
      bool busy = false;
      Result<Assignment> workers = waiting_.front()->choose_workers(&busy);
      if (busy) break;  // strict order: the head waits, and so does everyone behind it
      // Held now, so that the next one's choice sees this one's tokens.
      if (workers.ok()) waiting_.front()->hold(workers->prefill);
      go.push_back(Admitted{std::move(waiting_.front()), std::move(workers)});
      waiting_.pop_front();
    }
    publish_waiting_locked();
  }
  // Outside the lock: an attempt's start may run completions (and enqueue) on this thread.
  for (Admitted& a : go) a.call->leave_queue(std::move(a.workers));
}

DispatchCall::DispatchCall(std::shared_ptr<DispatchCore> core, DispatchRequest request,
                           std::shared_ptr<RequestObserver> observer)
    : core_(std::move(core)),
      prompt_(std::move(request.prompt)),
      first_id_(request.request_id),
      observer_(std::move(observer)) {
  to_proto(request.params, &params_);
}

DispatchCall::~DispatchCall() = default;

void DispatchCall::start(Assignment workers) { begin_attempt(std::move(workers)); }

void DispatchCall::start_queued() { wait_for_room(); }

Result<Assignment> DispatchCall::choose_workers(bool* busy) {
  std::vector<uint64_t> excluded;
  {
    std::lock_guard<std::mutex> lock(mu_);
    excluded = excluded_;
  }
  return core_->pools.choose(prompt_, excluded, prefill_token_count(), busy);
}

void DispatchCall::wait_for_room() {
  const auto now = std::chrono::steady_clock::now();
  const auto left = core_->options.timeouts.prefill - queue_waited_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stage_ = Stage::kQueued;
    active_.reset();
    queued_at_ = now;
    watch_deadline_ns_.store(steady_ns(now + left), std::memory_order_relaxed);
  }
  core_->enqueue(shared_from_this());
  // A cancel() that came before the call was in the queue did not find it there.
  if (cancelled() && core_->take_waiting(this)) {
    end();
    return;
  }
  core_->admit_waiting();  // room may have come before the call was in the queue
}

void DispatchCall::leave_queue(Result<Assignment> workers) {
  std::chrono::steady_clock::duration waited;
  {
    std::lock_guard<std::mutex> lock(mu_);  // the watchdog reads queue_waited_ too
    waited = std::chrono::steady_clock::now() - queued_at_;
    watch_deadline_ns_.store(0, std::memory_order_relaxed);
    queue_waited_ += std::chrono::duration_cast<std::chrono::milliseconds>(waited);
  }
  if (core_->prefill_queue_seconds) {
    core_->prefill_queue_seconds->observe(std::chrono::duration<double>(waited).count());
  }
  if (workers.ok() && queue_waited_ >= core_->options.timeouts.prefill) {
    // Admitted as its deadline passed (before the watchdog saw it): no time left to prefill.
    {
      std::lock_guard<std::mutex> lock(mu_);
      workers_ = *workers;  // so that end() gives back the tokens admit_round held
    }
    workers = room_timeout(queue_waited_);
  }
  if (!workers.ok()) {
    if (started_.load(std::memory_order_acquire) && core_->migrations_refused) {
      core_->migrations_refused->inc();
    }
    fail(workers.status());
    return;
  }
  begin_attempt(std::move(*workers));
}

void DispatchCall::wait_for_decode_room(Status why) {
  unhold_all();
  if (cancelled()) {
    end();
    return;
  }
  // 50, 100, 200, 400, then 800 ms.
  const std::chrono::milliseconds backoff(50 << std::min(decode_waits_, 4));
  ++decode_waits_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    decode_refusal_ = why.message();
  }
  not_before_ns_.store(steady_ns(std::chrono::steady_clock::now() + backoff),
                       std::memory_order_relaxed);
  if (decode_waits_ == 1) {
    log::debug("dispatch: request attempt {} waits for decode room ({})", attempt_.load(),
               why.to_string());
  }
  wait_for_room();
}

Status DispatchCall::room_timeout(std::chrono::steady_clock::duration waited) {
  std::string refusal;
  {
    std::lock_guard<std::mutex> lock(mu_);
    refusal = decode_refusal_;
  }
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(waited).count();
  if (!refusal.empty()) {
    return ResourceExhausted(fmt::format(
        "no decode worker had room for the request's KV within {} ms (the last refusal: {})", ms,
        refusal));
  }
  return ResourceExhausted(fmt::format(
      "no prefill worker had room for the request's {} prompt tokens within {} ms "
      "(router.prefill_queue_tokens: {} tokens of this router's prefills in flight per worker; "
      "{} more requests waiting)",
      prefill_token_count(), ms, core_->options.prefill_queue_tokens, core_->waiting()));
}

void DispatchCall::begin_attempt(Assignment workers) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++attempt_;
    id_ = attempt_ == 1 && first_id_ ? *first_id_ : core_->next_request_id();
    workers_ = std::move(workers);
    resume_ = delivered_tokens_;
    attempt_streamed_.store(false, std::memory_order_relaxed);
  }
  if (workers_.unified) {
    hold(workers_.unified);
    start_generate();
  } else {
    hold(workers_.decode);
    hold(workers_.prefill);
    start_reserve();
  }
}

void DispatchCall::attempt_failed(const std::shared_ptr<WorkerEndpoint>& worker, Status error) {
  if (error.code() == StatusCode::kUnavailable) {
    core_->pools.mark_failed(worker, error);
    if (core_->worker_failures) core_->worker_failures->inc();
  }
  retry_without(worker, std::move(error));
}

void DispatchCall::retry_without(const std::shared_ptr<WorkerEndpoint>& worker, Status error) {
  unhold_all();
  if (cancelled()) {
    end();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    excluded_.push_back(worker->key);
  }
  const bool started = started_.load(std::memory_order_acquire);
  bool busy = false;  // the next attempt waits for room on a prefill worker, like a new request
  Result<Assignment> next = next_attempt(error, &busy);
  if (!next.ok() && !busy) {
    if (started && core_->migrations_refused) core_->migrations_refused->inc();
    fail(next.status());
    return;
  }
  const std::string where =
      busy            ? std::string("the first prefill worker with room")
      : next->unified ? next->unified->address
                      : fmt::format("{} + {}", next->prefill->address, next->decode->address);
  if (started) {
    ++migrations_;
    log::info("dispatch: request attempt {} failed after {} tokens ({}); migrating to {} "
              "(migration {} of {})",
              attempt_.load(), delivered_tokens_.size(), error.to_string(), where, migrations_,
              core_->options.max_migrations);
    if (core_->migrations_resumed) core_->migrations_resumed->inc();
  } else {
    log::info("dispatch: request attempt {} failed before its first token ({}); retrying on {}",
              attempt_.load(), error.to_string(), where);
    if (core_->retries) core_->retries->inc();
  }
  if (busy) {
    wait_for_room();
  } else {
    begin_attempt(std::move(*next));
  }
}

Result<Assignment> DispatchCall::next_attempt(const Status& error, bool* busy) {
  const bool started = started_.load(std::memory_order_acquire);
  std::string why;  // a started stream's error says why it was not migrated
  if (!retryable(error.code())) {
    why = "another worker would answer the same";
  } else if (core_->stopping.load()) {
    why = "the router is shutting down";
  } else if (!started && attempt_ - decode_waits_ >= core_->options.max_attempts) {
    return error;
  } else if (started && migrations_ >= core_->options.max_migrations) {
    why = fmt::format("{} migrations made, router.max_migrations is {}", migrations_,
                      core_->options.max_migrations);
  } else {
    auto next = choose_workers(busy);
    if (next.ok() || *busy) return next;
    return Status(error.code(), fmt::format("{} (not {}: {})", error.message(),
                                            started ? "migrated" : "retried",
                                            next.status().message()));
  }
  if (!started) return error;
  return Status(error.code(), fmt::format("{} (not migrated: {})", error.message(), why));
}

void DispatchCall::fail(Status error) {
  deliver_error(error);
  end();
}

void DispatchCall::end() {
  unhold_all();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_) return;
    ended_ = true;
    stage_ = Stage::kIdle;
    active_.reset();
    watch_deadline_ns_.store(0, std::memory_order_relaxed);
    renew_at_ns_.store(0, std::memory_order_relaxed);
  }
  std::shared_ptr<RequestObserver> observer;
  {
    // Not from inside a callback (end() runs on the request's flow, never within deliver()).
    std::lock_guard<std::mutex> lock(deliver_mu_);
    delivered_terminal_ = true;
    observer = std::move(observer_);  // breaks observer -> handle -> call cycles
  }
  core_->admitted.fetch_sub(1, std::memory_order_acq_rel);
  core_->remove_call(shared_from_this());
}

bool DispatchCall::arm(std::shared_ptr<grpc::ClientContext> ctx, Stage stage,
                       std::chrono::milliseconds watch_deadline) {
  std::lock_guard<std::mutex> lock(mu_);
  if (cancelled()) return false;
  active_ = std::move(ctx);
  stage_ = stage;
  timeout_reason_.clear();
  const int64_t d =
      watch_deadline.count() > 0 ? steady_ns(std::chrono::steady_clock::now() + watch_deadline)
                                 : 0;
  watch_deadline_ns_.store(d, std::memory_order_relaxed);
  return true;
}

std::string DispatchCall::disarm() {
  std::lock_guard<std::mutex> lock(mu_);
  active_.reset();
  watch_deadline_ns_.store(0, std::memory_order_relaxed);
  renew_at_ns_.store(0, std::memory_order_relaxed);
  return std::move(timeout_reason_);
}

void DispatchCall::hold(const std::shared_ptr<WorkerEndpoint>& worker) {
  const int i = static_cast<int>(worker->role);
  std::lock_guard<std::mutex> lock(mu_);
  if (held_[i]) return;
  held_[i] = true;
  worker->inflight.fetch_add(1, std::memory_order_relaxed);
  if (worker->role == PoolRole::kPrefill) {
    held_prefill_tokens_ = prefill_token_count();
    worker->prefill_tokens.fetch_add(held_prefill_tokens_, std::memory_order_relaxed);
  }
}

void DispatchCall::unhold(const std::shared_ptr<WorkerEndpoint>& worker) {
  const int i = static_cast<int>(worker->role);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!held_[i]) return;
    held_[i] = false;
    worker->inflight.fetch_sub(1, std::memory_order_relaxed);
    if (worker->role != PoolRole::kPrefill) return;
    worker->prefill_tokens.fetch_sub(held_prefill_tokens_, std::memory_order_relaxed);
    held_prefill_tokens_ = 0;
  }
  core_->admit_waiting();  // that room may be a waiting request's
}

void DispatchCall::unhold_all() {
  for (const auto* w : {&workers_.unified, &workers_.prefill, &workers_.decode}) {
    if (*w) unhold(*w);
  }
}

void DispatchCall::stop_in_flight() {
  std::shared_ptr<grpc::ClientContext> ctx, early;
  Assignment workers;
  uint64_t id = 0;
  bool queued = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_) return;
    queued = stage_ == Stage::kQueued;
    ctx = active_;
    early = early_ctx_;  // an early Decode beside the Prefill in flight
    workers = workers_;
    id = id_;
  }
  if (queued) {
    // Waiting for room: nothing is in flight on any worker (the last attempt's were told when
    // it failed). Whoever takes the request out of the queue ends it; when the queue no longer
    // has it, its attempt is starting and finds it cancelled.
    if (core_->take_waiting(this)) end();
    return;
  }
  // Outside the lock: gRPC may run the completion of the cancelled call right here.
  if (ctx) ctx->TryCancel();
  if (early && early != ctx) early->TryCancel();
  if (workers.unified) abort_on(workers.unified, id);
  if (workers.prefill) abort_on(workers.prefill, id);
  if (workers.decode) abort_on(workers.decode, id);
}

void DispatchCall::cancel() {
  if (delivering_.load(std::memory_order_acquire) == std::this_thread::get_id()) {
    // Inside this request's callback (deliver_mu_ is ours): stop once it returns.
    if (delivered_terminal_ || cancelled()) return;
    cancelled_.store(true, std::memory_order_release);
    cancel_deferred_.store(true, std::memory_order_release);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(deliver_mu_);
    if (delivered_terminal_ || cancelled()) return;
    cancelled_.store(true, std::memory_order_release);
  }
  stop_in_flight();
}

void DispatchCall::abandon(const Status& why) {
  deliver_error(why);
  {
    std::lock_guard<std::mutex> lock(deliver_mu_);
    cancelled_.store(true, std::memory_order_release);
  }
  stop_in_flight();
}

bool DispatchCall::deliver(const v1::TokenEvent& event) {
  bool stop_now = false;
  {
    std::lock_guard<std::mutex> lock(deliver_mu_);
    if (cancelled() || delivered_terminal_ || !observer_) return false;
    // Counted before the observer hears of the end, so that it sees the count.
    if (event.finished() && migrations_ > 0 && core_->migrations_completed) {
      core_->migrations_completed->inc();
    }
    delivering_.store(std::this_thread::get_id(), std::memory_order_release);
    observer_->on_event(event);
    delivering_.store(std::thread::id{}, std::memory_order_release);
    if (event.has_token()) delivered_tokens_.push_back(event.token());
    started_.store(true, std::memory_order_release);
    if (event.finished() && !cancelled()) delivered_terminal_ = true;
    stop_now = cancel_deferred_.exchange(false);
  }
  if (stop_now) {
    stop_in_flight();
    return false;
  }
  return true;
}

void DispatchCall::deliver_prefilled(const PrefillFigures& figures) {
  std::lock_guard<std::mutex> lock(deliver_mu_);
  if (cancelled() || delivered_terminal_ || !observer_) return;
  delivering_.store(std::this_thread::get_id(), std::memory_order_release);
  observer_->on_prefilled(figures);
  delivering_.store(std::thread::id{}, std::memory_order_release);
}

void DispatchCall::deliver_error(const Status& error) {
  std::lock_guard<std::mutex> lock(deliver_mu_);
  if (cancelled() || delivered_terminal_ || !observer_) return;
  // Set first: a cancel() from inside on_error finds the request over and does nothing.
  delivered_terminal_ = true;
  delivering_.store(std::this_thread::get_id(), std::memory_order_release);
  observer_->on_error(error, started_.load(std::memory_order_acquire));
  delivering_.store(std::thread::id{}, std::memory_order_release);
}

void DispatchCall::check_deadline(std::chrono::steady_clock::time_point now) {
  renew_lease_if_due(now);
  const int64_t d = watch_deadline_ns_.load(std::memory_order_relaxed);
  if (d == 0 || now.time_since_epoch() < std::chrono::nanoseconds(d)) return;
  std::shared_ptr<grpc::ClientContext> ctx;
  std::chrono::steady_clock::duration waited{};
  const auto& t = core_->options.timeouts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (watch_deadline_ns_.load(std::memory_order_relaxed) != d) return;
    if (stage_ != Stage::kQueued && !active_) return;
    watch_deadline_ns_.store(0, std::memory_order_relaxed);
    if (stage_ == Stage::kQueued) {
      waited = now - queued_at_ + queue_waited_;
    } else {
      const std::string worker =
          stage_ == Stage::kGenerate && workers_.unified ? workers_.unified->address
          : workers_.decode                              ? workers_.decode->address
                                                         : std::string("?");
      if (stage_ == Stage::kGenerate && !attempt_streamed_.load(std::memory_order_relaxed)) {
        timeout_reason_ = fmt::format("worker {}: Generate: no first token within {} ms",
                                      worker, t.first_token.count());
      } else {
        timeout_reason_ = fmt::format("worker {}: {}: no token for {} ms", worker,
                                      stage_ == Stage::kGenerate ? "Generate" : "Decode",
                                      t.stream_idle.count());
      }
      ctx = active_;
    }
  }
  if (ctx) {
    ctx->TryCancel();
    return;
  }
  // Waited for room on a prefill worker as long as the Prefill's deadline allows.
  if (!core_->take_waiting(this)) return;  // admitted meanwhile
  fail(room_timeout(waited));
}

}  // namespace cleave::router
