// A worker's metrics (rendered by GetMetrics in the Prometheus text format). Handlers update
// the histograms and counters directly (lock-free); engine-derived gauges and counters are
// refreshed from EngineLoop::stats() at scrape time.
//
// Thread-safety: everything may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "cleave/common/metrics.h"
#include "cleave/common/status.h"
#include "cleave/engine/gpu_monitor.h"
#include "cleave/worker/engine_loop.h"

namespace cleave::worker_service {

class WorkerMetrics {
 public:
  // Registers every family; Internal if the registry refuses one (a programming error).
  Status init();

  // One finished RPC, by method and gRPC code name ("OK", "UNAVAILABLE", ...).
  void count_rpc(std::string_view rpc, std::string_view code);
  // cleave:worker_info{worker_id, role, instance_type, profile, version} = 1: what this worker
  // is and which profile it applied (the labels are the point; the value is always 1).
  Status set_info(const std::string& worker_id, std::string_view role,
                  const std::string& instance_type, const std::string& profile,
                  std::string_view version);
  metrics::Gauge* draining = nullptr;  // 1 from SIGTERM on
  // 1 when KV transfers go through a host mirror of a GPU pool (no FI_HMEM): a slow path that
  // dashboards must show.
  metrics::Gauge* kv_transfer_staged = nullptr;

  metrics::Histogram* kv_handoff_tail_seconds = nullptr;
  metrics::Histogram* kv_transfer_seconds = nullptr;
  metrics::Counter* kv_transfer_bytes = nullptr;
  metrics::Counter* kv_handoffs_ok = nullptr;
  metrics::Counter* kv_handoffs_failed = nullptr;
  metrics::Histogram* time_to_first_token_seconds = nullptr;
  metrics::Histogram* e2e_request_seconds = nullptr;
  metrics::Histogram* kv_wait_seconds = nullptr;  // decode: Decode's wait for the notice
  metrics::Counter* notices_unmatched = nullptr;

  // Exports cleave:gpu_utilization_perc, cleave:gpu_memory_used_bytes and
  // cleave:gpu_memory_total_bytes {device, pci_bus_id} of the worker's GPU, read at each scrape.
  Status watch_gpu(std::unique_ptr<GpuMonitor> monitor);

  // Refreshes the engine-derived values from `s`, then renders everything.
  std::string render(const EngineStats& s, int64_t reservations_waiting);

 private:
  metrics::MetricsRegistry registry_;
  std::optional<metrics::Family<metrics::Counter>> rpcs_;

  metrics::Gauge* running_ = nullptr;
  metrics::Gauge* waiting_ = nullptr;
  metrics::Gauge* kv_usage_ = nullptr;
  metrics::Gauge* blocks_total_ = nullptr;
  metrics::Gauge* blocks_free_ = nullptr;
  metrics::Gauge* blocks_cached_ = nullptr;
  metrics::Gauge* blocks_used_ = nullptr;
  metrics::Gauge* blocks_reserved_ = nullptr;
  metrics::Gauge* blocks_pinned_ = nullptr;
  metrics::Gauge* blocks_held_ = nullptr;
  metrics::Gauge* reservations_ = nullptr;
  std::unique_ptr<GpuMonitor> gpu_;  // null without a GPU
  metrics::Gauge* gpu_utilization_ = nullptr;
  metrics::Gauge* gpu_memory_used_ = nullptr;
  metrics::Gauge* gpu_memory_total_ = nullptr;

  // Engine counters, advanced by the difference since the last scrape.
  struct EngineCounter {
    metrics::Counter* counter = nullptr;
    uint64_t seen = 0;
    void advance(uint64_t now);
  };
  std::mutex scrape_mu_;
  EngineCounter finished_, failed_, cancelled_, generated_, leases_expired_, leases_renewed_,
      released_,
      preemptions_, prefix_hits_;
};

}  // namespace cleave::worker_service
