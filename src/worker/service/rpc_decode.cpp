// Decode workers: Reserve, Release and Decode.
#include "cleave/common/log.h"
#include "cleave/worker/proto_convert.h"
#include "fmt/format.h"
#include "request_events.h"
#include "worker_core.h"

namespace cleave::worker_service {

grpc::Status WorkerRpcs::Reserve(grpc::ServerContext*, const v1::ReserveRequest* req,
                                 v1::KvDestination* out) {
  if (core_.role != WorkerRole::kDecode) return done("Reserve", wrong_role("Reserve", "decode"));
  if (req->lease_ms() < 0) {
    return done("Reserve", grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                        fmt::format("lease_ms {} is negative", req->lease_ms())));
  }
  const RequestId id = req->request_id();
  const std::chrono::milliseconds lease(req->lease_ms() > 0 ? req->lease_ms()
                                                            : core_.config.worker.lease_ms);
  const auto deadline = std::chrono::steady_clock::now() + lease;
  auto blocks = core_.engine->reserve(id, req->num_prompt_tokens(), lease);
  if (!blocks.ok()) return done("Reserve", to_grpc(blocks.status()));

  KvDestination dest;
  dest.request_id = id;
  dest.worker_id = core_.id;
  dest.transfer_address = core_.transfer->address();
  dest.region = core_.kv_region.remote;
  dest.layout = core_.engine->kv_layout();
  dest.model_fingerprint = core_.model_fingerprint;
  dest.blocks = std::move(*blocks);
  dest.lease = lease;
  dest.notice_tag = core_.reservations.add(id, req->num_prompt_tokens(), lease, deadline);
  to_proto(dest, out);
  log::debug("worker {}: reserved {} blocks for request {} ({} tokens, lease {} ms)", core_.id,
             dest.blocks.size(), id, req->num_prompt_tokens(), lease.count());
  return done("Reserve", grpc::Status::OK);
}

grpc::Status WorkerRpcs::Release(grpc::ServerContext*, const v1::ReleaseRequest* req,
                                 v1::ReleaseResponse* out) {
  if (core_.role != WorkerRole::kDecode) return done("Release", wrong_role("Release", "decode"));
  const bool had_entry = core_.reservations.remove(req->request_id());
  const bool had_blocks = core_.engine->release_reservation(req->request_id());
  out->set_released(had_blocks || had_entry);
  return done("Release", grpc::Status::OK);
}

grpc::Status WorkerRpcs::Decode(grpc::ServerContext* ctx, const v1::DecodeRequest* req,
                                grpc::ServerWriter<v1::TokenEvent>* writer) {
  if (core_.role != WorkerRole::kDecode) return done("Decode", wrong_role("Decode", "decode"));
  return done("Decode", decode(ctx, *req, writer));
}

grpc::Status WorkerRpcs::decode(grpc::ServerContext* ctx, const v1::DecodeRequest& req,
                                grpc::ServerWriter<v1::TokenEvent>* writer) {
  using Outcome = ReservationTable::Outcome;
  const RequestId id = req.request_id();
  const auto start = std::chrono::steady_clock::now();
  const ReservationTable::Taken taken = core_.reservations.wait_and_take(
      id, [ctx] { return ctx->IsCancelled(); }, kCancelPoll);
  switch (taken.outcome) {
    case Outcome::kFilled:
      break;
    case Outcome::kNotFound:
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          fmt::format("no reservation for request {} on worker '{}' (never made, "
                                      "already used, released or expired)",
                                      id, core_.id));
    case Outcome::kBusy:
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                          fmt::format("a Decode of request {} is already waiting", id));
    case Outcome::kExpired:
      // The engine gives the blocks back at the lease's end (and counts it).
      log::info("worker {}: request {}: the KV did not arrive within the lease of {} ms", core_.id,
                id, taken.lease.count());
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          fmt::format("request {}: the KV did not arrive within the lease of {} ms",
                                      id, taken.lease.count()));
    case Outcome::kReleased:
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          fmt::format("request {}: the reservation was released or aborted", id));
    case Outcome::kGaveUp:
      (void)core_.engine->release_reservation(id);
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          fmt::format("request {}: the client went away", id));
    case Outcome::kShutdown:
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          fmt::format("worker '{}' is shutting down", core_.id));
  }
  core_.metrics.kv_wait_seconds->observe(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());

  EngineRequest r;
  r.id = id;
  r.prompt.assign(req.prompt_tokens().begin(), req.prompt_tokens().end());
  r.params = req.has_params() ? from_proto(req.params()) : SamplingParams{};
  r.prefilled = true;
  r.first_token = req.first_token();
  if (static_cast<int64_t>(r.prompt.size()) != taken.num_tokens) {
    (void)core_.engine->release_reservation(id);
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        fmt::format("request {}: the prompt has {} tokens but {} were reserved", id,
                                    r.prompt.size(), taken.num_tokens));
  }
  auto events = std::make_shared<RequestEvents>();
  const Status submitted = core_.engine->submit(std::move(r), RequestEvents::callback(events));
  if (!submitted.ok()) {
    (void)core_.engine->release_reservation(id);
    return to_grpc(submitted);
  }
  grpc::Status s = stream_request(ctx, *core_.engine, id, *events, writer);
  if (s.ok()) {
    core_.metrics.e2e_request_seconds->observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return s;
}

}  // namespace cleave::worker_service
