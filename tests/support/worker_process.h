// Helpers of the multi-process worker tests and of the benches (cleave::worker_process,
// header-only): a real `cleave worker` child process (posix_spawn, its address read from the
// line it prints when it listens), and running a `cleave` command to completion with its stdout
// captured. Every wait is bounded.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace cleave::worker_testing {

using Clock = std::chrono::steady_clock;

// Spawns argv[0] with stdout on a pipe (stdin from /dev/null, stderr inherited). -1 on failure.
inline pid_t spawn_with_stdout(const std::vector<std::string>& argv, int* stdout_fd) {
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return -1;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  close(out[1]);
  if (pid < 0) {
    close(out[0]);
    return -1;
  }
  *stdout_fd = out[0];
  return pid;
}

// Waits for `pid` to exit, at most `timeout`; SIGKILLs it after that. The exit status, or -1
// when it had to be killed.
inline int wait_exit(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (r < 0) return -1;
    if (Clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

struct CommandResult {
  int exit_code = -1;  // -1: killed after the timeout or not started
  std::string out;     // its stdout
};

// Runs a command to completion (at most `timeout`) and captures its stdout.
inline CommandResult run_command(const std::vector<std::string>& argv,
                                 std::chrono::milliseconds timeout) {
  CommandResult r;
  int fd = -1;
  const pid_t pid = spawn_with_stdout(argv, &fd);
  if (pid < 0) return r;
  const auto deadline = Clock::now() + timeout;
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    r.out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  r.exit_code = wait_exit(pid, std::max<std::chrono::milliseconds>(
                                   std::chrono::milliseconds(1),
                                   std::chrono::duration_cast<std::chrono::milliseconds>(
                                       deadline - Clock::now())));
  return r;
}

// `cleave worker --role ROLE --id ID --model MODEL --listen 127.0.0.1:0 --set K=V...`, ready
// once it printed "cleave worker <role> <id> listening on <host>:<port>". The destructor stops
// it with SIGINT, an immediate graceful shutdown (SIGTERM would drain it for
// worker.drain_seconds); SIGKILL when it has not exited within 10 s.
class WorkerProcess {
 public:
  struct Spec {
    std::string binary;  // the cleave executable
    std::string role;
    std::string id;
    std::string model;
    std::vector<std::string> settings;  // key=value, each passed as --set
  };

  // nullptr with `*error` set when it does not start or does not listen within `timeout`.
  static std::unique_ptr<WorkerProcess> start(const Spec& spec, std::chrono::milliseconds timeout,
                                              std::string* error) {
    std::vector<std::string> argv{spec.binary, "worker", "--role", spec.role, "--id", spec.id,
                                  "--model", spec.model, "--listen", "127.0.0.1:0"};
    for (const auto& s : spec.settings) {
      argv.push_back("--set");
      argv.push_back(s);
    }
    std::unique_ptr<WorkerProcess> w(new WorkerProcess());
    w->pid_ = spawn_with_stdout(argv, &w->stdout_fd_);
    if (w->pid_ < 0) {
      *error = "cannot spawn " + spec.binary;
      return nullptr;
    }
    w->reader_ = std::thread([p = w.get()] { p->read_loop(); });
    std::unique_lock<std::mutex> lock(w->mu_);
    w->cv_.wait_for(lock, timeout, [&] { return !w->address_.empty() || w->eof_; });
    if (w->address_.empty()) {
      *error = "the " + spec.role + " worker '" + spec.id + "' did not print its listening line " +
               (w->eof_ ? "(it exited)" : "within the timeout");
      return nullptr;  // the destructor reaps it
    }
    return w;
  }

  ~WorkerProcess() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGINT);
      wait_exit(pid_, std::chrono::seconds(10));
    }
    if (reader_.joinable()) reader_.join();
    if (stdout_fd_ >= 0) close(stdout_fd_);
  }

  const std::string& address() const { return address_; }
  pid_t pid() const { return pid_; }

  void kill_now() {
    if (pid_ <= 0 || reaped_) return;
    ::kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    reaped_ = true;
  }

 private:
  WorkerProcess() = default;

  // Reads stdout to EOF (so that the worker never blocks on a full pipe), catching the
  // listening line.
  void read_loop() {
    static const std::string kMarker = " listening on ";
    std::string buf;
    char chunk[4096];
    for (;;) {
      const ssize_t n = read(stdout_fd_, chunk, sizeof(chunk));
      if (n <= 0) break;
      buf.append(chunk, static_cast<size_t>(n));
      size_t pos;
      while ((pos = buf.find('\n')) != std::string::npos) {
        const std::string line = buf.substr(0, pos);
        buf.erase(0, pos + 1);
        const size_t m = line.find(kMarker);
        if (line.rfind("cleave worker ", 0) == 0 && m != std::string::npos) {
          std::lock_guard<std::mutex> lock(mu_);
          if (address_.empty()) address_ = line.substr(m + kMarker.size());
          cv_.notify_all();
        }
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    eof_ = true;
    cv_.notify_all();
  }

  pid_t pid_ = -1;
  bool reaped_ = false;
  int stdout_fd_ = -1;
  std::thread reader_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::string address_;
  bool eof_ = false;
};

}  // namespace cleave::worker_testing
