// `cleave worker --role prefill|decode|unified`: one worker process (DESIGN.md §1). Loads the
// model, starts the engine loop (and, for prefill and decode, the transfer engine with the KV
// pool registered), serves the control-plane gRPC service, and prints one line to stdout once
// serving: "cleave worker <role> <id> listening on <host>:<port>". SIGTERM drains it (health
// NOT_SERVING, no new requests, the running ones finish within worker.drain_seconds), SIGINT
// (or a second SIGTERM while draining) shuts it down at once; either way gracefully, exit 0.
// Before the model loads, the profile of worker.instance_type (else `default`) is applied and
// logged. Settings come from settings_flags.h: --config, --set key=value, and the flag of every
// setting in the settings table except the router's (router-only and unknown flags are errors).
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>

#include "cleave/cli/config.h"
#include "cleave/common/log.h"
#include "cleave/worker/worker_service.h"
#include "commands.h"
#include "fmt/format.h"
#include "settings_flags.h"

namespace cleave::cli {
namespace {

// 0 after a graceful shutdown, 1 when the worker could not start, 2 for bad settings.
int run_worker(SettingsFlags& flags) {
  Status s = load_settings_flags(flags);
  Config& config = flags.config;
  Result<std::string> profile = std::string();
  if (s.ok()) {
    profile = select_worker_profile(flags.registry, config.worker.instance_type,
                                    config.worker.role, config.worker.profile);
    s = profile.status();
  }
  if (s.ok()) s = parse_listen_address(config.worker.listen).status();
  if (!s.ok()) {
    std::fprintf(stderr, "cleave worker: %s\n", s.message().c_str());
    return 2;
  }
  if (config.worker.id.empty()) config.worker.id = fmt::format("{}-{}", config.worker.role, ::getpid());
  LogOptions log_opts;
  log_opts.level = config.log.level;
  log_opts.role = config.worker.role;
  log_opts.worker_id = config.worker.id;
  if (Status ls = init_logging(log_opts); !ls.ok()) {
    std::fprintf(stderr, "cleave worker: %s\n", ls.message().c_str());
    return 2;
  }

  log::info("worker {}: {}", config.worker.id, *profile);

  // Every thread started from here on (gRPC, engine, transfer) inherits the blocked signals;
  // this thread takes them with sigwait.
  // (An ignored signal never becomes pending: undo a SIG_IGN inherited from a shell.)
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGTERM, SIG_DFL);
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  Result<std::unique_ptr<WorkerServer>> server = WorkerServer::start(worker_part(config));
  if (!server.ok()) {
    log::error("cannot start: {}", server.status().to_string());
    std::fprintf(stderr, "cleave worker: %s\n", server.status().message().c_str());
    return server.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::printf("cleave worker %s %s listening on %s\n", config.worker.role.c_str(),
              (*server)->id().c_str(), (*server)->address().c_str());
  std::fflush(stdout);

  int sig = 0;
  while (sigwait(&stop_signals, &sig) != 0) {
  }
  if (sig == SIGTERM && config.worker.drain_seconds > 0) {
    log::info("signal SIGTERM: draining (worker.drain_seconds={})", config.worker.drain_seconds);
    const timespec no_wait{0, 0};
    (*server)->drain(std::chrono::seconds(config.worker.drain_seconds), [&] {
      const int again = sigtimedwait(&stop_signals, nullptr, &no_wait);
      if (again == SIGINT || again == SIGTERM) {
        log::info("signal {} while draining: stopping now", again == SIGINT ? "SIGINT" : "SIGTERM");
        return true;
      }
      return false;
    });
  } else {
    log::info("signal {}: shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
    (*server)->shutdown();
  }
  server->reset();
  return 0;
}

// Router settings have no flag here (a worker never reads them); an unknown flag, or a
// router-only one such as --port, is a CLI11 error naming it (exit 2).
bool is_worker_flag(const SettingsRegistry::Setting& s) { return s.key.rfind("router.", 0) != 0; }

}  // namespace

void add_worker_command(CLI::App& app, int* exit_code) {
  auto flags = std::make_shared<SettingsFlags>();
  auto* sub = app.add_subcommand(
      "worker", "Run a prefill, decode or unified worker (serves the control-plane gRPC API)");
  add_settings_flags(sub, flags, is_worker_flag);
  sub->callback([flags, exit_code] { *exit_code = run_worker(*flags); });
}

}  // namespace cleave::cli
