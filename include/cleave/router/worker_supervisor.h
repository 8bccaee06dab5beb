// The worker processes of `cleave serve` (issue 6 "`cleave serve`"): each one a child running
// `cleave worker` (this same executable, /proc/self/exe), started with `--listen HOST:0`; its
// address is read from the one line it prints once serving ("cleave worker <role> <id>
// listening on <host>:<port>"). A child that dies is logged and restarted with exponential
// backoff on the same address, so that the router's probes see it leave and come back.
// stop() ends them all: SIGINT (a worker's immediate graceful shutdown; SIGTERM would make it
// drain for worker.drain_seconds, pointless once the router has stopped), then SIGKILL after a
// grace period.
//
// Children never outlive the supervisor: each is started with PR_SET_PDEATHSIG (SIGTERM) set
// for the supervisor's own thread, which is the one that starts and stops every child, so a
// supervisor that dies (even by SIGKILL) takes its children with it. Each child runs in its own
// process group (a terminal's Ctrl-C reaches only the supervising process, which stops them in
// order), with stdin on /dev/null, stdout on a pipe the supervisor reads (later lines are
// logged) and stderr shared with the supervising process.
//
// Threading: one thread, "serve-supervise", starts, watches, restarts and stops the children.
// Every method may be called from any thread; ChildEvent callbacks run on that thread and must
// not call stop().
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"

namespace cleave::router {

struct WorkerProcessSpec {
  std::string pool;  // "prefill", "decode" or "unified" (addresses() and logs)
  std::string id;    // unique among the specs, e.g. "decode-1"
  // Arguments after the program name, without --listen (the supervisor adds
  // "--listen <listen_host>:<port>"), e.g. {"worker", "--role", "decode", "--id", "decode-1"}.
  std::vector<std::string> args;
  std::string listen_host = "127.0.0.1";
};

// Something that happened to one child; `pid` is the child's process id.
struct ChildEvent {
  enum class Kind { kListening, kExited };
  Kind kind = Kind::kListening;
  std::string pool, id;
  pid_t pid = 0;
  std::string address;  // kListening: "host:port"
  std::string reason;   // kExited: "exit status N" / "killed by signal N (SIGKILL)"
  int restarts = 0;     // restarts of this child so far
};

struct SupervisorOptions {
  // The program each child runs; /proc/self/exe: exactly the binary that is running.
  std::string executable = "/proc/self/exe";
  // Longest a (re)started child may take to print its listening line before it is killed.
  std::chrono::milliseconds start_timeout{300000};
  // stop(): SIGINT, then SIGKILL for the children still alive after this.
  std::chrono::milliseconds stop_grace{10000};
  // Restart delays: initial, doubled per consecutive failure, at most max; a child that stayed
  // up for `stable_after` starts again from the initial delay.
  std::chrono::milliseconds restart_backoff{500};
  std::chrono::milliseconds restart_backoff_max{30000};
  std::chrono::milliseconds stable_after{30000};
  std::function<void(const ChildEvent&)> on_event;  // optional
};

class WorkerSupervisor {
 public:
  // Starts the thread, which starts every child; returns at once (wait_started()).
  // InvalidArgument for no spec, duplicate ids or an empty pool name.
  static Result<std::unique_ptr<WorkerSupervisor>> start(std::vector<WorkerProcessSpec> specs,
                                                         SupervisorOptions options);
  // stop().
  ~WorkerSupervisor();
  WorkerSupervisor(const WorkerSupervisor&) = delete;
  WorkerSupervisor& operator=(const WorkerSupervisor&) = delete;

  // Waits until every child has printed its listening line once (OK), one of them failed its
  // first start (the error names it and how it ended; the others are left running until
  // stop()), or `timeout` passed (DeadlineExceeded; call again to keep waiting).
  Status wait_started(std::chrono::milliseconds timeout);

  // "host:port" of the children of `pool`, in spec order (after wait_started() succeeded).
  std::vector<std::string> addresses(std::string_view pool) const;

  // Ends every child (SIGINT, stop_grace, SIGKILL), reaps them and joins the thread. No child
  // is restarted once stop() has begun. Idempotent.
  void stop();

 private:
  struct Impl;
  explicit WorkerSupervisor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cleave::router
