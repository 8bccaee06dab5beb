// Generate and Decode as callback-API reactors fed by the engine and written by the pump.
#include "token_stream.h"

#include "cleave/common/log.h"
#include "cleave/common/thread_pool.h"
#include "cleave/worker/proto_convert.h"
#include "fmt/format.h"

namespace cleave::worker_service {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

class TokenStreamCall final : public grpc::ServerWriteReactor<v1::TokenEvent>,
                              public std::enable_shared_from_this<TokenStreamCall> {
 public:
  enum class Kind : uint8_t { kGenerate, kDecode };

  // The call never touches its grpc::CallbackServerContext: gRPC may free it as soon as OnDone
  // has run, while the engine's callback or the pump still hold the call. Cancellation arrives
  // through OnCancel (client_gone_).
  TokenStreamCall(TokenStreamPump& pump, Kind kind, RequestId id)
      : pump_(pump), core_(pump.core()), kind_(kind), id_(id), start_(Clock::now()) {
    core_.calls_in_flight.fetch_add(1);
  }

  const char* rpc() const { return kind_ == Kind::kGenerate ? "Generate" : "Decode"; }

  // Owned by itself until OnDone.
  void adopt() { self_ = shared_from_this(); }

  // Submits `request` to the engine; false (and the call finished) when the engine refuses it.
  bool submit(EngineRequest request) {
    auto self = shared_from_this();
    {
      std::lock_guard<std::mutex> lk(mu_);
      submitted_ = true;
    }
    const Status st = core_.engine->submit(
        std::move(request), [self](const EngineEvent& ev) { self->on_engine_event(ev); });
    if (!st.ok()) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        submitted_ = false;
      }
      finish_now(st);
      return false;
    }
    return true;
  }

  // Decode: waits for the reservation `claim` (the pump polls it).
  void wait_for_kv(ReservationTable::Claim claim, v1::DecodeRequest request) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      waiting_kv_ = true;
      claim_ = claim;
      decode_ = std::move(request);
    }
    pump_.watch(shared_from_this());
  }

  // Ends the call with `error` (to_grpc) before anything was written.
  void finish_now(const Status& error) {
    grpc::Status status = to_grpc(error);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (finishing_) return;
      finishing_ = true;
      final_ = status;
    }
    Finish(std::move(status));
  }

  // Engine thread: queue the event; hand the call to the pump unless a write or a pump run is
  // already pending (they take the queue when they end).
  void on_engine_event(const EngineEvent& ev) {
    bool schedule = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (done_) return;
      if (ev.has_token && first_token_at_ == Clock::time_point{}) first_token_at_ = Clock::now();
      queue_.push_back(ev);
      if (!writing_ && !scheduled_) schedule = scheduled_ = true;
    }
    if (schedule) pump_.schedule(shared_from_this());
  }

  // Pump thread or a gRPC thread: starts the next write, or finishes the call.
  void pump() {
    guarded([this] { pump_events(); });
  }

  // Pump thread, every kCancelPoll while watched: a Decode's wait for its KV, and the grace of a
  // cancelled request. false when the call needs no more watching.
  bool poll(Clock::time_point now) {
    bool watch = false;
    guarded([&] { watch = poll_once(now); });
    return watch;
  }

  // The stream's boundary: runs `body`; an exception it lets out ends the call with INTERNAL
  // (and cancels its request in the engine) instead of reaching gRPC or the pump thread.
  template <typename Body>
  void guarded(Body&& body) {
    try {
      body();
    } catch (const std::exception& e) {
      fail_internal(e.what());
    } catch (...) {
      fail_internal("an exception that is not a std::exception");
    }
  }

  void pump_events() {
    enum class Action : uint8_t { kNone, kWrite, kWriteLast, kFinish } action = Action::kNone;
    Status error;         // of kFinish
    grpc::Status status;  // of kWriteLast and kFinish
    {
      std::lock_guard<std::mutex> lk(mu_);
      scheduled_ = false;
      if (done_ || writing_ || finishing_) return;
      while (action == Action::kNone) {
        if (next_ >= taking_.size()) {
          taking_.clear();
          next_ = 0;
          taking_.swap(queue_);
          if (taking_.empty()) break;
        }
        const EngineEvent& ev = taking_[next_++];
        if (!ev.error.ok()) {
          error = ev.error;
          action = Action::kFinish;
        } else if (ev.finished && ev.finish_reason == FinishReason::kCancelled) {
          error = Cancelled(fmt::format("request {} was cancelled", id_));
          action = Action::kFinish;
        } else if (client_gone_) {
          // Nothing more goes out; the call ends with the request.
          if (ev.finished) {
            error = Cancelled(fmt::format("request {}: the client went away", id_));
            action = Action::kFinish;
          }
        } else {
          to_proto(ev, &msg_);
          action = ev.finished ? Action::kWriteLast : Action::kWrite;
        }
      }
      if (action == Action::kWrite) writing_ = true;
      if (action == Action::kWriteLast || action == Action::kFinish) {
        finishing_ = true;
        status = action == Action::kWriteLast ? grpc::Status::OK : to_grpc(error);
        final_ = status;
      }
    }
    switch (action) {
      case Action::kNone: break;
      case Action::kWrite: StartWrite(&msg_); break;
      case Action::kWriteLast:
        StartWriteAndFinish(&msg_, grpc::WriteOptions(), status);
        break;
      case Action::kFinish: Finish(status); break;
    }
  }

  bool poll_once(Clock::time_point now) {
    bool kv_wait = false;
    bool grace_over = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (done_ || finishing_) return false;
      kv_wait = waiting_kv_;
      if (!kv_wait) {
        if (!client_gone_) return false;
        grace_over = now - gone_at_ > kCancelGrace;
        if (!grace_over) return true;
      }
    }
    if (grace_over) {
      log::warn("request {}: no end from the engine {} s after its cancellation", id_,
                kCancelGrace.count());
      finish_now(Cancelled(fmt::format("request {}: the client went away", id_)));
      return false;
    }
    return poll_kv();
  }

  void OnWriteDone(bool ok) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      writing_ = false;
    }
    if (!ok) client_went_away();
    pump();
  }

  void OnCancel() override {
    client_went_away();
    pump_.wake();  // a Decode waiting for its KV gives up at its next poll
    pump();
  }

  void OnDone() override {
    std::shared_ptr<TokenStreamCall> keep;
    grpc::Status final_status;
    Clock::time_point first{};
    {
      std::lock_guard<std::mutex> lk(mu_);
      done_ = true;
      keep = std::move(self_);
      final_status = final_;
      first = first_token_at_;
      queue_.clear();
      taking_.clear();
    }
    if (kind_ == Kind::kGenerate && first != Clock::time_point{}) {
      core_.metrics.time_to_first_token_seconds->observe(
          std::chrono::duration<double>(first - start_).count());
    }
    if (final_status.ok()) core_.metrics.e2e_request_seconds->observe(seconds_since(start_));
    (void)count_rpc(core_, rpc(), final_status);
    core_.calls_in_flight.fetch_sub(1);
    // `keep` goes last: the engine's callback or the pump may still hold the call too.
  }

 private:
  void fail_internal(std::string_view what) {
    log::error("worker {}: request {}: {} failed: {}", core_.id, id_, rpc(), what);
    bool cancel_engine = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      cancel_engine = submitted_ && !engine_cancelled_;
      if (cancel_engine) engine_cancelled_ = true;
    }
    if (cancel_engine) core_.engine->cancel(id_);
    finish_now(Internal(fmt::format("request {}: {} failed: {}", id_, rpc(), what)));
  }

  // The client is gone (cancelled, deadline, a failed write): cancel the request in the engine
  // once it has it, and watch for the grace.
  void client_went_away() {
    bool cancel_engine = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (done_) return;
      if (!client_gone_) {
        client_gone_ = true;
        gone_at_ = Clock::now();
      }
      cancel_engine = submitted_ && !engine_cancelled_ && !finishing_;
      if (cancel_engine) engine_cancelled_ = true;
    }
    if (!cancel_engine) return;
    core_.engine->cancel(id_);
    pump_.watch(shared_from_this());
  }

  // The Decode's reservation: still waiting (true), or the stream starts / the call ends.
  bool poll_kv() {
    using Outcome = ReservationTable::Outcome;
    ReservationTable::Claim claim;
    bool gone = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      claim = claim_;
      gone = client_gone_;
    }
    const auto taken = core_.reservations.poll(id_, claim, gone);
    if (!taken) return true;
    {
      std::lock_guard<std::mutex> lk(mu_);
      waiting_kv_ = false;
    }
    switch (taken->outcome) {
      case Outcome::kFilled:
        break;
      case Outcome::kExpired: {
        // The engine's ledger ended the reservation (blocks back, counted) and told the table.
        const std::string why =
            taken->renewals == 0
                ? fmt::format("request {}: the KV did not arrive within the lease of {} ms", id_,
                              taken->lease.count())
                : fmt::format("request {}: the KV did not arrive within the lease ({} ms after "
                              "the last of {} renewals)",
                              id_, taken->lease.count(), taken->renewals);
        log::info("worker {}: {}", core_.id, why);
        finish_now(FailedPrecondition(why));
        return false;
      }
      case Outcome::kGaveUp:
        (void)core_.engine->release_reservation(id_);
        finish_now(Cancelled(fmt::format("request {}: the client went away", id_)));
        return false;
      case Outcome::kShutdown:
        finish_now(Unavailable(fmt::format("worker '{}' is shutting down", core_.id)));
        return false;
      case Outcome::kReleased:
      default:
        finish_now(
            Cancelled(fmt::format("request {}: the reservation was released or aborted", id_)));
        return false;
    }
    core_.metrics.kv_wait_seconds->observe(seconds_since(start_));
    EngineRequest r;
    r.id = id_;
    r.prompt.assign(decode_.prompt_tokens().begin(), decode_.prompt_tokens().end());
    r.params = decode_.has_params() ? from_proto(decode_.params()) : SamplingParams{};
    r.prefilled = true;
    r.first_token = decode_.first_token();
    if (decode_.first_token_from_notice()) {
      const std::optional<int32_t> first = token_of_notice_value(taken->notice_value);
      if (!first) {
        (void)core_.engine->release_reservation(id_);
        finish_now(FailedPrecondition(fmt::format(
            "request {}: the Decode waits for the first token in the KV's notice, but the notice "
            "carried none (the prefill worker was not asked to send it)",
            id_)));
        return false;
      }
      r.first_token = *first;
    }
    r.resume_tokens.assign(decode_.resume_tokens().begin(), decode_.resume_tokens().end());
    if (static_cast<int64_t>(r.prompt.size() + r.resume_tokens.size()) != taken->num_tokens) {
      (void)core_.engine->release_reservation(id_);
      finish_now(InvalidArgument(fmt::format(
          "request {}: the prompt has {} tokens ({} resumed) but {} were reserved", id_,
          r.prompt.size() + r.resume_tokens.size(), r.resume_tokens.size(), taken->num_tokens)));
      return false;
    }
    if (!submit(std::move(r))) {
      (void)core_.engine->release_reservation(id_);
      return false;
    }
    // A client that left meanwhile: cancel the request just submitted. (Once submitted, the
    // request's events may end the call on a gRPC thread at any moment, and gRPC then frees
    // the context: the flag is what may be read here.)
    {
      std::lock_guard<std::mutex> lk(mu_);
      gone = client_gone_;
    }
    if (gone) client_went_away();
    return false;
  }

  TokenStreamPump& pump_;
  WorkerCore& core_;
  const Kind kind_;
  const RequestId id_;
  const Clock::time_point start_;

  std::mutex mu_;
  std::shared_ptr<TokenStreamCall> self_;  // until OnDone
  std::vector<EngineEvent> queue_;         // from the engine, not yet taken
  std::vector<EngineEvent> taking_;        // being written, from next_
  size_t next_ = 0;
  v1::TokenEvent msg_;                     // the write in flight
  bool writing_ = false;
  bool scheduled_ = false;   // handed to the pump and not yet pumped
  bool finishing_ = false;   // Finish (or the last write) started
  bool done_ = false;
  bool submitted_ = false;   // the engine has the request
  bool client_gone_ = false;
  bool engine_cancelled_ = false;  // engine->cancel() was called
  Clock::time_point gone_at_{};
  Clock::time_point first_token_at_{};
  grpc::Status final_;
  // Decode's wait for its KV.
  bool waiting_kv_ = false;
  ReservationTable::Claim claim_;
  v1::DecodeRequest decode_;
};

TokenStreamPump::TokenStreamPump(WorkerCore& core) : core_(core) {
  core_.reservations.set_listener([this] { wake(); });
  thread_ = std::thread([this] { loop(); });
}

TokenStreamPump::~TokenStreamPump() { stop(); }

void TokenStreamPump::schedule(std::shared_ptr<TokenStreamCall> call) {
  bool notify = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    notify = ready_.empty();
    ready_.push_back(std::move(call));
  }
  if (notify) cv_.notify_one();
}

void TokenStreamPump::watch(std::shared_ptr<TokenStreamCall> call) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    watched_.push_back(std::move(call));
    woken_ = true;
  }
  cv_.notify_one();
}

void TokenStreamPump::wake() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    woken_ = true;
  }
  cv_.notify_one();
}

void TokenStreamPump::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
  core_.reservations.set_listener(nullptr);
  std::lock_guard<std::mutex> lk(mu_);
  ready_.clear();
  watched_.clear();
}

void TokenStreamPump::loop() {
  set_thread_name("stream-pump");
  std::vector<std::shared_ptr<TokenStreamCall>> ready, watched;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      const auto wake = [&] { return stop_ || woken_ || !ready_.empty(); };
      if (watched_.empty()) {
        cv_.wait(lk, wake);
      } else {
        cv_.wait_for(lk, kCancelPoll, wake);
      }
      if (stop_) return;
      woken_ = false;
      ready.swap(ready_);
      watched.swap(watched_);
    }
    for (auto& call : ready) call->pump();
    ready.clear();
    const auto now = Clock::now();
    size_t kept = 0;
    for (auto& call : watched) {
      if (call->poll(now)) watched[kept++] = std::move(call);
    }
    watched.resize(kept);
    if (!watched.empty()) {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& call : watched) watched_.push_back(std::move(call));
    }
    watched.clear();
  }
}

grpc::ServerWriteReactor<v1::TokenEvent>* start_generate(TokenStreamPump& pump,
                                                         const v1::GenerateRequest* req) {
  auto call = std::make_shared<TokenStreamCall>(pump, TokenStreamCall::Kind::kGenerate,
                                                req->request_id());
  call->adopt();
  call->guarded([&] {
    WorkerCore& core = pump.core();
    if (core.role != WorkerRole::kUnified) {
      call->finish_now(wrong_role(core, "Generate", "unified"));
      return;
    }
    if (Status d = core.refuse_if_draining("Generate"); !d.ok()) {
      call->finish_now(d);
      return;
    }
    EngineRequest r;
    r.id = req->request_id();
    r.prompt.assign(req->prompt_tokens().begin(), req->prompt_tokens().end());
    r.params = req->has_params() ? from_proto(req->params()) : SamplingParams{};
    r.resume_tokens.assign(req->resume_tokens().begin(), req->resume_tokens().end());
    (void)call->submit(std::move(r));
  });
  return call.get();
}

grpc::ServerWriteReactor<v1::TokenEvent>* start_decode(TokenStreamPump& pump,
                                                       const v1::DecodeRequest* req) {
  using Outcome = ReservationTable::Outcome;
  auto call = std::make_shared<TokenStreamCall>(pump, TokenStreamCall::Kind::kDecode,
                                                req->request_id());
  call->adopt();
  call->guarded([&] {
    WorkerCore& core = pump.core();
    const RequestId id = req->request_id();
    if (core.role != WorkerRole::kDecode) {
      call->finish_now(wrong_role(core, "Decode", "decode"));
      return;
    }
    const ReservationTable::Claim claim = core.reservations.claim(id);
    switch (claim.outcome) {
      case Outcome::kFilled:
        call->wait_for_kv(claim, *req);
        break;
      case Outcome::kBusy:
        call->finish_now(
            AlreadyExists(fmt::format("a Decode of request {} is already waiting", id)));
        break;
      case Outcome::kShutdown:
        call->finish_now(Unavailable(fmt::format("worker '{}' is shutting down", core.id)));
        break;
      default:
        call->finish_now(NotFound(
            fmt::format("no reservation for request {} on worker '{}' (never made, already used, "
                        "released or expired)",
                        id, core.id)));
        break;
    }
  });
  return call.get();
}

}  // namespace cleave::worker_service
