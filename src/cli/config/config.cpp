#include "cleave/cli/config.h"

namespace cleave {

void register_settings(Config& c, SettingsRegistry& r) {
  register_log_settings(c.log, r);
  register_model_settings(c.model, r);
  register_engine_settings(c.engine, r);
  register_transfer_settings(c.transfer, r);
  register_worker_settings(c.worker, r);
  register_router_settings(c.router, r);
  register_pools_settings(c.pools, r);
}

WorkerConfig worker_part(const Config& c) {
  return WorkerConfig{c.model, c.engine, c.transfer, c.worker};
}

router::RouterAppConfig router_part(const Config& c) {
  router::RouterAppConfig out;
  out.model = c.model;
  out.router = c.router;
  out.pools = c.pools;
  out.max_context = c.engine.max_context;
  return out;
}

}  // namespace cleave
