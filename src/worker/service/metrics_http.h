// A worker's HTTP endpoint for Prometheus (worker.metrics_port): GET /metrics answers the same
// text as the GetMetrics RPC; GET /health answers 200 "ok" while serving, 503 "draining" after
// SIGTERM. Anything else: 404 (405 for a method other than GET/HEAD). One thread serves the
// connections one after the other (scrapes are rare and small), each request bounded by a 5 s
// socket timeout; plain POSIX sockets, HTTP/1.1 with "Connection: close".
//
// Thread-safety: start() and stop() from one thread; `render` and `healthy` are called on the
// server's thread.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "cleave/common/status.h"

namespace cleave::worker_service {

class MetricsHttpServer {
 public:
  // Listens on host:port (host as in worker.listen: "0.0.0.0", "127.0.0.1", "[::]", a name);
  // port 0 picks a free one. Unavailable when it cannot bind.
  static Result<std::unique_ptr<MetricsHttpServer>> start(const std::string& host, int port,
                                                          std::function<std::string()> render,
                                                          std::function<bool()> healthy);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }
  // Stops accepting and joins the thread (within ~100 ms). Idempotent.
  void stop();

 private:
  MetricsHttpServer() = default;
  void loop();
  void serve_one(int fd);

  int listen_fd_ = -1;
  int port_ = 0;
  std::function<std::string()> render_;
  std::function<bool()> healthy_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace cleave::worker_service
