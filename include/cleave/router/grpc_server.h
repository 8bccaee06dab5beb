// The router's public gRPC API (issue 6 "gRPC API"; proto/cleave/v1/inference.proto): the
// Inference service (server-streaming Generate, ListModels) over a RouterFrontend, with the
// HTTP API's parameters and semantics (grpc/grpc_request.h turns a GenerateTextRequest into the
// OpenAI body it stands for), plus grpc.health.v1.Health (NOT_SERVING until the dispatcher is
// ready).
//
// Each Generate is a callback-API reactor driving one Exchange (frontend/exchange.h) on the gRPC
// wire: dispatcher callbacks append deltas under the exchange's lock and post a wake-up to the
// server's output thread ("grpc-out"), which takes the pending message and starts its write when
// none is in flight. No thread is held per call and nothing blocks on a client. A call the
// client cancels (or whose deadline passes) has its dispatches cancelled, so their KV blocks go
// back to the pools.
//
// With api_keys set, every call needs the metadata `authorization: Bearer KEY` (the HTTP
// API's keys); the health service stays open.
//
// Thread-safety: start() and stop() from one controlling thread; port() from any thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/router/router_frontend.h"

namespace cleave::router {

struct GrpcServerOptions {
  std::string host = "0.0.0.0";  // IPv4 or IPv6 literal
  int port = 8001;               // 0: a free port (see GrpcServer::port())
  std::vector<std::string> api_keys;
  uint64_t max_message_bytes = 16ull << 20;  // largest GenerateTextRequest
};

class GrpcServer {
 public:
  // Listens and serves. `frontend` must outlive the server. Unavailable when the address cannot
  // be bound; InvalidArgument for bad options.
  static Result<std::unique_ptr<GrpcServer>> start(const GrpcServerOptions& options,
                                                   RouterFrontend& frontend);
  // stop().
  ~GrpcServer();
  GrpcServer(const GrpcServer&) = delete;
  GrpcServer& operator=(const GrpcServer&) = delete;

  int port() const;
  // Calls in flight (for tests).
  int64_t active_calls() const;

  // Cancels the calls in flight (their dispatches end on the workers) and stops listening.
  // Idempotent.
  void stop();

  struct Impl;

 private:
  explicit GrpcServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cleave::router
