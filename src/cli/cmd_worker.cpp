// `cleave worker --role prefill|decode|unified`: one worker process (DESIGN.md §1). Loads the
// model, starts the engine loop (and, for prefill and decode, the transfer engine with the KV
// pool registered), serves the control-plane gRPC service, and prints one line to stdout once
// serving: "cleave worker <role> <id> listening on <host>:<port>". SIGTERM drains it (health
// NOT_SERVING, no new requests, the running ones finish within worker.drain_seconds), SIGINT
// (or a second SIGTERM while draining) shuts it down at once; either way gracefully, exit 0.
// Before the model loads, the profile of worker.instance_type (else `default`) is applied and
// logged. Every setting with a flag in the settings table is a flag here; --set key=value sets
// any other.
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cleave/common/config.h"
#include "cleave/common/log.h"
#include "cleave/worker/worker_service.h"
#include "commands.h"
#include "fmt/format.h"

namespace cleave::cli {
namespace {

struct WorkerCommand {
  Config config;
  SettingsRegistry registry;
  std::string config_file;
  std::vector<std::string> sets;
  // Setting key -> value given by its flag (only the flags that were given).
  std::map<std::string, std::string> flag_values;
};

// 0 after a graceful shutdown, 1 when the worker could not start, 2 for bad settings.
int run_worker(WorkerCommand& cmd) {
  Status s = load_config(cmd.registry, cmd.config_file, cmd.sets);
  for (const auto& [key, value] : cmd.flag_values) {
    if (!s.ok()) break;
    s = cmd.registry.set(key, value, "flag");
  }
  Config& config = cmd.config;
  Result<std::string> profile = std::string();
  if (s.ok()) {
    profile = select_worker_profile(cmd.registry, config);
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

  Result<std::unique_ptr<WorkerServer>> server = WorkerServer::start(config);
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

}  // namespace

void add_worker_command(CLI::App& app, int* exit_code) {
  auto cmd = std::make_shared<WorkerCommand>();
  register_settings(cmd->config, cmd->registry);
  auto* sub = app.add_subcommand(
      "worker", "Run a prefill, decode or unified worker (serves the control-plane gRPC API)");
  sub->add_option("--config", cmd->config_file, "YAML config file");
  sub->add_option("--set", cmd->sets, "Override a setting: key=value (repeatable)");
  for (const auto& setting : cmd->registry.settings()) {
    if (setting.flag.empty()) continue;
    const std::string key = setting.key;
    sub->add_option_function<std::string>(
           setting.flag,
           [cmd, key](const std::string& value) { cmd->flag_values[key] = value; },
           fmt::format("{} (setting {}, {})", setting.help, key, setting.type))
        ->type_name("VALUE");
  }
  sub->callback([cmd, exit_code] { *exit_code = run_worker(*cmd); });
}

}  // namespace cleave::cli
