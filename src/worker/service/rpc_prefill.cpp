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
  const v1::KvLayoutInfo& l = d.layout();
  KvLayout remote;
  remote.version = l.version();
  remote.block_size = l.block_size();
  remote.n_layers = l.n_layers();
  remote.n_kv_heads = l.n_kv_heads();
  remote.head_dim = l.head_dim();
  remote.num_blocks = l.num_blocks();
  return pairing_mismatch(core.model_fingerprint, core.engine->kv_layout(), d.model_fingerprint(),
                          remote, l.dtype());
}

}  // namespace

grpc::Status WorkerRpcs::Prefill(grpc::ServerContext* ctx, const v1::PrefillRequest* req,
                                 v1::PrefillResponse* out) {
  if (core_.role != WorkerRole::kPrefill) return done("Prefill", wrong_role(core_, "Prefill", "prefill"));
  CallInFlight counted(core_);
  if (Status d = core_.refuse_if_draining("Prefill"); !d.ok()) return done("Prefill", d);
  return done("Prefill", prefill(ctx, *req, out));
}

Status WorkerRpcs::prefill(grpc::ServerContext* ctx, const v1::PrefillRequest& req,
                           v1::PrefillResponse* out) {
  const auto start = Clock::now();
  const RequestId id = req.request_id();
  if (!req.has_destination()) {
    return InvalidArgument(fmt::format("request {}: Prefill needs a KV destination", id));
  }
  const v1::KvDestination& pd = req.destination();
  if (std::string m = pairing_problem(core_, pd); !m.empty()) {
    log::warn("worker {}: refused to pair with decode worker '{}': {}", core_.id, pd.worker_id(), m);
    return FailedPrecondition(
        fmt::format("prefill worker '{}' cannot write into decode worker '{}': {}", core_.id,
                    pd.worker_id(), m));
  }
  Result<KvDestination> dest = from_proto(pd);
  if (!dest.ok()) return dest.status().with_context(fmt::format("request {}", id));
  const std::string address = dest->transfer_address;
  const std::string decode_worker = dest->worker_id;
  Result<uint64_t> peer = core_.peer_for(address);
  if (!peer.ok()) {
    return peer.status().with_context(
        fmt::format("request {}: cannot reach decode worker '{}'", id, decode_worker));
  }
  std::vector<int32_t> prompt(req.prompt_tokens().begin(), req.prompt_tokens().end());
  auto sender = KvSender::create(*core_.transfer, *peer, core_.kv_region, core_.engine->kv_layout(),
                                 core_.model_fingerprint, std::move(*dest),
                                 static_cast<int64_t>(prompt.size()));
  if (!sender.ok()) return sender.status().with_context(fmt::format("request {}", id));
  std::shared_ptr<KvSender> kv = std::move(*sender);

  EngineRequest r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.params = req.has_params() ? from_proto(req.params()) : SamplingParams{};
  r.kv_export = kv;
  auto events = std::make_shared<RequestEvents>();
  const Status submitted = core_.engine->submit(std::move(r), RequestEvents::callback(events));
  if (!submitted.ok()) return submitted;

  // Wait for the finished event (a kv_export request has exactly one event).
  const auto compute_deadline =
      start + std::chrono::milliseconds(core_.config.worker.prefill_timeout_ms);
  enum class CancelCause { kNone, kClient, kTimeout } cause = CancelCause::kNone;
  Clock::time_point cancelled_at;
  std::vector<EngineEvent> batch;
  EngineEvent fin;
  bool have_fin = false;
  while (!have_fin) {
    events->take(batch, kCancelPoll);
    for (EngineEvent& ev : batch) {
      if (ev.finished) {
        fin = std::move(ev);
        have_fin = true;
        break;
      }
    }
    if (have_fin) break;
    if (cause == CancelCause::kNone) {
      if (ctx->IsCancelled()) cause = CancelCause::kClient;
      else if (Clock::now() >= compute_deadline) cause = CancelCause::kTimeout;
      if (cause != CancelCause::kNone) {
        cancelled_at = Clock::now();
        core_.engine->cancel(id);
      }
    } else if (Clock::now() - cancelled_at > kCancelGrace) {
      log::error("worker {}: request {}: no end from the engine {} s after its cancellation",
                 core_.id, id, kCancelGrace.count());
      break;
    }
  }

  const bool aborted = core_.take_aborted(id);
  const std::chrono::milliseconds transfer_bound(2 * core_.config.transfer.completion_timeout_ms +
                                                 1000);
  // The local blocks go back only once no write reads them any more.
  auto free_local = [&] {
    if (!kv->drain(transfer_bound)) {
      log::error("worker {}: request {}: KV writes still in flight after {} ms; freeing the "
                 "blocks anyway",
                 core_.id, id, transfer_bound.count());
    }
    (void)core_.engine->release_pinned(id);
  };
  auto transfer_failed = [&](std::string_view why) {
    core_.forget_peer(address);
    core_.metrics.kv_handoffs_failed->inc();
    log::warn("worker {}: request {}: KV transfer to decode worker '{}' failed: {}", core_.id, id,
              decode_worker, why);
    // ABORTED, not UNAVAILABLE: this worker is fine, its destination is not (worker.proto).
    return Aborted(fmt::format("request {}: the KV transfer to decode worker '{}' failed: {}", id,
                               decode_worker, why));
  };

  if (!have_fin) {
    free_local();
    return Internal(fmt::format("request {}: the engine did not end the prefill", id));
  }
  if (!fin.error.ok()) {
    free_local();
    // The engine ends a prefill whose writes failed with a generic Unavailable: name the cause.
    if (const Status why = kv->failure(); !why.ok()) return transfer_failed(why.to_string());
    return fin.error;
  }
  if (fin.finish_reason == FinishReason::kCancelled && !fin.has_token) {
    free_local();
    switch (cause) {
      case CancelCause::kClient:
        return Cancelled(fmt::format("request {}: the client went away", id));
      case CancelCause::kTimeout:
        return DeadlineExceeded(fmt::format(
            "request {}: the prefill did not finish within {} ms (worker.prefill_timeout_ms)", id,
            core_.config.worker.prefill_timeout_ms));
      case CancelCause::kNone:
        break;
    }
    // Cancelled by an Abort, or else by the KV sink because a write failed.
    if (aborted) {
      return Cancelled(fmt::format("request {} was aborted", id));
    }
    return transfer_failed("a KV write failed (the destination is unreachable or went away)");
  }

  core_.metrics.time_to_first_token_seconds->observe(seconds_since(start));
  v1::TokenEvent* first = out->mutable_first();
  to_proto(fin, first);
  if (fin.handoff) {
    // Generation goes on at the decode worker: this is not the request's end.
    first->set_finished(false);
    first->clear_finish_reason();
    first->clear_stop_string();
    // The usage stays: the prefill's prompt and cached-prompt counts reach the caller.
  }
  if (!fin.handoff) {
    // The request ended with its first token: the caller releases the reservation.
    free_local();
    core_.metrics.e2e_request_seconds->observe(seconds_since(start));
    return Status::Ok();
  }

  const Status fs = kv->finish(transfer_bound);
  if (!fs.ok()) {
    free_local();
    return transfer_failed(fs.message());
  }
  (void)core_.engine->release_pinned(id);
  core_.metrics.kv_handoffs_ok->inc();
  core_.metrics.kv_handoff_tail_seconds->observe(kv->tail_seconds());
  core_.metrics.kv_transfer_seconds->observe(kv->transfer_seconds());
  core_.metrics.kv_transfer_bytes->inc(static_cast<double>(kv->bytes()));
  core_.metrics.e2e_request_seconds->observe(seconds_since(start));
  out->set_kv_tail_seconds(kv->tail_seconds());
  out->set_kv_transfer_seconds(kv->transfer_seconds());
  out->set_kv_bytes(kv->bytes());
  return Status::Ok();
}

}  // namespace cleave::worker_service
