// The router process (issue 6 "`cleave serve`"): the dispatcher (dispatcher.h), the request
// front with the served model's tokenizer and chat template (router_frontend.h) and the
// OpenAI HTTP server (http_server.h), built from the router's settings (RouterAppConfig: router.*,
// pools.*, the model, the longest request) and run until stopped. `cleave router` runs one against workers named in the
// configuration; `cleave serve` runs one in-process against the workers it starts
// (worker_supervisor.h).
//
// Thread-safety: start() and stop() from one controlling thread; the accessors from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/metrics.h"
#include "cleave/common/status.h"
#include "cleave/model/model_settings.h"
#include "cleave/router/dispatch_options.h"
#include "cleave/router/dispatcher.h"
#include "cleave/router/grpc_server.h"
#include "cleave/router/http_server.h"
#include "cleave/router/router_frontend.h"
#include "cleave/router/router_settings.h"

namespace cleave::router {

// What the router runs with (the command line composes it: cli/config.h router_part()).
struct RouterAppConfig {
  ModelSettings model;      // model.path: tokenizer, chat template, served name
  RouterSettings router;
  PoolsSettings pools;
  int64_t max_context = 0;  // engine.max_context: longest request (prompt + output); 0 = the model's
};

// "a, b,,c" -> {"a", "b", "c"}: split at commas, blanks trimmed, empty entries dropped.
std::vector<std::string> split_comma_list(std::string_view text);

// The dispatch settings: mode and policies, the pools of the mode from
// pools.<pool>.workers and pools.<pool>.dns ("NAME:PORT"), probe interval, DNS refresh, queue
// limit (router.max_queue) and the first-token deadlines (router.request_timeout_ms).
// InvalidArgument naming the setting for a bad mode, policy, DNS entry, or a pool of the mode
// that names no worker.
Result<DispatcherOptions> dispatcher_options_from_config(const RouterSettings& router,
                                                         const PoolsSettings& pools);

// The HTTP settings: router.host, port, io_threads, max_body_bytes, idle_timeout_ms, api_keys.
Result<HttpServerOptions> http_server_options_from_config(const RouterSettings& router);

// The gRPC API's settings (router.host, grpc_port, api_keys, max_body_bytes);
// nullopt when router.grpc_port is -1.
std::optional<GrpcServerOptions> grpc_server_options_from_config(const RouterSettings& router);

// "http://HOST:PORT/" for a client on this machine: a wildcard host (0.0.0.0, ::, "") is shown
// as 127.0.0.1, an IPv6 literal in brackets.
std::string client_url(std::string_view host, int port);

class RouterApp {
 public:
  // Builds and starts the router: the model file (model.path, else the embedded default
  // model, generated once) gives the tokenizer, chat template and served name
  // (router.served_model_name wins); the dispatcher starts discovering and probing the
  // workers; the HTTP server listens, and the gRPC API unless router.grpc_port is -1. Returns
  // once listening: /health answers 503 until the
  // pools are ready (wait_ready()). Errors: the settings' (InvalidArgument), the model file's,
  // Unavailable when the port cannot be bound.
  static Result<std::unique_ptr<RouterApp>> start(const RouterAppConfig& config);
  // stop().
  ~RouterApp();
  RouterApp(const RouterApp&) = delete;
  RouterApp& operator=(const RouterApp&) = delete;

  // Waits until every pool has a ready worker (Dispatcher::ready()) and, with all_workers, until
  // every worker the router knows is ready; false when `timeout` passed first.
  bool wait_ready(std::chrono::milliseconds timeout, bool all_workers) const;

  int port() const;         // the bound HTTP port (the chosen one when router.port is 0)
  int grpc_port() const;    // the bound gRPC port; -1 when the gRPC API is off
  std::string url() const;  // client_url(router.host, port())
  // "HOST:PORT" of the gRPC API for a client on this machine (as url()); "" when it is off.
  std::string grpc_target() const;
  const std::string& model_name() const;  // the name the API serves the model under
  Dispatcher& dispatcher() const;

  // Stops the HTTP and gRPC servers (requests in flight are cancelled on their workers), then
  // the dispatcher. Idempotent.
  void stop();

 private:
  RouterApp() = default;
  std::string host_;
  std::unique_ptr<metrics::MetricsRegistry> registry_;
  std::unique_ptr<Dispatcher> dispatcher_;
  std::unique_ptr<RouterFrontend> frontend_;
  std::unique_ptr<HttpServer> server_;
  std::unique_ptr<GrpcServer> grpc_;
  int port_ = 0;
};

}  // namespace cleave::router
