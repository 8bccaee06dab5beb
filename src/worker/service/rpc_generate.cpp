// Unified workers' Generate, and the token streaming that Generate and Decode share.
#include "cleave/common/log.h"
#include "cleave/worker/proto_convert.h"
#include "fmt/format.h"
#include "request_events.h"
#include "worker_core.h"

namespace cleave::worker_service {
namespace {

// How long a cancelled request may take to deliver its finished event before the RPC stops
// waiting for it (the engine answers a cancel within one step; this guards a stuck engine).
constexpr std::chrono::seconds kCancelGrace{10};

}  // namespace

grpc::Status stream_request(grpc::ServerContext* ctx, EngineLoop& engine, RequestId id,
                            RequestEvents& events, grpc::ServerWriter<v1::TokenEvent>* writer,
                            std::chrono::steady_clock::time_point* first_token_at) {
  using Clock = std::chrono::steady_clock;
  std::vector<EngineEvent> batch;
  batch.reserve(16);
  v1::TokenEvent msg;
  bool cancelled = false;  // by us: the client went away
  Clock::time_point cancelled_at;
  auto cancel = [&] {
    if (cancelled) return;
    cancelled = true;
    cancelled_at = Clock::now();
    engine.cancel(id);
  };
  for (;;) {
    events.take(batch, kCancelPoll);
    for (const EngineEvent& ev : batch) {
      if (!ev.error.ok()) return to_grpc(ev.error);
      if (ev.finished && ev.finish_reason == FinishReason::kCancelled) {
        return grpc::Status(grpc::StatusCode::CANCELLED,
                            fmt::format("request {} was cancelled", id));
      }
      if (ev.has_token && first_token_at != nullptr && *first_token_at == Clock::time_point{}) {
        *first_token_at = Clock::now();
      }
      if (!cancelled) {
        to_proto(ev, &msg);
        if (!writer->Write(msg)) cancel();
      }
      if (ev.finished) {
        return cancelled ? grpc::Status(grpc::StatusCode::CANCELLED,
                                        fmt::format("request {}: the client went away", id))
                         : grpc::Status::OK;
      }
    }
    if (!cancelled && ctx->IsCancelled()) cancel();
    if (cancelled && Clock::now() - cancelled_at > kCancelGrace) {
      log::warn("request {}: no end from the engine {} s after its cancellation", id,
                kCancelGrace.count());
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          fmt::format("request {}: the client went away", id));
    }
  }
}

grpc::Status WorkerRpcs::Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                                  grpc::ServerWriter<v1::TokenEvent>* writer) {
  if (core_.role != WorkerRole::kUnified) return done("Generate", wrong_role("Generate", "unified"));
  const auto start = std::chrono::steady_clock::now();
  EngineRequest r;
  r.id = req->request_id();
  r.prompt.assign(req->prompt_tokens().begin(), req->prompt_tokens().end());
  r.params = req->has_params() ? from_proto(req->params()) : SamplingParams{};
  auto events = std::make_shared<RequestEvents>();
  const Status submitted = core_.engine->submit(std::move(r), RequestEvents::callback(events));
  if (!submitted.ok()) return done("Generate", to_grpc(submitted));
  std::chrono::steady_clock::time_point first{};
  grpc::Status s = stream_request(ctx, *core_.engine, req->request_id(), *events, writer, &first);
  if (first != std::chrono::steady_clock::time_point{}) {
    core_.metrics.time_to_first_token_seconds->observe(
        std::chrono::duration<double>(first - start).count());
  }
  if (s.ok()) {
    core_.metrics.e2e_request_seconds->observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return done("Generate", std::move(s));
}

}  // namespace cleave::worker_service
