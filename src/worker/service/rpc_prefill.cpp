// Prefill workers: Prefill computes the prompt, streams each layer's KV into the decode worker's
// reservation as it is computed (KvSender), sends the notice after the data and answers with
// the first token. Every wait is bounded; on any failure the local blocks are freed.
#include "cleave/common/log.h"
#include "cleave/worker/kv_export.h"
#include "cleave/worker/proto_convert.h"
#include "fmt/format.h"
#include "request_events.h"
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

// How the engine's computation of the prompt ended, as the handler saw it.
struct ComputeEnd {
  bool have_fin = false;  // false: no finished event came, even after the cancel grace
  EngineEvent fin;        // the finished event, when have_fin
  CancelCause cause = CancelCause::kNone;
  bool aborted = false;  // an Abort marked the request (Prefill clears the mark)
};

// One Prefill call in its steps: pair with the destination and connect, start the computation
// on the engine, wait for it, then either name its failure or reply with the first token and
// wait for the KV transfer and its notice. The local blocks go back on every path that ends
// the request here.
class PrefillCall {
 public:
  PrefillCall(WorkerCore& core, RequestId id)
      : core_(core),
        id_(id),
        start_(Clock::now()),
        transfer_bound_(2 * core.config.transfer.completion_timeout_ms + 1000) {}

  // Checks the destination (pairing), reaches the decode worker and makes the KV sender.
  Status pair(const v1::PrefillRequest& req) {
    if (!req.has_destination()) {
      return InvalidArgument(fmt::format("request {}: Prefill needs a KV destination", id_));
    }
    const v1::KvDestination& pd = req.destination();
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
                                   std::move(*dest),
                                   static_cast<int64_t>(req.prompt_tokens_size() +
                                                        req.resume_tokens_size()));
    if (!sender.ok()) return sender.status().with_context(fmt::format("request {}", id_));
    kv_ = std::move(*sender);
    return Status::Ok();
  }

  // Submits the prompt to the engine, its KV exported through the sender.
  Status start_compute(const v1::PrefillRequest& req) {
    EngineRequest r;
    r.id = id_;
    r.prompt.assign(req.prompt_tokens().begin(), req.prompt_tokens().end());
    r.params = req.has_params() ? from_proto(req.params()) : SamplingParams{};
    r.resume_tokens.assign(req.resume_tokens().begin(), req.resume_tokens().end());
    r.kv_export = kv_;
    events_ = std::make_shared<RequestEvents>();
    return core_.engine->submit(std::move(r), RequestEvents::callback(events_));
  }

  // Waits for the finished event (a kv_export request has exactly one event), cancelling the
  // request when the client goes or worker.prefill_timeout_ms passes.
  ComputeEnd wait_compute(grpc::ServerContext& ctx) {
    const auto deadline =
        start_ + std::chrono::milliseconds(core_.config.worker.prefill_timeout_ms);
    ComputeEnd end;
    Clock::time_point cancelled_at;
    std::vector<EngineEvent> batch;
    while (!end.have_fin) {
      events_->take(batch, kCancelPoll);
      for (EngineEvent& ev : batch) {
        if (ev.finished) {
          end.fin = std::move(ev);
          end.have_fin = true;
          break;
        }
      }
      if (end.have_fin) break;
      if (end.cause == CancelCause::kNone) {
        if (ctx.IsCancelled()) end.cause = CancelCause::kClient;
        else if (Clock::now() >= deadline) end.cause = CancelCause::kTimeout;
        if (end.cause != CancelCause::kNone) {
          cancelled_at = Clock::now();
          core_.engine->cancel(id_);
        }
      } else if (Clock::now() - cancelled_at > kCancelGrace) {
        log::error("worker {}: request {}: no end from the engine {} s after its cancellation",
                   core_.id, id_, kCancelGrace.count());
        break;
      }
    }
    end.aborted = core_.take_aborted(id_);
    return end;
  }

  // OK when the computation produced the first token; else frees the local blocks and says
  // why it did not.
  Status compute_failure(const ComputeEnd& end) {
    if (!end.have_fin) {
      free_local();
      return Internal(fmt::format("request {}: the engine did not end the prefill", id_));
    }
    const EngineEvent& fin = end.fin;
    if (!fin.error.ok()) {
      free_local();
      // The engine ends a prefill whose writes failed with a generic Unavailable: name the cause.
      if (const Status why = kv_->failure(); !why.ok()) return transfer_failed(why.to_string());
      return fin.error;
    }
    if (fin.finish_reason != FinishReason::kCancelled || fin.has_token) return Status::Ok();
    free_local();
    switch (end.cause) {
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
    if (end.aborted) return Cancelled(fmt::format("request {} was aborted", id_));
    return transfer_failed("a KV write failed (the destination is unreachable or went away)");
  }

  // Fills the reply's first token. A request that ended with it is done here (the caller
  // releases the reservation); true when generation goes on at the decode worker.
  bool reply_first_token(const EngineEvent& fin, v1::PrefillResponse* out) {
    core_.metrics.time_to_first_token_seconds->observe(seconds_since(start_));
    v1::TokenEvent* first = out->mutable_first();
    to_proto(fin, first);
    if (!fin.handoff) {
      free_local();
      core_.metrics.e2e_request_seconds->observe(seconds_since(start_));
      return false;
    }
    // Generation goes on at the decode worker: this is not the request's end.
    first->set_finished(false);
    first->clear_finish_reason();
    first->clear_stop_string();
    // The usage stays: the prefill's prompt and cached-prompt counts reach the caller.
    return true;
  }

  // Waits for every KV write and the notice after them, then frees the local blocks and
  // reports the transfer in the metrics and the reply.
  Status wait_transfer(v1::PrefillResponse* out) {
    const Status fs = kv_->finish(transfer_bound_);
    if (!fs.ok()) {
      free_local();
      return transfer_failed(fs.message());
    }
    (void)core_.engine->release_pinned(id_);
    core_.metrics.kv_handoffs_ok->inc();
    core_.metrics.kv_handoff_tail_seconds->observe(kv_->tail_seconds());
    core_.metrics.kv_transfer_seconds->observe(kv_->transfer_seconds());
    core_.metrics.kv_transfer_bytes->inc(static_cast<double>(kv_->bytes()));
    core_.metrics.e2e_request_seconds->observe(seconds_since(start_));
    out->set_kv_tail_seconds(kv_->tail_seconds());
    out->set_kv_transfer_seconds(kv_->transfer_seconds());
    out->set_kv_bytes(kv_->bytes());
    return Status::Ok();
  }

 private:
  // The local blocks go back only once no write reads them any more.
  void free_local() {
    if (!kv_->drain(transfer_bound_)) {
      log::error("worker {}: request {}: KV writes still in flight after {} ms; freeing the "
                 "blocks anyway",
                 core_.id, id_, transfer_bound_.count());
    }
    (void)core_.engine->release_pinned(id_);
  }

  Status transfer_failed(std::string_view why) {
    core_.forget_peer(address_);
    core_.metrics.kv_handoffs_failed->inc();
    log::warn("worker {}: request {}: KV transfer to decode worker '{}' failed: {}", core_.id, id_,
              decode_worker_, why);
    // ABORTED, not UNAVAILABLE: this worker is fine, its destination is not (worker.proto).
    return Aborted(fmt::format("request {}: the KV transfer to decode worker '{}' failed: {}", id_,
                               decode_worker_, why));
  }

  WorkerCore& core_;
  const RequestId id_;
  const Clock::time_point start_;
  const std::chrono::milliseconds transfer_bound_;  // for the writes and the notice to end
  std::string address_;        // the decode worker's transfer address
  std::string decode_worker_;  // its id
  std::shared_ptr<KvSender> kv_;
  std::shared_ptr<RequestEvents> events_;
};

}  // namespace

grpc::Status WorkerRpcs::Prefill(grpc::ServerContext* ctx, const v1::PrefillRequest* req,
                                 v1::PrefillResponse* out) {
  return guarded("Prefill", [&]() -> Status {
    if (core_.role != WorkerRole::kPrefill) return wrong_role(core_, "Prefill", "prefill");
    CallInFlight counted(core_);
    if (Status d = core_.refuse_if_draining("Prefill"); !d.ok()) return d;
    return prefill(ctx, *req, out);
  });
}

Status WorkerRpcs::prefill(grpc::ServerContext* ctx, const v1::PrefillRequest& req,
                           v1::PrefillResponse* out) {
  PrefillCall call(core_, req.request_id());
  CLEAVE_RETURN_IF_ERROR(call.pair(req));
  CLEAVE_RETURN_IF_ERROR(call.start_compute(req));
  const ComputeEnd end = call.wait_compute(*ctx);
  CLEAVE_RETURN_IF_ERROR(call.compute_failure(end));
  if (!call.reply_first_token(end.fin, out)) return Status::Ok();
  return call.wait_transfer(out);
}

}  // namespace cleave::worker_service
