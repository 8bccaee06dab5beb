#include "cleave/router/pool_plan.h"

#include <algorithm>
#include <string_view>
#include <thread>

#include "fmt/format.h"

namespace cleave::router {
namespace {

// Settings a worker takes from the serve command line or file (the environment reaches it by
// inheritance): everything but the router's, the pools', the worker identity and the model.
bool forwarded_to_workers(const SettingsRegistry::Setting& s) {
  if (s.source == "default" || s.source.rfind("env", 0) == 0) return false;
  for (std::string_view prefix :
       {"router.", "pools.", "worker.role", "worker.listen", "worker.id", "model.path"}) {
    if (s.key.rfind(prefix, 0) == 0) return false;
  }
  return true;
}

}  // namespace

std::vector<PoolPlan> plan_pools(PoolsSettings& settings, DispatchMode mode) {
  std::vector<PoolPlan> pools;
  if (mode == DispatchMode::kUnified) {
    pools.push_back({"unified", &settings.unified});
  } else {
    pools.push_back({"prefill", &settings.prefill});
    pools.push_back({"decode", &settings.decode});
  }
  for (PoolPlan& p : pools) p.started_here = p.settings->workers.empty() && p.settings->dns.empty();
  return pools;
}

Status check_pools(const std::vector<PoolPlan>& pools) {
  for (const PoolPlan& p : pools) {
    if (p.started_here && p.settings->replicas < 1) {
      return InvalidArgument(fmt::format(
          "pools.{}.replicas is 0 and neither pools.{}.workers nor pools.{}.dns names workers",
          p.name, p.name, p.name));
    }
  }
  return Status::Ok();
}

std::string describe_plan(DispatchMode mode, const std::vector<PoolPlan>& pools) {
  std::string plan = std::string(dispatch_mode_name(mode)) + ":";
  for (const PoolPlan& p : pools) {
    plan += p.started_here ? fmt::format(" {} {} worker{}", p.settings->replicas, p.name,
                                         p.settings->replicas == 1 ? "" : "s")
                           : fmt::format(" the {} workers of the config", p.name);
    plan += p.name == pools.back().name ? "" : ",";
  }
  return plan;
}

std::vector<WorkerProcessSpec> worker_specs(const SettingsRegistry& registry,
                                            const std::vector<PoolPlan>& pools,
                                            const WorkerLaunch& launch) {
  int64_t children = 0;
  for (const PoolPlan& p : pools) {
    if (p.started_here) children += p.settings->replicas;
  }
  std::vector<std::string> common;
  for (const auto& s : registry.settings()) {
    if (forwarded_to_workers(s)) common.push_back(fmt::format("{}={}", s.key, s.get()));
  }
  const int64_t cpus = std::max<int64_t>(1, std::thread::hardware_concurrency());
  std::vector<WorkerProcessSpec> specs;
  for (const PoolPlan& p : pools) {
    if (!p.started_here) continue;
    const PoolSettings& ps = *p.settings;
    std::vector<std::string> sets = common;
    int64_t threads = ps.threads > 0 ? ps.threads : launch.engine_threads;
    if (threads == 0) threads = std::max<int64_t>(1, cpus / std::max<int64_t>(1, children));
    sets.push_back(fmt::format("engine.threads={}", threads));
    if (ps.kv_blocks > 0) sets.push_back(fmt::format("engine.kv_blocks={}", ps.kv_blocks));
    if (ps.kv_cache_bytes > 0) {
      sets.push_back(fmt::format("engine.kv_cache_bytes={}", ps.kv_cache_bytes));
    }
    if (ps.max_tokens_per_step > 0) {
      sets.push_back(fmt::format("engine.max_tokens_per_step={}", ps.max_tokens_per_step));
    }
    if (ps.max_num_seqs > 0) sets.push_back(fmt::format("engine.max_num_seqs={}", ps.max_num_seqs));
    // Every worker serve starts is on this machine: shared memory moves the KV.
    if (p.name != "unified" &&
        (launch.transfer_provider == "auto" || launch.transfer_provider.empty())) {
      sets.push_back("transfer.provider=shm");
    }
    for (int64_t i = 0; i < ps.replicas; ++i) {
      WorkerProcessSpec spec;
      spec.pool = p.name;
      spec.id = fmt::format("{}-{}", p.name, i);
      spec.args = {"worker", "--role", p.name, "--id", spec.id, "--model", launch.model_path};
      for (const std::string& s : sets) {
        spec.args.push_back("--set");
        spec.args.push_back(s);
      }
      specs.push_back(std::move(spec));
    }
  }
  return specs;
}

void name_started_workers(const WorkerSupervisor& supervisor, const std::vector<PoolPlan>& pools) {
  for (const PoolPlan& p : pools) {
    if (p.started_here) {
      p.settings->workers = fmt::format("{}", fmt::join(supervisor.addresses(p.name), ","));
    }
  }
}

}  // namespace cleave::router
