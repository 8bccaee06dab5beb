// Names and validation of the dispatch settings.
#include "cleave/router/dispatch_options.h"

#include "cleave/common/listen_address.h"
#include "fmt/format.h"

namespace cleave::router {

std::string_view dispatch_mode_name(DispatchMode mode) {
  switch (mode) {
    case DispatchMode::kUnified: return "unified";
    case DispatchMode::kDisaggregated: return "disaggregated";
  }
  return "unknown";
}

std::string_view dispatch_policy_name(DispatchPolicyKind policy) {
  switch (policy) {
    case DispatchPolicyKind::kRoundRobin: return "round_robin";
    case DispatchPolicyKind::kLeastLoaded: return "least_loaded";
    case DispatchPolicyKind::kPrefixAware: return "prefix_aware";
  }
  return "unknown";
}

Result<DispatchMode> parse_dispatch_mode(std::string_view name) {
  for (DispatchMode m : {DispatchMode::kUnified, DispatchMode::kDisaggregated}) {
    if (name == dispatch_mode_name(m)) return m;
  }
  return InvalidArgument(
      fmt::format("unknown dispatch mode '{}' (choose unified or disaggregated)", name));
}

Result<DispatchPolicyKind> parse_dispatch_policy(std::string_view name) {
  for (DispatchPolicyKind p : {DispatchPolicyKind::kRoundRobin, DispatchPolicyKind::kLeastLoaded,
                               DispatchPolicyKind::kPrefixAware}) {
    if (name == dispatch_policy_name(p)) return p;
  }
  return InvalidArgument(fmt::format(
      "unknown dispatch policy '{}' (choose round_robin, least_loaded or prefix_aware)", name));
}

namespace {

Status validate_pool(std::string_view pool, const WorkerPoolOptions& p) {
  if (p.empty()) {
    return InvalidArgument(fmt::format(
        "the {} pool has no workers: give a static list of HOST:PORT or a DNS name", pool));
  }
  for (const std::string& w : p.workers) {
    auto a = parse_listen_address(w);
    if (!a.ok()) return a.status().with_context(fmt::format("{} pool worker", pool));
    if (a->port == 0) {
      return InvalidArgument(fmt::format("{} pool worker '{}' has port 0 (give the port it listens on)",
                                         pool, w));
    }
  }
  if (!p.dns_name.empty()) {
    if (p.dns_port <= 0 || p.dns_port > 65535) {
      return InvalidArgument(fmt::format("{} pool: DNS name '{}' needs a port in 1-65535 (got {})",
                                         pool, p.dns_name, p.dns_port));
    }
    if (p.dns_refresh.count() <= 0) {
      return InvalidArgument(fmt::format("{} pool: dns_refresh must be > 0 ms", pool));
    }
  }
  return Status::Ok();
}

Status positive(std::string_view name, std::chrono::milliseconds v) {
  if (v.count() > 0) return Status::Ok();
  return InvalidArgument(fmt::format("{} must be > 0 ms (got {})", name, v.count()));
}

}  // namespace

Status validate_dispatcher_options(const DispatcherOptions& o) {
  if (o.mode == DispatchMode::kUnified) {
    CLEAVE_RETURN_IF_ERROR(validate_pool("unified", o.unified));
  } else {
    CLEAVE_RETURN_IF_ERROR(validate_pool("prefill", o.prefill));
    CLEAVE_RETURN_IF_ERROR(validate_pool("decode", o.decode));
  }
  CLEAVE_RETURN_IF_ERROR(positive("health_interval", o.health_interval));
  CLEAVE_RETURN_IF_ERROR(positive("timeouts.probe", o.timeouts.probe));
  if (o.probe_failures < 1) {
    return InvalidArgument(fmt::format("probe_failures must be >= 1 (got {})", o.probe_failures));
  }
  CLEAVE_RETURN_IF_ERROR(positive("timeouts.reserve", o.timeouts.reserve));
  CLEAVE_RETURN_IF_ERROR(positive("timeouts.prefill", o.timeouts.prefill));
  CLEAVE_RETURN_IF_ERROR(positive("timeouts.first_token", o.timeouts.first_token));
  CLEAVE_RETURN_IF_ERROR(positive("timeouts.stream_idle", o.timeouts.stream_idle));
  CLEAVE_RETURN_IF_ERROR(positive("timeouts.cleanup", o.timeouts.cleanup));
  if (o.lease.count() < 0) return InvalidArgument("lease must be >= 0 ms (0: the worker's default)");
  if (o.queue_limit < 1) {
    return InvalidArgument(fmt::format("queue_limit must be >= 1 (got {})", o.queue_limit));
  }
  if (o.prefill_queue_tokens < 0) {
    return InvalidArgument(fmt::format("prefill_queue_tokens must be >= 0 (0: no limit; got {})",
                                       o.prefill_queue_tokens));
  }
  if (o.max_attempts < 1) {
    return InvalidArgument(fmt::format("max_attempts must be >= 1 (got {})", o.max_attempts));
  }
  if (o.max_migrations < 0) {
    return InvalidArgument(
        fmt::format("max_migrations must be >= 0 (got {})", o.max_migrations));
  }
  if (o.prefix_block_size < 0) {
    return InvalidArgument("prefix_block_size must be >= 0 (0: the workers' KV block size)");
  }
  if (o.prefix_blocks_per_worker < 1) {
    return InvalidArgument("prefix_blocks_per_worker must be >= 1");
  }
  if (o.prefix_load_slack < 0) return InvalidArgument("prefix_load_slack must be >= 0");
  return Status::Ok();
}

}  // namespace cleave::router
