// Decode workers: Reserve, Release and Decode (token_stream.cpp streams it).
#include "cleave/common/log.h"
#include "cleave/worker/proto_convert.h"
#include "fmt/format.h"
#include "token_stream.h"
#include "worker_core.h"

namespace cleave::worker_service {

grpc::Status WorkerRpcs::Reserve(grpc::ServerContext*, const v1::ReserveRequest* req,
                                 v1::KvDestination* out) {
  return guarded("Reserve", [&]() -> Status {
    if (core_.role != WorkerRole::kDecode) return wrong_role(core_, "Reserve", "decode");
    if (Status d = core_.refuse_if_draining("Reserve"); !d.ok()) return d;
    if (req->lease_ms() < 0) {
      return InvalidArgument(fmt::format("lease_ms {} is negative", req->lease_ms()));
    }
    const RequestId id = req->request_id();
    const std::chrono::milliseconds lease(req->lease_ms() > 0 ? req->lease_ms()
                                                              : core_.config.worker.lease_ms);
    const auto deadline = std::chrono::steady_clock::now() + lease;
    // The writer gets a key of this reservation's own: the engine revokes it when the
    // reservation ends, before its blocks can be reused, so that a write still on its way then
    // (a partition can hold one in a socket buffer for minutes) is refused by the provider
    // instead of landing in another request's KV. Offsets are those of the pool registration.
    CLEAVE_ASSIGN_OR_RETURN(transfer::MemoryRegion key,
                            core_.transfer->register_memory(core_.engine->kv_data(),
                                                            core_.engine->kv_bytes(),
                                                            transfer::MemoryKind::host()));
    transfer::TransferEngine* transfer = core_.transfer.get();
    const uint64_t key_id = key.id;
    auto revoke = [transfer, key_id, id] {
      Status s = transfer->deregister(key_id);
      if (!s.ok()) log::error("request {}: revoking its KV key failed: {}", id, s.message());
    };
    auto blocks = core_.engine->reserve(id, req->num_prompt_tokens(), lease, revoke);
    if (!blocks.ok()) {
      revoke();
      return blocks.status();
    }

    KvDestination dest;
    dest.request_id = id;
    dest.worker_id = core_.id;
    dest.transfer_address = core_.transfer->address();
    dest.region = key.remote;
    dest.layout = core_.engine->kv_layout();
    dest.model_fingerprint = core_.model_fingerprint;
    dest.blocks = std::move(*blocks);
    dest.lease = lease;
    dest.notice_tag = core_.reservations.add(id, req->num_prompt_tokens(), lease, deadline);
    to_proto(dest, out);
    log::debug("worker {}: reserved {} blocks for request {} ({} tokens, lease {} ms)", core_.id,
               dest.blocks.size(), id, req->num_prompt_tokens(), lease.count());
    return Status::Ok();
  });
}

grpc::Status WorkerRpcs::Release(grpc::ServerContext*, const v1::ReleaseRequest* req,
                                 v1::ReleaseResponse* out) {
  return guarded("Release", [&]() -> Status {
    if (core_.role != WorkerRole::kDecode) return wrong_role(core_, "Release", "decode");
    const bool had_entry = core_.reservations.remove(req->request_id());
    const bool had_blocks = core_.engine->release_reservation(req->request_id());
    out->set_released(had_blocks || had_entry);
    return Status::Ok();
  });
}

grpc::ServerWriteReactor<v1::TokenEvent>* WorkerRpcs::Decode(grpc::CallbackServerContext* ctx,
                                                             const v1::DecodeRequest* req) {
  return start_decode(pump_, ctx, req);
}

}  // namespace cleave::worker_service
