// Prefill workers: Prefill computes the prompt, streams each layer's KV into the decode worker's
// reservation as it is computed (KvSender), sends the notice after the data and answers with
// the first token. On gRPC's callback API: no thread waits for a prefill. Every wait is
// bounded; on any failure the local blocks are freed once no write reads them.
#include <utility>

#include "cleave/common/log.h"
#include "cleave/worker/kv_export.h"
#include "cleave/worker/proto_convert.h"
#include "fmt/format.h"
#include "grpcpp/alarm.h"
#include "worker_core.h"

namespace cleave::worker_service {
namespace {

using Clock = std::chrono::steady_clock;

// The pairing check on the message's raw fields, before anything is parsed, so that a layout
// this build cannot represent is still refused as a mismatch that names the field.
std::string pairing_problem(const WorkerCore& core, const v1::KvDestination& d) {
  return pairing_mismatch(core.model_fingerprint, core.engine->kv_layout(), d.model_fingerprint(),
                          layout_numbers_from_proto(d.layout()), d.layout().dtype());
}

// Why the handler cancelled the prefill, if it did.
enum class CancelCause { kNone, kClient, kTimeout };

// One Prefill call on gRPC's callback API, so that no thread waits for it: pair with the
// destination and connect, start the computation on the engine, then act on the engine's
// finished event (on the engine thread): name the failure, or reply with the first token once
// the KV transfer and its notice have ended (on the thread that ends the last of them). Its
// bounds are alarms (worker.prefill_timeout_ms, then kCancelGrace for the engine to confirm a
// cancel), not polls. The local blocks go back on every path, once no write reads them.
//
// Owned by itself (self_) until OnDone; the engine callback, the transfer callbacks and the
// alarms hold it by shared_ptr (the alarms by weak_ptr, so that its destructor cancels them).
class PrefillCall final : public grpc::ServerUnaryReactor,
                          public std::enable_shared_from_this<PrefillCall> {
 public:
  PrefillCall(WorkerCore& core, const v1::PrefillRequest& req, v1::PrefillResponse* out)
      : core_(core),
        req_(req),
        out_(out),
        id_(req.request_id()),
        tokens_(static_cast<int64_t>(req.prompt_tokens_size() + req.resume_tokens_size())),
        start_(Clock::now()) {}

  void adopt() { self_ = shared_from_this(); }

  // The handler's thread: the checks, the pairing, the submission and the deadline.
  void start() {
    guarded([&] {
      if (core_.role != WorkerRole::kPrefill) {
        finish(wrong_role(core_, "Prefill", "prefill"));
        return;
      }
      core_.calls_in_flight.fetch_add(1);
      core_.prefill_tokens.fetch_add(tokens_, std::memory_order_relaxed);
      counted_ = true;
      if (Status d = core_.refuse_if_draining("Prefill"); !d.ok()) {
        finish(d);
        return;
      }
      if (Status p = pair(); !p.ok()) {
        finish(p);
        return;
      }
      arm(deadline_alarm_, start_ + std::chrono::milliseconds(core_.config.worker.prefill_timeout_ms),
          [](PrefillCall& c) { c.cancel_compute(CancelCause::kTimeout); });
      if (Status st = start_compute(); !st.ok()) finish(st);
    });
  }

  void OnCancel() override {
    guarded([&] { cancel_compute(CancelCause::kClient); });
  }

  void OnDone() override {
    std::shared_ptr<PrefillCall> self = std::move(self_);  // may be the last reference
  }

 private:
  // Checks the destination (pairing), reaches the decode worker and makes the KV sender.
  Status pair() {
    if (!req_.has_destination()) {
      return InvalidArgument(fmt::format("request {}: Prefill needs a KV destination", id_));
    }
    const v1::KvDestination& pd = req_.destination();
    if (std::string m = pairing_problem(core_, pd); !m.empty()) {
      log::warn("worker {}: refused to pair with decode worker '{}': {}", core_.id,
                pd.worker_id(), m);
      return FailedPrecondition(
          fmt::format("prefill worker '{}' cannot write into decode worker '{}': {}", core_.id,
                      pd.worker_id(), m));
    }
    Result<KvDestination> dest = from_proto(pd);
    if (!dest.ok()) return dest.status().with_context(fmt::format("request {}", id_));
    address_ = dest->transfer_address;
    decode_worker_ = dest->worker_id;
    Result<uint64_t> peer = core_.peer_for(address_);
    if (!peer.ok()) {
      return peer.status().with_context(
          fmt::format("request {}: cannot reach decode worker '{}'", id_, decode_worker_));
    }
    auto sender = KvSender::create(*core_.transfer, *peer, core_.kv_region,
                                   core_.engine->kv_layout(), core_.model_fingerprint,
                                   std::move(*dest), tokens_);
    if (!sender.ok()) return sender.status().with_context(fmt::format("request {}", id_));
    kv_ = std::move(*sender);
    // The Decode is open already: the notice waits for the first token and carries it.
    if (req_.first_token_in_notice()) kv_->hold_notice();
    core_.add_sender(id_, kv_);  // RenewLease finds it there
    return Status::Ok();
  }

  // Submits the prompt to the engine, its KV exported through the sender. A kv_export request
  // has exactly one event, its finished one.
  Status start_compute() {
    EngineRequest r;
    r.id = id_;
    r.prompt.assign(req_.prompt_tokens().begin(), req_.prompt_tokens().end());
    r.params = req_.has_params() ? from_proto(req_.params()) : SamplingParams{};
    r.resume_tokens.assign(req_.resume_tokens().begin(), req_.resume_tokens().end());
    r.kv_export = kv_;
    auto self = shared_from_this();
    const Status st = core_.engine->submit(std::move(r), [self](const EngineEvent& ev) {
      if (ev.finished) self->guarded([&] { self->computed(ev); });
    });
    if (!st.ok()) return st;
    CancelCause pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      submitted_ = true;
      pending = std::exchange(pending_cancel_, CancelCause::kNone);
    }
    if (pending != CancelCause::kNone) cancel_compute(pending);  // the client left meanwhile
    return Status::Ok();
  }

  // Client gone or deadline passed: cancel the computation, and give the engine kCancelGrace
  // to confirm it.
  void cancel_compute(CancelCause cause) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!submitted_) {
        if (pending_cancel_ == CancelCause::kNone) pending_cancel_ = cause;
        return;
      }
      if (have_fin_ || ended_ || cause_ != CancelCause::kNone) return;
      cause_ = cause;
    }
    core_.engine->cancel(id_);
    arm(grace_alarm_, Clock::now() + kCancelGrace, [](PrefillCall& c) { c.grace_over(); });
  }

  void grace_over() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (have_fin_ || ended_) return;
      have_fin_ = true;  // a finished event coming later is ignored
    }
    log::error("worker {}: request {}: no end from the engine {} s after its cancellation",
               core_.id, id_, kCancelGrace.count());
    (void)core_.take_aborted(id_);
    free_local_then(Internal(fmt::format("request {}: the engine did not end the prefill", id_)));
  }

  // The engine's finished event (engine thread): the failure, or the first token and the wait
  // for the transfer.
  void computed(const EngineEvent& fin) {
    CancelCause cause;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (have_fin_ || ended_) return;
      have_fin_ = true;
      cause = cause_;
    }
    const bool aborted = core_.take_aborted(id_);
    if (Status f = compute_failure(fin, cause, aborted); !f.ok()) {
      free_local_then(f);
      return;
    }
    core_.metrics.time_to_first_token_seconds->observe(seconds_since(start_));
    v1::TokenEvent* first = out_->mutable_first();
    to_proto(fin, first);
    if (!fin.handoff) {  // the first token ended the request: nothing goes to the decode side
      core_.metrics.e2e_request_seconds->observe(seconds_since(start_));
      free_local_then(Status::Ok());
      return;
    }
    // Generation goes on at the decode worker: this is not the request's end. The usage stays:
    // the prefill's prompt and cached-prompt counts reach the caller.
    first->set_finished(false);
    first->clear_finish_reason();
    first->clear_stop_string();
    auto self = shared_from_this();
    kv_->finish_async([self](Status s) { self->guarded([&] { self->transferred(s); }); },
                      notice_value(fin.token));
  }

  // OK when the computation produced the first token; else why it did not.
  Status compute_failure(const EngineEvent& fin, CancelCause cause, bool aborted) {
    if (!fin.error.ok()) {
      // The engine ends a prefill whose writes failed with a generic Unavailable: name the cause.
      if (const Status why = kv_->failure(); !why.ok()) return transfer_failed(why.to_string());
      return fin.error;
    }
    if (fin.finish_reason != FinishReason::kCancelled || fin.has_token) return Status::Ok();
    switch (cause) {
      case CancelCause::kClient:
        return Cancelled(fmt::format("request {}: the client went away", id_));
      case CancelCause::kTimeout:
        return DeadlineExceeded(fmt::format(
            "request {}: the prefill did not finish within {} ms (worker.prefill_timeout_ms)", id_,
            core_.config.worker.prefill_timeout_ms));
      case CancelCause::kNone:
        break;
    }
    // Cancelled by an Abort, or else by the KV sink because a write failed.
    if (aborted) return Cancelled(fmt::format("request {} was aborted", id_));
    return transfer_failed("a KV write failed (the destination is unreachable or went away)");
  }

  // Every KV write and the notice have ended (the thread that ended the last of them).
  void transferred(const Status& fs) {
    (void)core_.engine->release_pinned(id_);
    if (!fs.ok()) {
      finish(transfer_failed(fs.message()));
      return;
    }
    core_.metrics.kv_handoffs_ok->inc();
    core_.metrics.kv_handoff_tail_seconds->observe(kv_->tail_seconds());
    core_.metrics.kv_transfer_seconds->observe(kv_->transfer_seconds());
    core_.metrics.kv_transfer_bytes->inc(static_cast<double>(kv_->bytes()));
    core_.metrics.e2e_request_seconds->observe(seconds_since(start_));
    out_->set_kv_tail_seconds(kv_->tail_seconds());
    out_->set_kv_transfer_seconds(kv_->transfer_seconds());
    out_->set_kv_bytes(kv_->bytes());
    finish(Status::Ok());
  }

  // The local blocks go back once no write reads them any more; then the call ends with `s`.
  void free_local_then(Status s) {
    if (!kv_) {
      finish(s);
      return;
    }
    auto self = shared_from_this();
    kv_->when_drained([self, s = std::move(s)] {
      self->guarded([&] {
        (void)self->core_.engine->release_pinned(self->id_);
        self->finish(s);
      });
    });
  }

  Status transfer_failed(std::string_view why) {
    core_.metrics.kv_handoffs_failed->inc();
    if (kv_ && kv_->lease_ended()) {
      // The decode worker is fine: this worker got to the prompt too late (a long queue).
      // RESOURCE_EXHAUSTED: try another worker or later (worker.proto).
      log::warn("worker {}: request {}: the lease on decode worker '{}' ended before its KV was "
                "written: {}", core_.id, id_, decode_worker_, why);
      return ResourceExhausted(fmt::format(
          "request {}: this prefill worker did not write the KV within the lease on decode "
          "worker '{}' (busy: reserve again, here or on another worker): {}",
          id_, decode_worker_, why));
    }
    log::warn("worker {}: request {}: KV transfer to decode worker '{}' failed: {}", core_.id, id_,
              decode_worker_, why);
    // ABORTED, not UNAVAILABLE: this worker is fine, its destination is not (worker.proto).
    return Aborted(fmt::format("request {}: the KV transfer to decode worker '{}' failed: {}", id_,
                               decode_worker_, why));
  }

  // Ends the call once (to_grpc, counted by count_rpc); the alarms are cancelled.
  void finish(const Status& s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ended_) return;
      ended_ = true;
    }
    deadline_alarm_.Cancel();
    grace_alarm_.Cancel();
    if (kv_) core_.remove_sender(id_, kv_.get());
    if (counted_) {
      core_.prefill_tokens.fetch_sub(tokens_, std::memory_order_relaxed);
      core_.calls_in_flight.fetch_sub(1);
    }
    Finish(count_rpc(core_, "Prefill", to_grpc(s)));
  }

  // The call's boundary: an exception that `body` lets out cancels the request in the engine
  // and ends the call with INTERNAL (its blocks freed once the writes have ended), instead of
  // reaching gRPC, the engine thread or a transfer thread.
  template <typename Body>
  void guarded(Body&& body) {
    std::string what;
    try {
      body();
      return;
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
      what = "an exception that is not a std::exception";
    }
    log::error("worker {}: Prefill of request {} failed: {}", core_.id, id_, what);
    core_.engine->cancel(id_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      have_fin_ = true;
    }
    Status s = Internal("Prefill failed: " + what);
    try {
      free_local_then(s);
    } catch (...) {
      finish(s);
    }
  }

  // Sets `alarm` to call `fn` at `when` unless the call is gone by then.
  void arm(grpc::Alarm& alarm, Clock::time_point when, void (*fn)(PrefillCall&)) {
    std::weak_ptr<PrefillCall> weak = weak_from_this();
    const auto system_when = std::chrono::system_clock::now() +
                             std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                 when - Clock::now());
    alarm.Set(system_when, [weak, fn](bool fired) {
      if (!fired) return;  // cancelled
      if (auto c = weak.lock()) c->guarded([&] { fn(*c); });
    });
  }

  WorkerCore& core_;
  const v1::PrefillRequest& req_;  // gRPC's, valid until OnDone
  v1::PrefillResponse* const out_;
  const RequestId id_;
  const int64_t tokens_;  // prompt + resume tokens, in core_.prefill_tokens while counted_
  const Clock::time_point start_;
  std::string address_;        // the decode worker's transfer address
  std::string decode_worker_;  // its id
  std::shared_ptr<KvSender> kv_;
  std::shared_ptr<PrefillCall> self_;
  grpc::Alarm deadline_alarm_;
  grpc::Alarm grace_alarm_;
  bool counted_ = false;  // in calls_in_flight

  std::mutex mu_;
  bool submitted_ = false;  // the engine has the request
  bool have_fin_ = false;   // its finished event came (or the grace ended, or it failed)
  bool ended_ = false;      // Finish was called
  CancelCause cause_ = CancelCause::kNone;
  CancelCause pending_cancel_ = CancelCause::kNone;  // asked for before the submission
};

}  // namespace

grpc::ServerUnaryReactor* WorkerRpcs::Prefill(grpc::CallbackServerContext*,
                                              const v1::PrefillRequest* req,
                                              v1::PrefillResponse* out) {
  auto call = std::make_shared<PrefillCall>(core_, *req, out);
  call->adopt();
  call->start();
  return call.get();
}

}  // namespace cleave::worker_service
