// What a worker's RPC handlers share: configuration, identity, the engine loop, the transfer
// engine and the KV pool's registration, the reservation table and the metrics. Built once by
// WorkerServer::start and destroyed after the gRPC server has stopped.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "cleave/worker/worker_settings.h"
#include "cleave/common/status.h"
#include "cleave/transfer/transfer_engine.h"
#include "cleave/v1/worker.grpc.pb.h"
#include "cleave/worker/engine_loop.h"
#include "cleave/worker/kv_export.h"
#include "cleave/worker/worker_service.h"
#include "reservation_table.h"
#include "worker_metrics.h"

namespace cleave::worker_service {

// How often a handler that waits checks whether its client has gone.
inline constexpr std::chrono::milliseconds kCancelPoll{20};
// How long a cancelled request may take to deliver its last event before its RPC stops waiting
// for it (the engine answers a cancel within one step; this guards a stuck engine).
inline constexpr std::chrono::seconds kCancelGrace{10};

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct WorkerCore {
  WorkerConfig config;
  WorkerRole role = WorkerRole::kUnified;
  std::string id;
  std::string model_name;
  std::string model_fingerprint;
  int64_t max_context = 0;
  int64_t vocab_size = 0;

  // Declaration order is destruction order reversed: the transfer engine (which reads and
  // writes the pool) goes before the engine loop that owns the pool.
  std::unique_ptr<EngineLoop> engine;
  std::unique_ptr<transfer::TransferEngine> transfer;  // prefill and decode only
  transfer::MemoryRegion kv_region;                     // the KV pool's registration
  // The memory the transfer engine registers for the KV pool (engine->kv_transfer_data()): the
  // pool itself (host memory, or device memory where the provider has FI_HMEM: GPUDirect), or
  // its host mirror (a device pool, a provider without FI_HMEM).
  transfer::MemoryKind kv_transfer_kind() const {
    return engine->kv_device() >= 0 && !engine->kv_staged()
               ? transfer::MemoryKind::cuda(engine->kv_device())
               : transfer::MemoryKind::host();
  }
  // Decode: worker.kv_fence resolved. 0: each reservation gets a key of its own, revoked at its
  // end; > 0: the pool's key, and ended reservations' blocks held this long past their lease.
  std::chrono::milliseconds kv_fence_hold{0};

  ReservationTable reservations;
  WorkerMetrics metrics;
  std::atomic<bool> stopping{false};
  // Draining (SIGTERM): Reserve, Prefill and Generate answer UNAVAILABLE; a Decode of a
  // reservation made before still runs.
  std::atomic<bool> draining{false};
  // Prefill, Decode and Generate calls not yet ended.
  std::atomic<int64_t> calls_in_flight{0};
  // Prompt tokens (resume tokens included) of the Prefill calls not yet ended (LoadReport).
  std::atomic<int64_t> prefill_tokens{0};

  // UNAVAILABLE naming the worker when it is draining, else OK.
  Status refuse_if_draining(std::string_view rpc) const;

  // Prefill: peer ids by transfer address. The peer is connected again (clearing the engine's
  // "unreachable" mark) when the engine has it marked unreachable, however the request that
  // met the failure ended: a failed write, an Abort, a deadline or a client gone.
  Result<uint64_t> peer_for(const std::string& address);

  // Prefill: the KV senders of the Prefill calls in flight, by request id, for RenewLease.
  void add_sender(RequestId id, std::weak_ptr<KvSender> sender);
  // Removes the entry of `id` if it is `sender`'s (or its sender is gone).
  void remove_sender(RequestId id, const KvSender* sender);
  // Extends the write bound of the Prefill of `id` (KvSender::renew_lease); false when there is
  // no such Prefill or its writes have stopped.
  bool renew_sender(RequestId id, std::chrono::milliseconds lease);

  // Prefill: Abort marks a request here before it cancels it, so that the Prefill tells an
  // Abort from a cancellation by its KV sink (a failed transfer). Prefill clears its mark.
  void mark_aborted(RequestId id);
  // Whether `id` was marked, clearing the mark.
  bool take_aborted(RequestId id);

 private:
  std::mutex aborted_mu_;
  std::unordered_set<RequestId> aborted_;
  std::mutex senders_mu_;
  std::unordered_map<RequestId, std::weak_ptr<KvSender>> senders_;
  std::mutex peers_mu_;
  std::unordered_map<std::string, uint64_t> peers_;
};

class TokenStreamPump;

// Counts a work RPC in core.calls_in_flight for its lifetime.
class CallInFlight {
 public:
  explicit CallInFlight(WorkerCore& core) : core_(core) { core_.calls_in_flight.fetch_add(1); }
  ~CallInFlight() { core_.calls_in_flight.fetch_sub(1); }
  CallInFlight(const CallInFlight&) = delete;
  CallInFlight& operator=(const CallInFlight&) = delete;

 private:
  WorkerCore& core_;
};

// UNIMPLEMENTED naming the RPC, this worker's role and the roles that serve it.
Status wrong_role(const WorkerCore& core, std::string_view rpc, std::string_view served_by);
// Counts the RPC in the metrics (and logs a failure other than CANCELLED); returns `s`.
grpc::Status count_rpc(WorkerCore& core, std::string_view rpc, grpc::Status s);

// The gRPC service, wholly on the callback API (v1::Worker::CallbackService), so that no thread
// is held per call and the worker has no pool of gRPC threads that grows with the load. Every
// handler checks the role first. The streams (Decode, Generate; token_stream.h), Prefill
// (rpc_prefill.cpp) and Reserve (rpc_decode.cpp) are reactors of their own, driven by the
// engine and the transfer engine; the quick unary RPCs finish at once on gRPC's callback
// executor (unary()).
using WorkerServiceBase = v1::Worker::CallbackService;

class WorkerRpcs final : public WorkerServiceBase {
 public:
  WorkerRpcs(WorkerCore& core, TokenStreamPump& pump) : core_(core), pump_(pump) {}

  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* ctx,
                                    const v1::GetInfoRequest* req, v1::WorkerInfo* out) override;
  grpc::ServerUnaryReactor* GetLoad(grpc::CallbackServerContext* ctx,
                                    const v1::GetLoadRequest* req, v1::LoadReport* out) override;
  grpc::ServerUnaryReactor* GetMetrics(grpc::CallbackServerContext* ctx,
                                       const v1::GetMetricsRequest* req,
                                       v1::MetricsText* out) override;
  grpc::ServerUnaryReactor* Reserve(grpc::CallbackServerContext* ctx,
                                    const v1::ReserveRequest* req,
                                    v1::KvDestination* out) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx,
                                    const v1::ReleaseRequest* req,
                                    v1::ReleaseResponse* out) override;
  grpc::ServerUnaryReactor* RenewLease(grpc::CallbackServerContext* ctx,
                                       const v1::RenewLeaseRequest* req,
                                       v1::RenewLeaseResponse* out) override;
  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* ctx,
                                    const v1::PrefillRequest* req,
                                    v1::PrefillResponse* out) override;
  grpc::ServerWriteReactor<v1::TokenEvent>* Decode(grpc::CallbackServerContext* ctx,
                                                   const v1::DecodeRequest* req) override;
  grpc::ServerWriteReactor<v1::TokenEvent>* Generate(grpc::CallbackServerContext* ctx,
                                                     const v1::GenerateRequest* req) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* ctx, const v1::AbortRequest* req,
                                  v1::AbortResponse* out) override;

 private:
  // The end of every unary handler: `s` becomes the RPC's status (to_grpc, proto_convert.h),
  // counted by count_rpc.
  grpc::Status done(std::string_view rpc, const Status& s);
  // A unary handler's boundary: done(rpc, body()), where an exception that `body` lets out
  // becomes INTERNAL naming the RPC, so that none reaches gRPC (which would answer UNKNOWN,
  // uncounted) or ends the worker.
  template <typename Body>
  grpc::Status guarded(std::string_view rpc, Body&& body) {
    Status s;
    try {
      s = body();
    } catch (const std::exception& e) {
      s = Internal(std::string(rpc) + " failed: " + e.what());
    } catch (...) {
      s = Internal(std::string(rpc) + " failed: an exception that is not a std::exception");
    }
    return done(rpc, s);
  }

  // A quick unary handler on the callback API: guarded(rpc, body), finished at once on the
  // calling thread (gRPC's callback executor), with no reactor of its own.
  template <typename Body>
  grpc::ServerUnaryReactor* unary(grpc::CallbackServerContext* ctx, std::string_view rpc,
                                  Body&& body) {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(guarded(rpc, std::forward<Body>(body)));
    return reactor;
  }

  WorkerCore& core_;
  TokenStreamPump& pump_;
};



}  // namespace cleave::worker_service
