// The RPCs every role serves: GetInfo, GetLoad, GetMetrics, Abort; RenewLease (decode and
// prefill); and the shared helpers.
#include <unistd.h>

#include "cleave/common/log.h"
#include "cleave/common/version.h"
#include "cleave/worker/proto_convert.h"
#include "fmt/format.h"
#include "worker_core.h"

namespace cleave::worker_service {

Result<uint64_t> WorkerCore::peer_for(const std::string& address) {
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peers_.find(address);
    // A peer marked unreachable is connected again: the caller holds a reservation the peer
    // granted just now, so it is alive. The mark outlives the transfer that set it, whichever
    // way that transfer's Prefill ended (a failed write, or an Abort, its deadline or a client
    // gone while a write was refused at its key's revocation).
    if (it != peers_.end() && transfer->reachable(it->second)) return it->second;
  }
  // connect() is idempotent per peer engine, so two racing first requests get one id.
  CLEAVE_ASSIGN_OR_RETURN(uint64_t peer, transfer->connect(address));
  std::lock_guard<std::mutex> lock(peers_mu_);
  peers_[address] = peer;
  return peer;
}

void WorkerCore::mark_aborted(RequestId id) {
  std::lock_guard<std::mutex> lock(aborted_mu_);
  aborted_.insert(id);
}

bool WorkerCore::take_aborted(RequestId id) {
  std::lock_guard<std::mutex> lock(aborted_mu_);
  return aborted_.erase(id) > 0;
}

void WorkerCore::add_sender(RequestId id, std::weak_ptr<KvSender> sender) {
  std::lock_guard<std::mutex> lock(senders_mu_);
  senders_[id] = std::move(sender);
}

void WorkerCore::remove_sender(RequestId id, const KvSender* sender) {
  std::lock_guard<std::mutex> lock(senders_mu_);
  auto it = senders_.find(id);
  if (it == senders_.end()) return;
  const std::shared_ptr<KvSender> held = it->second.lock();
  if (!held || held.get() == sender) senders_.erase(it);
}

bool WorkerCore::renew_sender(RequestId id, std::chrono::milliseconds lease) {
  std::shared_ptr<KvSender> sender;
  {
    std::lock_guard<std::mutex> lock(senders_mu_);
    if (auto it = senders_.find(id); it != senders_.end()) sender = it->second.lock();
  }
  return sender && sender->renew_lease(lease);
}

Status WorkerCore::refuse_if_draining(std::string_view rpc) const {
  if (!draining.load(std::memory_order_acquire)) return Status::Ok();
  return Unavailable(fmt::format("worker '{}' is draining (shutting down): {} refused", id, rpc));
}

Status wrong_role(const WorkerCore& core, std::string_view rpc, std::string_view served_by) {
  return Unimplemented(fmt::format("{} is not served by worker '{}' (role {}); {} workers serve it",
                                   rpc, core.id, worker_role_name(core.role), served_by));
}

grpc::Status count_rpc(WorkerCore& core, std::string_view rpc, grpc::Status s) {
  core.metrics.count_rpc(rpc, grpc_code_name(s.error_code()));
  if (!s.ok() && s.error_code() != grpc::StatusCode::CANCELLED) {
    log::debug("worker {}: {} -> {}: {}", core.id, rpc, grpc_code_name(s.error_code()),
               s.error_message());
  }
  return s;
}

grpc::Status WorkerRpcs::done(std::string_view rpc, const Status& s) {
  return count_rpc(core_, rpc, to_grpc(s));
}

grpc::ServerUnaryReactor* WorkerRpcs::GetInfo(grpc::CallbackServerContext* ctx,
                                              const v1::GetInfoRequest*, v1::WorkerInfo* out) {
  return unary(ctx, "GetInfo", [&]() -> Status {
    out->set_worker_id(core_.id);
    out->set_role(std::string(worker_role_name(core_.role)));
    out->set_model_name(core_.model_name);
    out->set_model_fingerprint(core_.model_fingerprint);
    to_proto(core_.engine->kv_layout(), out->mutable_kv_layout());
    if (core_.transfer) {
      out->set_transfer_provider(core_.transfer->provider());
      out->set_transfer_address(core_.transfer->address());
      out->set_transfer_engine_id(core_.transfer->engine_id());
    }
    out->set_max_context(core_.max_context);
    out->set_vocab_size(core_.vocab_size);
    out->set_version(kVersion);
    out->set_pid(static_cast<int32_t>(::getpid()));
    return Status::Ok();
  });
}

grpc::ServerUnaryReactor* WorkerRpcs::GetLoad(grpc::CallbackServerContext* ctx,
                                              const v1::GetLoadRequest*, v1::LoadReport* out) {
  return unary(ctx, "GetLoad", [&]() -> Status {
    const EngineStats s = core_.engine->stats();
    out->set_waiting(s.waiting);
    out->set_running(s.running);
    out->set_blocks_total(s.blocks_total);
    out->set_blocks_free(s.blocks_free);
    out->set_blocks_cached(s.blocks_cached);
    out->set_blocks_used(s.blocks_used);
    out->set_kv_usage(s.blocks_total > 0 ? static_cast<double>(s.blocks_used) /
                                               static_cast<double>(s.blocks_total)
                                         : 0.0);
    out->set_reservations(s.reservations);
    out->set_blocks_reserved(s.blocks_reserved);
    out->set_leases_expired(s.leases_expired);
    out->set_leases_renewed(s.leases_renewed);
    out->set_requests_finished(s.requests_finished);
    out->set_requests_failed(s.requests_failed);
    out->set_requests_cancelled(s.requests_cancelled);
    out->set_blocks_pinned(s.blocks_pinned);
    out->set_blocks_held(s.blocks_held);
    out->set_prefill_tokens(core_.prefill_tokens.load(std::memory_order_relaxed));
    out->set_decodes_waiting(core_.reservations.claimed());
    return Status::Ok();
  });
}

grpc::ServerUnaryReactor* WorkerRpcs::GetMetrics(grpc::CallbackServerContext* ctx,
                                              const v1::GetMetricsRequest*, v1::MetricsText* out) {
  return unary(ctx, "GetMetrics", [&]() -> Status {
    out->set_text(core_.metrics.render(core_.engine->stats(), core_.reservations.size()));
    return Status::Ok();
  });
}

grpc::ServerUnaryReactor* WorkerRpcs::RenewLease(grpc::CallbackServerContext* ctx,
                                                 const v1::RenewLeaseRequest* req,
                                                 v1::RenewLeaseResponse* out) {
  return unary(ctx, "RenewLease", [&]() -> Status {
    const RequestId id = req->request_id();
    if (req->lease_ms() < 1) {
      return InvalidArgument(fmt::format(
          "RenewLease of request {}: lease_ms is {}, it must be at least 1", id, req->lease_ms()));
    }
    const std::chrono::milliseconds lease(req->lease_ms());
    switch (core_.role) {
      case WorkerRole::kDecode:
        out->set_renewed(core_.engine->renew_reservation(id, lease));
        if (out->renewed()) (void)core_.reservations.renewed(id, lease);
        break;
      case WorkerRole::kPrefill:
        out->set_renewed(core_.renew_sender(id, lease));
        break;
      default:
        return wrong_role(core_, "RenewLease", "decode and prefill");
    }
    log::debug("worker {}: lease of request {} {} for {} ms", core_.id, id,
               out->renewed() ? "renewed" : "not renewed (no such reservation or prefill)",
               lease.count());
    return Status::Ok();
  });
}

grpc::ServerUnaryReactor* WorkerRpcs::Abort(grpc::CallbackServerContext* ctx,
                                            const v1::AbortRequest* req, v1::AbortResponse* out) {
  return unary(ctx, "Abort", [&]() -> Status {
    const RequestId id = req->request_id();
    if (core_.role == WorkerRole::kPrefill) core_.mark_aborted(id);
    bool aborted = core_.engine->cancel(id);
    if (core_.role == WorkerRole::kPrefill && !aborted) (void)core_.take_aborted(id);
    if (core_.role == WorkerRole::kDecode) {
      // A reservation (waiting for its KV, or with a Decode waiting on it): the table entry ends
      // the wait, the engine gives the blocks back now.
      const bool had_entry = core_.reservations.remove(id);
      const bool had_blocks = core_.engine->release_reservation(id);
      aborted = aborted || had_entry || had_blocks;
    }
    out->set_aborted(aborted);
    log::debug("worker {}: abort of request {}: {}", core_.id, id, aborted ? "done" : "not found");
    return Status::Ok();
  });
}

}  // namespace cleave::worker_service
