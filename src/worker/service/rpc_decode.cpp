// Decode workers: Reserve, Release and Decode (token_stream.cpp streams it).
#include <exception>
#include <memory>
#include <string>

#include "cleave/common/log.h"
#include "cleave/worker/proto_convert.h"
#include "fmt/format.h"
#include "token_stream.h"
#include "worker_core.h"

namespace cleave::worker_service {

namespace {

// A callback-API handler's boundary, like WorkerRpcs::guarded for the synchronous ones: an
// exception `body` lets out becomes INTERNAL naming the RPC.
template <typename Body>
Status caught(std::string_view rpc, Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    return Internal(std::string(rpc) + " failed: " + e.what());
  } catch (...) {
    return Internal(std::string(rpc) + " failed: an exception that is not a std::exception");
  }
}

}  // namespace

// On the callback API: the engine makes the reservation in its next iteration and answers on
// its own thread, so no gRPC thread waits on it.
grpc::ServerUnaryReactor* WorkerRpcs::Reserve(grpc::CallbackServerContext* ctx,
                                              const v1::ReserveRequest* req, v1::KvDestination* out) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  bool queued = false;  // the engine's callback finishes the call
  const Status st = caught("Reserve", [&]() -> Status {
    if (core_.role != WorkerRole::kDecode) return wrong_role(core_, "Reserve", "decode");
    if (Status d = core_.refuse_if_draining("Reserve"); !d.ok()) return d;
    if (req->lease_ms() < 0) {
      return InvalidArgument(fmt::format("lease_ms {} is negative", req->lease_ms()));
    }
    const RequestId id = req->request_id();
    const int64_t num_tokens = req->num_prompt_tokens();
    const std::chrono::milliseconds lease(req->lease_ms() > 0 ? req->lease_ms()
                                                              : core_.config.worker.lease_ms);
    // The writer gets a key of this reservation's own: the engine revokes it when the
    // reservation ends, before its blocks can be reused, so that a write still on its way then
    // (a partition can hold one in a socket buffer for minutes) is refused by the provider
    // instead of landing in another request's KV. Offsets are those of the pool registration.
    // Where keys cannot be revoked (kv_fence_hold), the pool's own key, and the ledger holds the
    // blocks of a released or expired reservation past its lease instead.
    const bool own_key = core_.kv_fence_hold.count() == 0;
    transfer::MemoryRegion key = core_.kv_region;
    if (own_key) {
      CLEAVE_ASSIGN_OR_RETURN(key, core_.transfer->register_memory(core_.engine->kv_transfer_data(),
                                                                   core_.engine->kv_bytes(),
                                                                   core_.kv_transfer_kind()));
    }
    transfer::TransferEngine* transfer = core_.transfer.get();
    const uint64_t key_id = own_key ? key.id : 0;
    auto revoke = [transfer, key_id, id] {
      if (key_id == 0) return;
      Status s = transfer->deregister(key_id);
      if (!s.ok()) log::error("request {}: revoking its KV key failed: {}", id, s.message());
    };
    // The notice tag, set by the result callback before the call answers; the fence reads it
    // later, both under the engine's state lock (or after the engine thread has been joined).
    auto tag = std::make_shared<uint64_t>(0);
    ReservationTable* table = &core_.reservations;
    auto on_end = [revoke, table, tag, id](ReservationEnd how) {
      revoke();
      // A Decode waiting for this KV ends now with its "lease expired" outcome.
      if (how == ReservationEnd::kExpired) (void)table->expire(id, *tag);
    };
    const uint64_t writer = req->expected_writer_engine();
    auto on_reserved = [this, reactor, out, revoke, key, tag, id, num_tokens, lease,
                        writer](Result<std::vector<BlockId>> blocks) {
      const Status made = caught("Reserve", [&]() -> Status {
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
        *tag = core_.reservations.add(id, num_tokens, lease, writer);
        dest.notice_tag = *tag;
        to_proto(dest, out);
        log::debug("worker {}: reserved {} blocks for request {} ({} tokens, lease {} ms)",
                   core_.id, dest.blocks.size(), id, num_tokens, lease.count());
        return Status::Ok();
      });
      reactor->Finish(count_rpc(core_, "Reserve", to_grpc(made)));
    };
    Status q = core_.engine->reserve_async(id, num_tokens, lease, std::move(on_end),
                                           std::move(on_reserved), core_.kv_fence_hold);
    if (!q.ok()) {
      revoke();
      return q;
    }
    queued = true;
    return Status::Ok();
  });
  if (!queued) reactor->Finish(count_rpc(core_, "Reserve", to_grpc(st)));
  return reactor;
}

grpc::ServerUnaryReactor* WorkerRpcs::Release(grpc::CallbackServerContext* ctx,
                                              const v1::ReleaseRequest* req,
                                              v1::ReleaseResponse* out) {
  return unary(ctx, "Release", [&]() -> Status {
    if (core_.role != WorkerRole::kDecode) return wrong_role(core_, "Release", "decode");
    const bool had_entry = core_.reservations.remove(req->request_id());
    const bool had_blocks = core_.engine->release_reservation(req->request_id());
    out->set_released(had_blocks || had_entry);
    return Status::Ok();
  });
}

grpc::ServerWriteReactor<v1::TokenEvent>* WorkerRpcs::Decode(grpc::CallbackServerContext* /*ctx*/,
                                                             const v1::DecodeRequest* req) {
  return start_decode(pump_, req);
}

}  // namespace cleave::worker_service
