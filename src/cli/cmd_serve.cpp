// `cleave serve [--model PATH] [--config FILE] [--port 8000]`: the whole server on one machine
// (issue 6 "`cleave serve`"). Starts the worker pools the configuration names as child
// processes (`cleave worker`, supervised and restarted: worker_supervisor.h), waits until every
// worker is healthy, runs the router in-process (router_app.h), prints the URL and a curl
// example, and on SIGINT / SIGTERM stops the router and every worker and exits 0.
//
// stdout carries one line per worker start ("worker <pool> <id> pid <pid> listening on
// <host>:<port>") and exit ("worker <pool> <id> pid <pid> exited: <how>"), then, once serving,
// "cleave serve listening on http://<host>:<port>/" and a curl example; logs go to stderr.
#include <signal.h>
#include <time.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/log.h"
#include "cleave/model/default_model.h"
#include "cleave/router/dispatch_options.h"
#include "cleave/router/pool_plan.h"
#include "cleave/router/router_app.h"
#include "cleave/router/worker_supervisor.h"
#include "commands.h"
#include "fmt/format.h"
#include "nlohmann/json.hpp"
#include "settings_flags.h"

namespace cleave::cli {
namespace {

using std::chrono::milliseconds;

constexpr milliseconds kHealthyTimeout{120000};

// True when SIGINT or SIGTERM arrived (they are blocked in every thread; taken here).
bool stop_signal_pending(const sigset_t& signals, milliseconds wait) {
  timespec ts{static_cast<time_t>(wait.count() / 1000),
              static_cast<long>((wait.count() % 1000) * 1000000)};
  const int sig = sigtimedwait(&signals, nullptr, &ts);
  if (sig == SIGINT || sig == SIGTERM) {
    log::info("serve: {}: stopping", sig == SIGINT ? "SIGINT" : "SIGTERM");
    return true;
  }
  return false;
}

void print_line(const std::string& line) {
  std::fputs(line.c_str(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

void print_serving(const router::RouterApp& app, const Config& config, const std::string& plan) {
  const std::string url = app.url();
  print_line(
      fmt::format("cleave serve listening on {} (model '{}', {})", url, app.model_name(), plan));
  nlohmann::json body = {{"model", app.model_name()},
                         {"messages", {{{"role", "user"}, {"content", "Tell me a story."}}}},
                         {"max_tokens", 64}};
  std::string auth;
  if (!router::split_comma_list(config.router.api_keys).empty()) {
    auth = " -H 'Authorization: Bearer YOUR_API_KEY'";
  }
  print_line(
      fmt::format("Try: curl {}v1/chat/completions -H 'Content-Type: application/json'{} "
                  "-d '{}'",
                  url, auth, body.dump()));
  if (const std::string grpc = app.grpc_target(); !grpc.empty()) {
    print_line(fmt::format("gRPC API (cleave.v1.Inference, proto/cleave/v1/inference.proto) on {}",
                           grpc));
  }
  print_line("Stop with Ctrl-C.");
}

// Prints "cleave serve: WHAT MESSAGE" and returns `code` (the process exit code).
int fail(int code, const Status& s, std::string_view what = "") {
  std::fprintf(stderr, "cleave serve: %.*s%s\n", static_cast<int>(what.size()), what.data(),
               s.message().c_str());
  return code;
}

// The settings (file, environment, --set, flags) and the logging they ask for.
Status load_serve_settings(SettingsFlags& flags) {
  CLEAVE_RETURN_IF_ERROR(load_settings_flags(flags));
  LogOptions log_opts;
  log_opts.level = flags.config.log.level;
  log_opts.role = "router";
  return init_logging(log_opts);
}

// Blocks SIGINT and SIGTERM: every thread started from here on inherits the blocked signals,
// and this thread takes them (stop_signal_pending). SIGPIPE is ignored.
sigset_t block_stop_signals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  return signals;
}

// No model.path: the embedded default model, served under its own name unless one is set.
Status use_default_model_if_none(Config& config) {
  if (!config.model.path.empty()) return Status::Ok();
  auto def = resolve_default_model();
  CLEAVE_RETURN_IF_ERROR(def.status());
  log::info("serve: no model given; serving the embedded default model {} as '{}'", def->path,
            def->served_name);
  config.model.path = def->path;
  if (config.router.served_model_name.empty()) config.router.served_model_name = def->served_name;
  return Status::Ok();
}

void print_child_event(const router::ChildEvent& e) {
  if (e.kind == router::ChildEvent::Kind::kListening) {
    print_line(fmt::format("worker {} {} pid {} listening on {}", e.pool, e.id, e.pid, e.address));
  } else {
    print_line(fmt::format("worker {} {} pid {} exited: {}", e.pool, e.id, e.pid, e.reason));
  }
}

// Starts the children and waits until every one listens. nullptr (and *stopped) when SIGINT or
// SIGTERM came first; the children are stopped then, and on an error.
Result<std::unique_ptr<router::WorkerSupervisor>> start_workers(
    std::vector<router::WorkerProcessSpec> specs, const sigset_t& signals, bool* stopped) {
  router::SupervisorOptions sup;
  sup.on_event = print_child_event;
  auto started = router::WorkerSupervisor::start(std::move(specs), std::move(sup));
  CLEAVE_RETURN_IF_ERROR(started.status());
  std::unique_ptr<router::WorkerSupervisor> supervisor = std::move(started).value();
  for (;;) {
    Status s = supervisor->wait_started(milliseconds(100));
    if (s.ok()) return supervisor;
    if (s.code() != StatusCode::kDeadlineExceeded) {
      supervisor->stop();
      return s;
    }
    if (stop_signal_pending(signals, milliseconds(0))) {
      supervisor->stop();
      *stopped = true;
      return std::unique_ptr<router::WorkerSupervisor>();
    }
  }
}

// Waits until every worker is healthy (at most kHealthyTimeout: then it serves with the ready
// ones). False when SIGINT or SIGTERM came first.
bool wait_until_healthy(router::RouterApp& app, const sigset_t& signals) {
  const auto healthy_by = std::chrono::steady_clock::now() + kHealthyTimeout;
  while (!app.wait_ready(milliseconds(100), /*all_workers=*/true)) {
    if (stop_signal_pending(signals, milliseconds(0))) return false;
    if (std::chrono::steady_clock::now() >= healthy_by) {
      log::warn(
          "serve: not every worker is healthy after {} s; serving with the ready ones "
          "(/health says when the pools are ready)",
          kHealthyTimeout.count() / 1000);
      return true;
    }
  }
  return true;
}

int run_serve(SettingsFlags& flags) {
  if (Status s = load_serve_settings(flags); !s.ok()) return fail(2, s);
  Config& config = flags.config;
  auto mode = router::parse_dispatch_mode(config.router.mode);
  if (!mode.ok()) return fail(2, mode.status(), "router.mode: ");
  const sigset_t signals = block_stop_signals();

  std::vector<router::PoolPlan> pools = router::plan_pools(config.pools, *mode);
  const std::string plan = router::describe_plan(*mode, pools);
  if (Status s = router::check_pools(pools); !s.ok()) return fail(2, s);
  if (Status s = use_default_model_if_none(config); !s.ok()) {
    return fail(1, s, "the default model: ");
  }
  std::vector<router::WorkerProcessSpec> specs = router::worker_specs(
      flags.registry, pools, {config.model.path, config.engine.threads, config.transfer.provider});

  std::unique_ptr<router::WorkerSupervisor> supervisor;
  if (!specs.empty()) {
    bool stopped = false;
    auto started = start_workers(std::move(specs), signals, &stopped);
    if (!started.ok()) return fail(1, started.status());
    if (stopped) return 0;
    supervisor = std::move(started).value();
    router::name_started_workers(*supervisor, pools);
  }

  auto app = router::RouterApp::start(router_part(config));
  if (!app.ok()) {
    const int code =
        fail(app.status().code() == StatusCode::kInvalidArgument ? 2 : 1, app.status());
    if (supervisor) supervisor->stop();
    return code;
  }
  if (wait_until_healthy(**app, signals)) {
    print_serving(**app, config, plan);
    while (!stop_signal_pending(signals, milliseconds(1000))) {
    }
  }
  (*app)->stop();
  if (supervisor) supervisor->stop();
  log::info("serve: stopped");
  return 0;
}

}  // namespace

void add_serve_command(CLI::App& app, int* exit_code) {
  auto flags = std::make_shared<SettingsFlags>();
  auto* sub = app.add_subcommand(
      "serve",
      "Serve the OpenAI API: start the worker pools as child processes and the router "
      "(default: one prefill and one decode worker on this machine, KV over shared memory)");
  add_settings_flags(sub, flags, [](const SettingsRegistry::Setting& s) {
    return s.key.rfind("worker.", 0) != 0;
  });
  sub->callback([flags, exit_code] { *exit_code = run_serve(*flags); });
}

}  // namespace cleave::cli
