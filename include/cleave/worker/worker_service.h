// A worker process's server: the model, its engine loop, (for prefill and decode workers) the
// transfer engine with the KV pool registered, and the control-plane gRPC service
// cleave.v1.Worker (proto/cleave/v1/worker.proto) plus the standard grpc.health.v1 service.
//
// Roles (DESIGN.md §1):
//   prefill  serves Prefill: computes a prompt, writes each layer's KV into the decode worker's
//            reserved blocks as soon as the layer is computed, then the notice; answers with the
//            first token.
//   decode   serves Reserve, Release and Decode: reserves blocks for a lease, waits for the
//            notice that the KV is in place, then continues the request and streams its tokens.
//   unified  serves Generate (prefill and decode in one process).
// Every role serves GetInfo, GetLoad, GetMetrics and Abort; any other RPC answers UNIMPLEMENTED
// with a message naming the role.
//
// Bounds: no RPC waits without limit. A Decode waits for the KV at most the reservation's lease;
// a Prefill waits for its compute at most worker.prefill_timeout_ms and for its transfer about
// twice transfer.completion_timeout_ms; client cancellation ends every wait within ~20 ms.
//
// Thread-safety: start() returns a running server; shutdown() and wait() may be called from any
// thread (wait() from several). Each RPC runs on its own gRPC thread; engine callbacks only
// queue events, and stream writes happen on the RPC's thread without any lock held.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "cleave/worker/worker_settings.h"
#include "cleave/common/listen_address.h"
#include "cleave/common/status.h"
#include "cleave/kvcache/prefix_hash.h"
#include "cleave/worker/engine_loop.h"

namespace cleave {

enum class WorkerRole : uint8_t { kPrefill, kDecode, kUnified };
std::string_view worker_role_name(WorkerRole r);  // "prefill", "decode", "unified"
// InvalidArgument naming the value and the choices.
Result<WorkerRole> parse_worker_role(std::string_view name);

// prefix_hash_seed_for_model: kvcache/prefix_hash.h; ListenAddress, parse_listen_address:
// common/listen_address.h.

class WorkerServer {
 public:
  // Loads the model (config.model.path, else the embedded default), builds the engine loop from
  // config.engine, for prefill/decode creates the transfer engine from config.transfer and
  // registers the KV pool, and starts serving on config.worker.listen (health: SERVING).
  // InvalidArgument for a bad role or listen address; Unavailable when the port cannot be
  // bound; the loaders' and engines' errors otherwise.
  static Result<std::unique_ptr<WorkerServer>> start(const WorkerConfig& config);
  // shutdown().
  ~WorkerServer();
  WorkerServer(const WorkerServer&) = delete;
  WorkerServer& operator=(const WorkerServer&) = delete;

  WorkerRole role() const;
  const std::string& id() const;
  // The host as given in worker.listen and the port actually bound (never 0).
  const std::string& host() const;
  int port() const;
  std::string address() const;  // "host:port", for a client to dial

  // Graceful and idempotent: health goes NOT_SERVING, the engine shuts down (streams in flight
  // end with UNAVAILABLE, waiting Decodes too), the gRPC server stops (in-flight RPCs get a few
  // seconds), the notice thread stops and the KV pool is deregistered.
  void shutdown();
  // What a worker does on SIGTERM (worker.drain_seconds): health goes NOT_SERVING (the router
  // and Kubernetes stop sending), new Reserve, Prefill and Generate calls answer UNAVAILABLE
  // (a Decode of a reservation made before still runs), and the requests in flight go on until
  // none is left (in_flight() == 0), `limit` has passed or `interrupted()` (polled every 20 ms)
  // says stop; then shutdown(). true when nothing was left in flight.
  bool drain(std::chrono::milliseconds limit, const std::function<bool()>& interrupted = {});
  // Prefill, Decode and Generate calls not yet ended, reservations waiting for their Decode, and
  // requests in the engine.
  int64_t in_flight() const;
  // The port of GET /metrics (worker.metrics_port), -1 when off.
  int metrics_port() const;
  // Blocks until shutdown() has completed.
  void wait();

  // The engine loop's current snapshot (tests and the CLI).
  EngineStats engine_stats() const;

  struct Impl;

 private:
  explicit WorkerServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cleave
