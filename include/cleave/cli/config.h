// The whole configuration of the `cleave` command line, composed from each module's settings:
// common's log.*, model.*, engine.*, transfer.*, worker.*, router.* and pools.* (each module
// owns its struct and its registration). One registry holds them all, in this order (the order
// of the README's settings table and of `cleave config show`), with common's one precedence
// rule (cleave/common/config.h). Each subcommand hands a module only its parts: worker_part()
// to a worker, router_part() to the router.
#pragma once

#include "cleave/common/config.h"
#include "cleave/engine/engine_settings.h"
#include "cleave/model/model_settings.h"
#include "cleave/router/router_app.h"
#include "cleave/router/router_settings.h"
#include "cleave/transfer/transfer_settings.h"
#include "cleave/worker/worker_settings.h"

namespace cleave {

struct Config {
  LogSettings log;
  ModelSettings model;
  EngineSettings engine;
  TransferSettings transfer;
  WorkerSettings worker;
  RouterSettings router;
  PoolsSettings pools;
};

// Binds every field of `config` to `registry`, module by module.
void register_settings(Config& config, SettingsRegistry& registry);

// What a worker process runs with: model, engine, transfer and worker settings.
WorkerConfig worker_part(const Config& config);

// What the router runs with: router and pools settings, the model, and engine.max_context.
router::RouterAppConfig router_part(const Config& config);

}  // namespace cleave
