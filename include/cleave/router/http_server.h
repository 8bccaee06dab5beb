// The router's OpenAI-compatible HTTP/1.1 frontend (issue 6 "HTTP API"): an asynchronous
// Boost.Beast server over a RouterFrontend (router_frontend.h).
//
// Routes:
//   POST /v1/completions, POST /v1/chat/completions   streaming (SSE, chunked) or not; n > 1
//        and several prompts run as several dispatches merged into one response
//   GET  /v1/models, GET /v1/models/{name}
//   GET  /health    200 when Dispatcher::ready(), else 503
//   GET  /metrics   Prometheus text (RouterFrontend::render_metrics)
// Unknown path 404, wrong method 405, both as OpenAI error objects. With api_keys set, every
// /v1/ path needs "Authorization: Bearer <one of them>" (401 otherwise); /health and /metrics
// stay open (probes and scrapers).
//
// Errors are answered before any stream opens: the stream's response head goes out with the
// request's first token, so a dispatch that fails before producing one is answered with its
// own status (400, 429, 503...). A dispatch that fails after the stream opened ends it with an
// SSE error event and [DONE], then the connection is closed. A client that disconnects while
// its request runs (streaming or not) has every dispatch of it cancelled.
//
// Connections: HTTP/1.1 keep-alive (and 1.0, whose streams end by closing), bounded header and
// body sizes (431, 413), timeouts for an idle keep-alive connection, for receiving a header once
// it started, for receiving the body, and for each write (a client that stops reading).
//
// Threads: `io_threads` threads named "http-io-<i>" run every connection; each connection is
// served on its own strand. Dispatcher callbacks only append to the response under a
// per-request lock and post to that strand; they never touch a socket and never wait for one.
//
// Thread-safety: start() and stop() from one controlling thread; port() from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/router/router_frontend.h"

namespace cleave::router {

struct ServerContext;

struct HttpServerOptions {
  std::string host = "0.0.0.0";  // address to listen on (IPv4 or IPv6 literal)
  int port = 8000;               // 0: a free port (see HttpServer::port())
  int io_threads = 1;
  int backlog = 1024;
  uint64_t max_body_bytes = 16ull << 20;  // larger bodies: 413
  uint32_t max_header_bytes = 64u << 10;  // larger headers: 431
  // A keep-alive connection may wait this long for its next request.
  std::chrono::milliseconds idle_timeout{75000};
  // From a request's first byte to the end of its header.
  std::chrono::milliseconds header_timeout{10000};
  // Receiving the body, once the header is in.
  std::chrono::milliseconds body_timeout{60000};
  // One write of a response (a client that stops reading a stream is dropped after it).
  std::chrono::milliseconds write_timeout{60000};
  // Non-empty: the bearer tokens accepted on /v1/ routes.
  std::vector<std::string> api_keys;
};

// InvalidArgument naming the field.
Status validate_http_server_options(const HttpServerOptions& options);

class HttpServer {
 public:
  // Listens and starts the I/O threads. `frontend` must outlive the server. InvalidArgument
  // for bad options or host; Unavailable when the address cannot be bound (the message names
  // it and the system's reason).
  static Result<std::unique_ptr<HttpServer>> start(const HttpServerOptions& options,
                                                   RouterFrontend& frontend);
  // stop().
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The bound port (the chosen one when options.port was 0).
  int port() const;
  // Open connections (for tests and benchmarks).
  int64_t connections() const;

  // Stops accepting, cancels every request in flight (their blocks go back to the workers),
  // closes every connection and joins the threads. Idempotent.
  void stop();

 private:
  struct Impl;
  HttpServer(std::unique_ptr<ServerContext> ctx, std::unique_ptr<Impl> impl);
  std::unique_ptr<ServerContext> ctx_;  // shared by the connections; outlives impl_
  std::unique_ptr<Impl> impl_;          // null once stopped
  int port_ = 0;
};

}  // namespace cleave::router
