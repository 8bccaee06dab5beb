// `cleave router [--config FILE] [--port N] ...`: the router alone (router_app.h), against the
// workers the configuration names (pools.<pool>.workers or pools.<pool>.dns). Prints
// "cleave router listening on http://<host>:<port>/" once listening (/health answers 503 until
// the pools are ready); SIGINT / SIGTERM stop it (exit 0).
#include <signal.h>

#include <cstdio>
#include <memory>

#include "cleave/common/log.h"
#include "cleave/router/router_app.h"
#include "commands.h"
#include "settings_flags.h"

namespace cleave::cli {
namespace {

int run_router(SettingsFlags& flags) {
  if (Status s = load_settings_flags(flags); !s.ok()) {
    std::fprintf(stderr, "cleave router: %s\n", s.message().c_str());
    return 2;
  }
  const Config& config = flags.config;
  LogOptions log_opts;
  log_opts.level = config.log.level;
  log_opts.role = "router";
  if (Status s = init_logging(log_opts); !s.ok()) {
    std::fprintf(stderr, "cleave router: %s\n", s.message().c_str());
    return 2;
  }
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  auto app = router::RouterApp::start(router_part(config));
  if (!app.ok()) {
    std::fprintf(stderr, "cleave router: %s\n", app.status().message().c_str());
    return app.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  const std::string grpc = (*app)->grpc_target();
  std::printf("cleave router listening on %s (model '%s'%s%s)\n", (*app)->url().c_str(),
              (*app)->model_name().c_str(), grpc.empty() ? "" : ", gRPC API on ", grpc.c_str());
  std::fflush(stdout);
  int sig = 0;
  while (sigwait(&signals, &sig) != 0) {
  }
  log::info("router: {}: stopping", sig == SIGINT ? "SIGINT" : "SIGTERM");
  (*app)->stop();
  return 0;
}

}  // namespace

void add_router_command(CLI::App& app, int* exit_code) {
  auto flags = std::make_shared<SettingsFlags>();
  auto* sub = app.add_subcommand(
      "router", "Run the router (OpenAI API) against running workers named in the config");
  add_settings_flags(sub, flags, [](const SettingsRegistry::Setting& s) {
    return s.key.rfind("router.", 0) == 0 || s.key.rfind("model.", 0) == 0 ||
           s.key.rfind("log.", 0) == 0;
  });
  sub->callback([flags, exit_code] { *exit_code = run_router(*flags); });
}

}  // namespace cleave::cli
