#include "worker_metrics.h"

#include <vector>

#include "fmt/format.h"

namespace cleave::worker_service {
namespace {

template <typename T>
Status take(Result<T> r, std::optional<T>& out) {
  if (!r.ok()) return Internal(fmt::format("worker metrics: {}", r.status().message()));
  out.emplace(std::move(*r));
  return Status::Ok();
}

}  // namespace

void WorkerMetrics::EngineCounter::advance(uint64_t now) {
  if (now > seen) counter->inc(static_cast<double>(now - seen));
  seen = now;
}

Status WorkerMetrics::init() {
  using metrics::Counter;
  using metrics::Family;
  using metrics::Gauge;
  using metrics::Histogram;
  auto counter = [&](const char* name, const char* help, Counter** out) -> Status {
    std::optional<Family<Counter>> f;
    CLEAVE_RETURN_IF_ERROR(take(registry_.counter(name, help), f));
    *out = &f->get();
    return Status::Ok();
  };
  auto gauge = [&](const char* name, const char* help, Gauge** out) -> Status {
    std::optional<Family<Gauge>> f;
    CLEAVE_RETURN_IF_ERROR(take(registry_.gauge(name, help), f));
    *out = &f->get();
    return Status::Ok();
  };
  auto histogram = [&](const char* name, const char* help, Histogram** out) -> Status {
    std::optional<Family<Histogram>> f;
    CLEAVE_RETURN_IF_ERROR(
        take(registry_.histogram(name, help, metrics::latency_buckets_seconds()), f));
    *out = &f->get();
    return Status::Ok();
  };

  CLEAVE_RETURN_IF_ERROR(gauge("cleave:num_requests_running",
                               "Requests in the engine's running batch.", &running_));
  CLEAVE_RETURN_IF_ERROR(gauge("cleave:num_requests_waiting",
                               "Requests queued in the engine, not yet running.", &waiting_));
  CLEAVE_RETURN_IF_ERROR(gauge("cleave:kv_cache_usage_perc",
                               "Fraction of KV blocks held (1 = full).", &kv_usage_));
  CLEAVE_RETURN_IF_ERROR(gauge("cleave:worker_draining",
                               "1 while the worker drains (SIGTERM: no new requests, running ones "
                               "finish), else 0.",
                               &draining));
  CLEAVE_RETURN_IF_ERROR(gauge("cleave:kv_transfer_staged",
                               "1 when KV transfers of a GPU KV pool go through a pinned host "
                               "mirror (the transfer provider has no FI_HMEM), else 0.",
                               &kv_transfer_staged));
  CLEAVE_RETURN_IF_ERROR(gauge("cleave:kv_blocks_total", "KV blocks in the pool.", &blocks_total_));
  CLEAVE_RETURN_IF_ERROR(gauge("cleave:kv_blocks_free", "KV blocks free.", &blocks_free_));
  CLEAVE_RETURN_IF_ERROR(gauge("cleave:kv_blocks_cached",
                               "Unreferenced prefix-cache KV blocks (evictable).", &blocks_cached_));
  CLEAVE_RETURN_IF_ERROR(gauge("cleave:kv_blocks_used",
                               "KV blocks not back in the pool: held by requests, reservations "
                               "or transfers in flight.",
                               &blocks_used_));
  CLEAVE_RETURN_IF_ERROR(gauge("cleave:kv_blocks_reserved",
                               "KV blocks reserved for a prefill's KV (decode).", &blocks_reserved_));
  CLEAVE_RETURN_IF_ERROR(gauge("cleave:kv_blocks_pinned",
                               "KV blocks of ended prefills held until their transfer ends.",
                               &blocks_pinned_));
  CLEAVE_RETURN_IF_ERROR(gauge("cleave:kv_blocks_held",
                               "KV blocks of released or expired reservations, held until a late "
                               "write can no longer land (worker.kv_fence hold).",
                               &blocks_held_));
  CLEAVE_RETURN_IF_ERROR(gauge("cleave:kv_reservations",
                               "Reservations waiting for their KV (decode).", &reservations_));

  CLEAVE_RETURN_IF_ERROR(counter("cleave:request_success_total",
                                 "Requests finished (stop or length).", &finished_.counter));
  CLEAVE_RETURN_IF_ERROR(counter("cleave:request_failure_total", "Requests that failed.",
                                 &failed_.counter));
  CLEAVE_RETURN_IF_ERROR(counter("cleave:request_cancelled_total",
                                 "Requests cancelled (client gone, Abort, failed transfer).",
                                 &cancelled_.counter));
  CLEAVE_RETURN_IF_ERROR(counter("cleave:generation_tokens_total", "Tokens sampled.",
                                 &generated_.counter));
  CLEAVE_RETURN_IF_ERROR(counter("cleave:num_preemptions_total", "Sequences preempted.",
                                 &preemptions_.counter));
  CLEAVE_RETURN_IF_ERROR(counter("cleave:prefix_cache_hits_total",
                                 "Prompt tokens served by the prefix cache.", &prefix_hits_.counter));
  CLEAVE_RETURN_IF_ERROR(counter("cleave:kv_leases_expired_total",
                                 "Reservations whose lease ended before their KV arrived.",
                                 &leases_expired_.counter));
  CLEAVE_RETURN_IF_ERROR(counter("cleave:kv_leases_renewed_total",
                                 "Reservation leases renewed while their prefill waited or ran.",
                                 &leases_renewed_.counter));
  CLEAVE_RETURN_IF_ERROR(counter("cleave:kv_reservations_released_total",
                                 "Reservations given back unused (Release or Abort).",
                                 &released_.counter));

  CLEAVE_RETURN_IF_ERROR(histogram(
      "cleave:kv_handoff_tail_seconds",
      "Prefill: from the end of the last layer's compute to the KV being ready at the decode "
      "worker (the transfer time compute did not hide).",
      &kv_handoff_tail_seconds));
  CLEAVE_RETURN_IF_ERROR(histogram("cleave:kv_transfer_seconds",
                                   "Prefill: from the first KV write to the notice's completion.",
                                   &kv_transfer_seconds));
  CLEAVE_RETURN_IF_ERROR(counter("cleave:kv_transfer_bytes_total",
                                 "Prefill: KV bytes written to decode workers.", &kv_transfer_bytes));
  CLEAVE_RETURN_IF_ERROR(counter("cleave:kv_handoffs_total",
                                 "Prefill: KV handoffs completed (notice placed).", &kv_handoffs_ok));
  CLEAVE_RETURN_IF_ERROR(counter("cleave:kv_handoff_failures_total",
                                 "Prefill: KV handoffs that failed (transfer error, timeout, "
                                 "destination gone).",
                                 &kv_handoffs_failed));
  CLEAVE_RETURN_IF_ERROR(counter("cleave:kv_notices_unmatched_total",
                                 "Decode: notices whose reservation had already ended.",
                                 &notices_unmatched));
  CLEAVE_RETURN_IF_ERROR(histogram("cleave:kv_wait_seconds",
                                   "Decode: from the Decode call to its KV being in place.",
                                   &kv_wait_seconds));
  CLEAVE_RETURN_IF_ERROR(histogram("cleave:time_to_first_token_seconds",
                                   "Prefill and unified: from the RPC to the first token.",
                                   &time_to_first_token_seconds));
  CLEAVE_RETURN_IF_ERROR(histogram("cleave:e2e_request_latency_seconds",
                                   "From the RPC to the request's end on this worker.",
                                   &e2e_request_seconds));

  std::optional<metrics::Family<Counter>> rpcs;
  CLEAVE_RETURN_IF_ERROR(take(registry_.counter("cleave:worker_rpcs_total",
                                                "Control-plane RPCs served, by method and status.",
                                                {"rpc", "code"}),
                              rpcs));
  rpcs_ = std::move(rpcs);
  return Status::Ok();
}

Status WorkerMetrics::set_info(const std::string& worker_id, std::string_view role,
                               const std::string& instance_type, const std::string& profile,
                               std::string_view version) {
  std::optional<metrics::Family<metrics::Gauge>> info;
  CLEAVE_RETURN_IF_ERROR(
      take(registry_.gauge("cleave:worker_info",
                           "The worker's identity, its node's instance type "
                           "and the profile it applied (value 1).",
                           {"worker_id", "role", "instance_type", "profile", "version"}),
           info));
  info->with({worker_id, std::string(role), instance_type, profile, std::string(version)}).set(1);
  return Status::Ok();
}

void WorkerMetrics::count_rpc(std::string_view rpc, std::string_view code) {
  if (!rpcs_) return;
  rpcs_->with({std::string(rpc), std::string(code)}).inc();
}

std::string WorkerMetrics::render(const EngineStats& s, int64_t reservations_waiting) {
  {
    std::lock_guard<std::mutex> lock(scrape_mu_);
    running_->set(static_cast<double>(s.running));
    waiting_->set(static_cast<double>(s.waiting));
    kv_usage_->set(s.blocks_total > 0 ? static_cast<double>(s.blocks_used) /
                                            static_cast<double>(s.blocks_total)
                                      : 0.0);
    blocks_total_->set(static_cast<double>(s.blocks_total));
    blocks_free_->set(static_cast<double>(s.blocks_free));
    blocks_cached_->set(static_cast<double>(s.blocks_cached));
    blocks_used_->set(static_cast<double>(s.blocks_used));
    blocks_reserved_->set(static_cast<double>(s.blocks_reserved));
    blocks_pinned_->set(static_cast<double>(s.blocks_pinned));
    blocks_held_->set(static_cast<double>(s.blocks_held));
    reservations_->set(static_cast<double>(reservations_waiting));
    finished_.advance(s.requests_finished);
    failed_.advance(s.requests_failed);
    cancelled_.advance(s.requests_cancelled);
    generated_.advance(s.tokens_generated);
    preemptions_.advance(s.scheduler.preemptions);
    prefix_hits_.advance(s.scheduler.prompt_tokens_cached);
    leases_expired_.advance(s.leases_expired);
    leases_renewed_.advance(s.leases_renewed);
    released_.advance(s.reservations_released);
    if (gpu_) {
      // A failed read leaves the last figures (NVML errors are rare and transient: a reset).
      if (auto g = gpu_->sample(); g.ok()) {
        gpu_utilization_->set(g->utilization);
        gpu_memory_used_->set(static_cast<double>(g->memory_used));
        gpu_memory_total_->set(static_cast<double>(g->memory_total));
      }
    }
  }
  return registry_.render();
}

Status WorkerMetrics::watch_gpu(std::unique_ptr<GpuMonitor> monitor) {
  const std::vector<std::string> labels{"device", "pci_bus_id"};
  const std::vector<std::string> values{std::to_string(monitor->cuda_ordinal()),
                                        monitor->pci_bus_id()};
  std::optional<metrics::Family<metrics::Gauge>> u, used, total;
  CLEAVE_RETURN_IF_ERROR(take(registry_.gauge("cleave:gpu_utilization_perc",
                                              "Fraction of NVML's last sample period in which a "
                                              "kernel ran on the worker's GPU (0..1).",
                                              labels),
                              u));
  CLEAVE_RETURN_IF_ERROR(take(registry_.gauge("cleave:gpu_memory_used_bytes",
                                              "Memory in use on the worker's GPU (every process), "
                                              "from NVML.",
                                              labels),
                              used));
  CLEAVE_RETURN_IF_ERROR(take(registry_.gauge("cleave:gpu_memory_total_bytes",
                                              "Memory of the worker's GPU, from NVML.", labels),
                              total));
  std::lock_guard<std::mutex> lock(scrape_mu_);
  gpu_utilization_ = &u->with(values);
  gpu_memory_used_ = &used->with(values);
  gpu_memory_total_ = &total->with(values);
  gpu_ = std::move(monitor);
  return Status::Ok();
}

}  // namespace cleave::worker_service
