// router_bench's child processes: a `cleave worker` or `cleave router` started with fork+exec,
// PR_SET_PDEATHSIG(SIGKILL) so that it dies with the bench, stdout read for its "listening on"
// line (and drained after it), stderr in an unlinked temporary file whose tail explains a
// failure.
// The destructor stops it: SIGTERM, SIGKILL after 10 s, waitpid.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace cleave::bench {

class ChildProcess {
 public:
  // Starts argv (argv[0] a path) and waits until it prints a line with " listening on " or the
  // deadline passes. nullptr with `*error` (naming `name`, with its stderr tail) when it fails.
  static std::unique_ptr<ChildProcess> start(const std::string& name,
                                             const std::vector<std::string>& argv,
                                             std::chrono::steady_clock::time_point deadline,
                                             std::string* error);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // The text after " listening on " in its line.
  const std::string& listening_on() const { return listening_on_; }
  pid_t pid() const { return pid_; }
  bool running();
  // The last `lines` lines of its stderr.
  std::string stderr_tail(int lines = 30) const;

 private:
  ChildProcess() = default;
  void stop();

  std::string name_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int exit_status_ = 0;
  int stdout_fd_ = -1;
  int log_fd_ = -1;  // its stderr (a temporary file, already unlinked)
  std::string listening_on_;
  std::thread drain_;
};

// CPU seconds (user + system) of process `pid` from /proc, or of its threads named `thread`
// (the whole process when empty); -1 when unreadable.
double cpu_seconds(pid_t pid, const std::string& thread = "");

}  // namespace cleave::bench
