// A worker's settings (worker.*) and what a worker process is configured with (WorkerConfig:
// the model, engine, transfer and worker parts).
#pragma once

#include <cstdint>
#include <string>

#include "cleave/common/config.h"
#include "cleave/engine/engine_settings.h"
#include "cleave/model/model_settings.h"
#include "cleave/transfer/transfer_settings.h"

namespace cleave {

// A worker process (`cleave worker`, src/worker/service).
struct WorkerSettings {
  std::string role = "unified";        // prefill | decode | unified
  std::string listen = "127.0.0.1:0";  // gRPC address; port 0 picks a free port
  std::string id;                      // empty: "<role>-<pid>"
  // How long a decode worker keeps blocks reserved for a prefill's KV (Reserve's lease_ms 0).
  int64_t lease_ms = 10000;
  // Decode worker: how a late KV write is kept out of blocks reused by another request.
  // revoke: a memory key per reservation, revoked when it ends; hold: the pool's one key, and a
  // released or expired reservation's blocks held until its lease deadline plus
  // transfer.completion_timeout_ms plus 1 s; auto: revoke where the provider can
  // (TransferEngine::revokes_keys: tcp, shm), else hold (efa, verbs).
  std::string kv_fence = "auto";
  // Longest a Prefill RPC waits for its prompt's compute (queueing included) before it fails.
  int64_t prefill_timeout_ms = 120000;
  // SIGTERM: stop taking requests (health NOT_SERVING), let running ones finish for at most
  // this long, then shut down.
  int64_t drain_seconds = 30;
  // HTTP port serving GET /metrics (Prometheus text) on the worker.listen host; -1: off,
  // 0: a free port.
  int64_t metrics_port = -1;
  // The node's instance type (node.kubernetes.io/instance-type), which selects the profile;
  // "@PATH" reads it from a file (select_worker_profile puts the value read here).
  std::string instance_type;
  // The profile select_worker_profile applied ("" for none). Not a setting.
  std::string profile;
};

// Binds worker.* to `registry` (the fields must outlive it).
void register_worker_settings(WorkerSettings& settings, SettingsRegistry& registry);

// The settings a worker process runs with (WorkerServer::start).
struct WorkerConfig {
  ModelSettings model;
  EngineSettings engine;
  TransferSettings transfer;
  WorkerSettings worker;
};

}  // namespace cleave
