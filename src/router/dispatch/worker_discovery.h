// Worker discovery and health: the thread "dispatch-health" keeps each pool's membership (the
// static entries plus what its DNS name resolves to, re-resolved every dns_refresh) and probes
// every worker each health_interval: grpc.health.v1 Check, GetLoad, and GetInfo on the first
// probe and whenever the worker was not ready (it may have restarted). The probes of one round
// run at once on gRPC's callback API, each bounded by timeouts.probe, so one round lasts at
// most about that long however many workers are dead.
//
// Thread-safety: start() and stop() from one owner thread; stop() is idempotent and returns
// within about timeouts.probe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/router/dispatch_options.h"
#include "dispatch/worker_pools.h"

namespace cleave::router {

// The addresses `name` resolves to (getaddrinfo, IPv4 and IPv6), each as "ip:port"
// ("[ip]:port" for IPv6), sorted, without duplicates. Unavailable naming the name when it does
// not resolve.
Result<std::vector<std::string>> resolve_worker_addresses(const std::string& name, int port);

// The serving status in a grpc.health.v1.HealthCheckResponse (field 1, an enum: 1 SERVING);
// -1 when the bytes are not such a message.
int parse_health_status(const std::string& bytes);

class WorkerDiscovery {
 public:
  // `pools` must outlive this object.
  WorkerDiscovery(const DispatcherOptions& options, WorkerPools& pools);
  ~WorkerDiscovery();

  // Sets the static members, then starts the thread (its first round runs at once).
  void start();
  void stop();
  // Runs one membership refresh and one probe round on the calling thread (the thread's loop
  // body; exposed for tests and for a first round before start()).
  void run_round(bool force_resolve);

 private:
  void loop();
  void refresh_members(bool force_resolve);
  void probe_all();

  const DispatcherOptions options_;
  WorkerPools& pools_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::chrono::steady_clock::time_point resolved_at_[kNumPoolRoles]{};
  std::vector<std::string> resolved_[kNumPoolRoles];
};

}  // namespace cleave::router
