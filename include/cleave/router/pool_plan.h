// The pools `cleave serve` runs (issue 6): which pools the mode needs, which of them serve starts
// as child processes (no pools.<pool>.workers or .dns given), and the `cleave worker` command
// line of each child (worker_supervisor.h starts them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cleave/common/config.h"
#include "cleave/common/status.h"
#include "cleave/router/dispatch_options.h"
#include "cleave/router/router_settings.h"
#include "cleave/router/worker_supervisor.h"

namespace cleave::router {

struct PoolPlan {
  std::string name;                  // "prefill", "decode", "unified"
  PoolSettings* settings = nullptr;  // in the serve command's configuration
  bool started_here = false;         // no workers / dns given: serve starts `replicas` children
};

// The pools of `mode`, each started here unless the configuration names its workers.
std::vector<PoolPlan> plan_pools(PoolsSettings& pools, DispatchMode mode);

// InvalidArgument naming the settings when a pool started here has no replicas.
Status check_pools(const std::vector<PoolPlan>& pools);

// "disaggregated: 1 prefill worker, 1 decode worker" (for the serving line).
std::string describe_plan(DispatchMode mode, const std::vector<PoolPlan>& pools);

// What every child gets besides its pool's settings.
struct WorkerLaunch {
  std::string model_path;
  int64_t engine_threads = 0;      // engine.threads; 0 (and no pool threads): share the CPUs
  std::string transfer_provider;   // transfer.provider; "auto" or "": shm between the children
};

// One spec per child of the pools started here: `cleave worker --role POOL --id POOL-I --model
// PATH` and a --set for each setting given to serve (file or flags, not env: the children
// inherit it) that is not the router's, the pools', the worker identity's or the model's, then
// the pool's engine settings (threads always; the others when set) and, between prefill and
// decode, transfer.provider=shm when the provider is auto.
std::vector<WorkerProcessSpec> worker_specs(const SettingsRegistry& registry,
                                            const std::vector<PoolPlan>& pools,
                                            const WorkerLaunch& launch);

// The router dials the children serve started: their addresses become the pools' workers.
void name_started_workers(const WorkerSupervisor& supervisor, const std::vector<PoolPlan>& pools);

}  // namespace cleave::router
