// The RPC stages of one request attempt on gRPC's callback API: Reserve -> Prefill -> Decode
// (disaggregated) or Generate (unified), and the best-effort Abort / Release clean-ups.
#include <algorithm>
#include <chrono>

#include "cleave/common/log.h"
#include "cleave/control/proto_convert.h"
#include "dispatch/dispatch_call.h"
#include "fmt/format.h"

namespace cleave::router {

namespace {

using Clock = std::chrono::steady_clock;

// One unary RPC: its context, request and response live together until its callback has run.
// The op also holds its worker's endpoint and the dispatcher's core, and lets them go after its
// context, in that order (members are destroyed in reverse). The context holds the worker's
// channel, and the op's last reference may go on a gRPC callback thread, maybe after the
// dispatcher has shut down: while the core lives its pools hold the channel, so the op never
// drops the last one there (worker_pools.h says why that must not happen), and a core dropped
// there last is deleted on a thread of its own (dispatcher_impl.cpp).
template <typename Request, typename Response>
struct UnaryOp {
  std::shared_ptr<DispatchCore> core;
  std::shared_ptr<WorkerEndpoint> worker;
  grpc::ClientContext ctx;
  Request request;
  Response response;
};

template <typename Request, typename Response>
std::shared_ptr<UnaryOp<Request, Response>> unary_op(std::shared_ptr<DispatchCore> core,
                                                     std::shared_ptr<WorkerEndpoint> worker,
                                                     std::chrono::milliseconds timeout) {
  auto op = std::make_shared<UnaryOp<Request, Response>>();
  op->core = std::move(core);
  op->worker = std::move(worker);
  op->ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  return op;
}

// The op's context, sharing the op's ownership.
template <typename Op>
std::shared_ptr<grpc::ClientContext> context_of(const std::shared_ptr<Op>& op) {
  return std::shared_ptr<grpc::ClientContext>(op, &op->ctx);
}

Status rpc_error(const WorkerEndpoint& worker, const char* rpc, const grpc::Status& s) {
  return from_grpc(s).with_context(fmt::format("worker {}: {}", worker.address, rpc));
}

}  // namespace

// A Decode or Generate token stream. Deletes itself when the call is done.
class TokenStream final : public grpc::ClientReadReactor<v1::TokenEvent> {
 public:
  TokenStream(std::shared_ptr<DispatchCall> c, std::shared_ptr<WorkerEndpoint> w, const char* r,
              uint64_t request_id, int attempt_no)
      : call(std::move(c)), worker(std::move(w)), rpc(r), id(request_id), attempt(attempt_no) {}

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream is over; OnDone follows
    if (finished_seen) {
      log::warn("dispatch: worker {}: {}: an event came after the finished event of request {}",
                worker->address, rpc, id);
    } else {
      finished_seen = event.finished();
      call->on_stream_event(*this, event);
    }
    StartRead(&event);
  }

  void OnDone(const grpc::Status& s) override {
    call->on_stream_done(*this, s, finished_seen);
    delete this;
  }

  const std::shared_ptr<DispatchCall> call;
  const std::shared_ptr<WorkerEndpoint> worker;
  const char* const rpc;
  const uint64_t id;
  const int attempt;  // of the DispatchCall
  bool early = false;  // an early Decode (gated until the Prefill's first token went out)
  // Shared: cancel() and the watchdog may still hold it for TryCancel after the stream is gone.
  const std::shared_ptr<grpc::ClientContext> ctx = std::make_shared<grpc::ClientContext>();
  v1::DecodeRequest decode_request;
  v1::GenerateRequest generate_request;
  v1::TokenEvent event;  // reused for every event of the stream
  bool finished_seen = false;
};

void DispatchCall::start_reserve() {
  const auto& t = core_->options.timeouts;
  auto op = unary_op<v1::ReserveRequest, v1::KvDestination>(core_, workers_.decode, t.reserve);
  op->request.set_request_id(id_);
  // A migration's prefill writes the KV of its resume tokens too.
  op->request.set_num_prompt_tokens(static_cast<int64_t>(prompt_.size() + resume_.size()));
  op->request.set_lease_ms(core_->options.lease.count());
  // The decode worker takes the KV's notice only from the prefill worker chosen here.
  op->request.set_expected_writer_engine(
      workers_.prefill->transfer_engine_id.load(std::memory_order_relaxed));
  if (!arm(context_of(op), Stage::kReserve, std::chrono::milliseconds{0})) {
    end();
    return;
  }
  auto self = shared_from_this();
  workers_.decode->stub->async()->Reserve(
      &op->ctx, &op->request, &op->response, [self, op](grpc::Status s) {
        (void)self->disarm();
        const auto& decode = self->workers_.decode;
        if (self->cancelled()) {
          // The reservation may exist: Abort gives its blocks back.
          self->abort_on(decode, op->request.request_id());
          self->end();
          return;
        }
        if (!s.ok()) {
          if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
              self->core_->pools.fits_whole_pool(decode, op->request.num_prompt_tokens())) {
            // Its blocks are only held for now: wait for them rather than fail (dispatch_call.h).
            self->wait_for_decode_room(rpc_error(*decode, "Reserve", s));
            return;
          }
          self->attempt_failed(decode, rpc_error(*decode, "Reserve", s));
          return;
        }
        if (self->core_->options.early_decode) {
          self->start_decode(-1);  // opens now; its first token comes in the notice
          self->start_prefill(std::move(op->response), true);
        } else {
          self->start_prefill(std::move(op->response), false);
        }
      });
}

void DispatchCall::start_prefill(v1::KvDestination destination, bool early) {
  const auto& t = core_->options.timeouts;
  // What the wait for room on a prefill worker left of the deadline.
  auto op = unary_op<v1::PrefillRequest, v1::PrefillResponse>(
      core_, workers_.prefill,
      std::max(t.prefill - queue_waited_, std::chrono::milliseconds(1)));
  op->request.set_request_id(id_);
  op->request.mutable_prompt_tokens()->Assign(prompt_.begin(), prompt_.end());
  set_resume(op->request.mutable_resume_tokens());
  *op->request.mutable_params() = params_;
  *op->request.mutable_destination() = std::move(destination);
  op->request.set_first_token_in_notice(early);
  const std::chrono::milliseconds lease(op->request.destination().lease_ms());
  if (!arm(context_of(op), Stage::kPrefill, std::chrono::milliseconds{0})) {
    drop_early_stream();
    release_on(workers_.decode, id_);
    end();
    return;
  }
  if (lease >= 6 * core_->watch_period) {
    // Renewed while the Prefill waits in its worker's queue or runs (renew_lease_if_due).
    std::lock_guard<std::mutex> lock(mu_);
    lease_ = lease;
    renew_at_ns_.store(steady_ns(Clock::now() + lease / 3), std::memory_order_relaxed);
  }
  auto self = shared_from_this();
  workers_.prefill->stub->async()->Prefill(
      &op->ctx, &op->request, &op->response, [self, op, early](grpc::Status s) {
        (void)self->disarm();
        const auto& prefill = self->workers_.prefill;
        const auto& decode = self->workers_.decode;
        const uint64_t id = op->request.request_id();
        self->unhold(prefill);
        if (self->cancelled()) {
          self->drop_early_stream();
          self->abort_on(prefill, id);
          self->abort_on(decode, id);
          self->end();
          return;
        }
        if (!s.ok()) {
          self->drop_early_stream();
          // A prefill that outlived our deadline may still be running there.
          if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) self->abort_on(prefill, id);
          self->release_on(decode, id);
          if (s.error_code() == grpc::StatusCode::ABORTED) {
            // The prefill's transfer to the decode worker failed: this request retries without
            // that decode worker, and the pair is avoided for a while. The decode worker stays
            // in its pool: the path between the two may be what failed (a partition), and a
            // dead decode worker fails its probe and Reserve by itself.
            Status e = rpc_error(*prefill, "Prefill", s);
            self->core_->pools.mark_pair_failed(prefill, decode, e);
            self->retry_without(decode, Status(StatusCode::kUnavailable, e.message()));
            return;
          }
          self->attempt_failed(prefill, rpc_error(*prefill, "Prefill", s));
          return;
        }
        v1::PrefillResponse& r = op->response;
        if (self->core_->kv_transfer_bytes) {
          self->core_->kv_transfer_bytes->inc(static_cast<double>(r.kv_bytes()));
        }
        if (self->core_->kv_handoff_tail_seconds && r.kv_bytes() > 0) {
          self->core_->kv_handoff_tail_seconds->observe(r.kv_tail_seconds());
        }
        if (self->core_->kv_transfer_seconds && r.kv_bytes() > 0) {
          self->core_->kv_transfer_seconds->observe(r.kv_transfer_seconds());
        }
        v1::TokenEvent& first = *r.mutable_first();
        if (!self->started_.load(std::memory_order_acquire)) {
          self->cached_prompt_tokens_ = first.usage().cached_prompt_tokens();
          self->deliver_prefilled(PrefillFigures{.kv_bytes = r.kv_bytes(),
                                                 .kv_tail_seconds = r.kv_tail_seconds(),
                                                 .kv_transfer_seconds = r.kv_transfer_seconds()});
        } else if (first.finished() && first.has_usage()) {
          // A migration's prefill is not news to the observer; the usage keeps the request's
          // own prefill's cache hits.
          first.mutable_usage()->set_cached_prompt_tokens(self->cached_prompt_tokens_);
        }
        const bool delivered = self->deliver(first);
        if (first.finished()) {
          // Nothing was written for the decode side: its blocks go back at once.
          self->drop_early_stream();
          self->release_on(decode, id);
          self->end();
          return;
        }
        if (!delivered) {  // cancelled meanwhile
          self->drop_early_stream();
          self->abort_on(decode, id);
          self->end();
          return;
        }
        if (early) {
          self->open_gate();
        } else {
          self->start_decode(first.token());
        }
      });
}

void DispatchCall::renew_lease_if_due(Clock::time_point now) {
  const int64_t at = renew_at_ns_.load(std::memory_order_relaxed);
  const int64_t now_ns = steady_ns(now);
  if (at == 0 || now_ns < at) return;
  std::shared_ptr<WorkerEndpoint> decode;
  uint64_t id = 0;
  std::chrono::milliseconds lease{0};
  int attempt = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (renew_at_ns_.load(std::memory_order_relaxed) != at) return;
    if (stage_ != Stage::kPrefill || ended_ || cancelled() || lease_.count() <= 0) {
      renew_at_ns_.store(0, std::memory_order_relaxed);
      return;
    }
    renew_at_ns_.store(now_ns + std::chrono::duration_cast<std::chrono::nanoseconds>(lease_ / 3)
                                    .count(),
                       std::memory_order_relaxed);
    decode = workers_.decode;
    id = id_;
    lease = lease_;
    attempt = attempt_.load();
  }
  // The decode worker first: the prefill's bound must never pass the decode worker's.
  auto self = shared_from_this();
  send_renewal(decode, id, lease, lease, "no such reservation (used, released or expired)",
               [self, now, attempt](bool renewed) {
                 if (renewed) {
                   self->renew_on_prefill(now, attempt);
                 } else {
                   self->renewal_done(false);
                 }
               });
}

std::chrono::milliseconds DispatchCall::renewal_deadline(std::chrono::milliseconds lease) const {
  // A round's RPC is over (answered or DEADLINE_EXCEEDED) by the time a round after next is due,
  // so at most two rounds are ever in flight, and one that hangs never holds up the next.
  return std::max(std::chrono::milliseconds(1),
                  std::min(core_->options.timeouts.cleanup, lease / 3));
}

void DispatchCall::send_renewal(const std::shared_ptr<WorkerEndpoint>& worker, uint64_t id,
                                std::chrono::milliseconds lease,
                                std::chrono::milliseconds full_lease, const char* not_found,
                                std::function<void(bool)> then) {
  auto op = unary_op<v1::RenewLeaseRequest, v1::RenewLeaseResponse>(core_, worker,
                                                                    renewal_deadline(full_lease));
  op->request.set_request_id(id);
  op->request.set_lease_ms(lease.count());
  worker->stub->async()->RenewLease(
      &op->ctx, &op->request, &op->response,
      [op, not_found, then = std::move(then)](grpc::Status s) {
        const bool renewed = s.ok() && op->response.renewed();
        if (!renewed) {
          log::info("dispatch: worker {}: RenewLease of request {}: {}", op->worker->address,
                    op->request.request_id(), s.ok() ? not_found : s.error_message());
        }
        then(renewed);
      });
}

void DispatchCall::renew_on_prefill(Clock::time_point asked, int attempt) {
  std::shared_ptr<WorkerEndpoint> prefill;
  uint64_t id = 0;
  std::chrono::milliseconds left{0}, full{0};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stage_ != Stage::kPrefill || attempt_.load() != attempt || ended_) {
      return;  // the Prefill has answered meanwhile: nothing is left to renew there
    }
    prefill = workers_.prefill;
    id = id_;
    // The decode worker's lease began at most this long ago.
    full = lease_;
    left = lease_ - std::chrono::ceil<std::chrono::milliseconds>(Clock::now() - asked);
  }
  if (left.count() < 1) {
    renewal_done(false);
    return;
  }
  auto self = shared_from_this();
  send_renewal(prefill, id, left, full, "no such prefill (ended, or its writes stopped)",
               [self](bool renewed) { self->renewal_done(renewed); });
}

void DispatchCall::renewal_done(bool renewed) {
  metrics::Counter* c = renewed ? core_->lease_renewed : core_->lease_renewal_lost;
  if (c) c->inc();
}

void DispatchCall::start_decode(int32_t first_token) {
  const auto& t = core_->options.timeouts;
  auto* s = new TokenStream(shared_from_this(), workers_.decode, "Decode", id_, attempt_);
  s->decode_request.set_request_id(id_);
  s->decode_request.mutable_prompt_tokens()->Assign(prompt_.begin(), prompt_.end());
  set_resume(s->decode_request.mutable_resume_tokens());
  *s->decode_request.mutable_params() = params_;
  if (first_token < 0) {
    // Early: not the RPC in flight yet (the Prefill is); open_gate() arms it.
    s->decode_request.set_first_token_from_notice(true);
    s->early = true;
    {
      std::lock_guard<std::mutex> lock(mu_);
      early_ctx_ = s->ctx;
      early_attempt_ = attempt_.load();
      gated_events_.clear();
      gated_end_.reset();
      gate_closed_.store(true, std::memory_order_release);
    }
  } else {
    s->decode_request.set_first_token(first_token);
    if (!arm(s->ctx, Stage::kDecode, t.stream_idle)) {
      abort_on(workers_.decode, id_);
      delete s;
      end();
      return;
    }
  }
  workers_.decode->stub->async()->Decode(s->ctx.get(), &s->decode_request, s);
  s->StartRead(&s->event);
  s->StartCall();
}

void DispatchCall::start_generate() {
  const auto& t = core_->options.timeouts;
  auto* s = new TokenStream(shared_from_this(), workers_.unified, "Generate", id_, attempt_);
  s->generate_request.set_request_id(id_);
  s->generate_request.mutable_prompt_tokens()->Assign(prompt_.begin(), prompt_.end());
  set_resume(s->generate_request.mutable_resume_tokens());
  *s->generate_request.mutable_params() = params_;
  if (!arm(s->ctx, Stage::kGenerate, t.first_token)) {
    delete s;
    end();
    return;
  }
  workers_.unified->stub->async()->Generate(s->ctx.get(), &s->generate_request, s);
  s->StartRead(&s->event);
  s->StartCall();
}

void DispatchCall::open_gate() {
  std::shared_ptr<grpc::ClientContext> ctx;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ctx = early_ctx_;
  }
  if (!ctx || !arm(ctx, Stage::kDecode, core_->options.timeouts.stream_idle)) {
    drop_early_stream();
    abort_on(workers_.decode, id_);
    end();
    return;
  }
  // Held-back events go out in order; events that come meanwhile join the queue, so the gate
  // opens only once it is empty (the stream's own thread then delivers directly).
  std::vector<v1::TokenEvent> batch;
  std::optional<GatedEnd> done;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      batch.swap(gated_events_);
      if (batch.empty()) {
        done = std::move(gated_end_);
        gated_end_.reset();
        gate_closed_.store(false, std::memory_order_release);
        break;
      }
    }
    for (v1::TokenEvent& ev : batch) deliver_streamed(PoolRole::kDecode, ev);
    batch.clear();
  }
  if (done) stream_ended(done->worker, "Decode", done->id, done->status, done->finished_seen);
}

void DispatchCall::drop_early_stream() {
  std::shared_ptr<grpc::ClientContext> ctx;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ctx = std::move(early_ctx_);
    early_ctx_.reset();
    gated_events_.clear();
    gated_end_.reset();
    // Its events and its end, when they come, are ignored: early_attempt_ names no live stream.
    early_attempt_.store(0, std::memory_order_release);
    gate_closed_.store(false, std::memory_order_release);
  }
  if (ctx) ctx->TryCancel();
}

void DispatchCall::on_stream_event(TokenStream& stream, v1::TokenEvent& event) {
  if (stream.attempt != attempt_.load(std::memory_order_acquire)) return;  // an earlier attempt's
  if (stream.early) {
    if (stream.attempt != early_attempt_.load(std::memory_order_acquire)) return;  // dropped
    if (gate_closed_.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> lock(mu_);
      if (gate_closed_.load(std::memory_order_relaxed)) {
        gated_events_.push_back(event);
        return;
      }
    }
  }
  deliver_streamed(stream.worker->role, event);
}

void DispatchCall::deliver_streamed(PoolRole role, v1::TokenEvent& event) {
  // Every event moves the idle deadline (unless the watchdog has already fired).
  const int64_t next = steady_ns(Clock::now() + core_->options.timeouts.stream_idle);
  int64_t cur = watch_deadline_ns_.load(std::memory_order_relaxed);
  while (cur != 0 &&
         !watch_deadline_ns_.compare_exchange_weak(cur, next, std::memory_order_relaxed)) {
  }
  attempt_streamed_.store(true, std::memory_order_relaxed);
  if (role == PoolRole::kDecode && event.finished() && event.has_usage()) {
    // The usage of the whole request: the prompt tokens the prefill found in its cache.
    event.mutable_usage()->set_cached_prompt_tokens(cached_prompt_tokens_);
  }
  (void)deliver(event);
}

void DispatchCall::on_stream_done(TokenStream& stream, const grpc::Status& status,
                                  bool finished_seen) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const bool early = stream.early;
    if (early && (stream.attempt != early_attempt_.load() || ended_)) {
      return;  // dropped (the Prefill failed or ended the request) or of an earlier attempt
    }
    if (early && gate_closed_.load(std::memory_order_relaxed)) {
      // The first token has not gone out yet: its end waits for it.
      gated_end_ = GatedEnd{stream.worker, stream.id, status, finished_seen};
      return;
    }
  }
  stream_ended(stream.worker, stream.rpc, stream.id, status, finished_seen);
}

void DispatchCall::stream_ended(const std::shared_ptr<WorkerEndpoint>& worker, const char* rpc,
                                uint64_t id, const grpc::Status& status, bool finished_seen) {
  const std::string timeout = disarm();
  unhold(worker);
  if (cancelled()) {
    abort_on(worker, id);
    end();
    return;
  }
  if (finished_seen) {
    if (!status.ok()) {
      log::debug("dispatch: worker {}: {}: request {} ended {} after its finished event",
                 worker->address, rpc, id, status.error_message());
    }
    end();
    return;
  }
  Status error = !timeout.empty() ? DeadlineExceeded(timeout)
                 : status.ok()    ? Internal(fmt::format("worker {}: {}: the stream ended "
                                                         "without a finished event",
                                                         worker->address, rpc))
                                  : rpc_error(*worker, rpc, status);
  // The worker may still be running it (a timeout, a broken stream): make sure it stops.
  abort_on(worker, id);
  // Before the first token: a retry; after it: a migration from the tokens delivered so far.
  attempt_failed(worker, std::move(error));
}

void DispatchCall::abort_on(const std::shared_ptr<WorkerEndpoint>& worker, uint64_t id) {
  // The callback outlives its request, and maybe the dispatcher: the op holds what it needs.
  auto op = unary_op<v1::AbortRequest, v1::AbortResponse>(core_, worker,
                                                          core_->options.timeouts.cleanup);
  op->request.set_request_id(id);
  worker->stub->async()->Abort(&op->ctx, &op->request, &op->response, [op](grpc::Status s) {
    if (!s.ok()) {
      log::debug("dispatch: worker {}: Abort of request {}: {}", op->worker->address,
                 op->request.request_id(), s.error_message());
    }
  });
}

void DispatchCall::release_on(const std::shared_ptr<WorkerEndpoint>& worker, uint64_t id) {
  auto op = unary_op<v1::ReleaseRequest, v1::ReleaseResponse>(core_, worker,
                                                              core_->options.timeouts.cleanup);
  op->request.set_request_id(id);
  worker->stub->async()->Release(&op->ctx, &op->request, &op->response, [op](grpc::Status s) {
    if (!s.ok()) {
      log::debug("dispatch: worker {}: Release of request {}: {}", op->worker->address,
                 op->request.request_id(), s.error_message());
    }
  });
}

}  // namespace cleave::router
