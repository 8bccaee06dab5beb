#include "router_bench_child.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>

#include "fmt/format.h"

namespace cleave::bench {
namespace {

using Clock = std::chrono::steady_clock;

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("killed by signal {}", WTERMSIG(status));
  return "stopped";
}

}  // namespace

std::unique_ptr<ChildProcess> ChildProcess::start(const std::string& name,
                                                  const std::vector<std::string>& argv,
                                                  Clock::time_point deadline, std::string* error) {
  std::unique_ptr<ChildProcess> c(new ChildProcess());
  c->name_ = name;
  std::string log_template = "/tmp/router-bench-XXXXXX.log";
  const int log_fd = ::mkstemps(log_template.data(), 4);
  if (log_fd < 0) {
    *error = fmt::format("{}: cannot create a log file: {}", name, std::strerror(errno));
    return nullptr;
  }
  // Unlinked at once: no file stays behind whatever way the bench ends; read through log_fd_.
  ::unlink(log_template.c_str());
  c->log_fd_ = ::fcntl(log_fd, F_DUPFD_CLOEXEC, 3);
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) {
    ::close(log_fd);
    *error = fmt::format("{}: pipe: {}", name, std::strerror(errno));
    return nullptr;
  }
  // Everything the child needs is prepared here: after fork it may only make system calls.
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the bench died before prctl
    const int null_fd = ::open("/dev/null", O_RDONLY);
    if (null_fd < 0 || ::dup2(null_fd, 0) < 0 || ::dup2(out[1], 1) < 0 || ::dup2(log_fd, 2) < 0) {
      ::_exit(127);
    }
    ::execv(args[0], args.data());
    const char msg[] = "router_bench: exec failed\n";
    (void)!::write(2, msg, sizeof(msg) - 1);
    ::_exit(127);
  }
  ::close(out[1]);
  ::close(log_fd);
  if (pid < 0) {
    ::close(out[0]);
    *error = fmt::format("{}: fork: {}", name, std::strerror(errno));
    return nullptr;
  }
  c->pid_ = pid;
  c->stdout_fd_ = out[0];

  static const std::string kMarker = " listening on ";
  std::string buf;
  std::string why;
  for (;;) {
    const size_t nl = buf.find('\n');
    if (nl != std::string::npos) {
      const std::string line = buf.substr(0, nl);
      buf.erase(0, nl + 1);
      const size_t m = line.find(kMarker);
      if (m != std::string::npos) {
        c->listening_on_ = line.substr(m + kMarker.size());
        break;
      }
      continue;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      why = "did not print its listening line before the deadline";
      break;
    }
    pollfd p{c->stdout_fd_, POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (r < 0 && errno != EINTR) {
      why = fmt::format("poll: {}", std::strerror(errno));
      break;
    }
    if (r <= 0) continue;
    char chunk[4096];
    const ssize_t n = ::read(c->stdout_fd_, chunk, sizeof(chunk));
    if (n <= 0) {
      int status = 0;
      if (::waitpid(pid, &status, 0) == pid) {
        c->reaped_ = true;
        c->exit_status_ = status;
      }
      why = c->reaped_ ? describe_status(status) + " before listening" : "closed its stdout";
      break;
    }
    buf.append(chunk, static_cast<size_t>(n));
  }
  if (c->listening_on_.empty()) {
    c->stop();
    *error = fmt::format("{} ({}) {}\n--- its stderr:\n{}", name, argv.front(), why, c->stderr_tail());
    return nullptr;
  }
  // Keeps reading so that the child never blocks on a full pipe; ends at its exit.
  c->drain_ = std::thread([fd = c->stdout_fd_] {
    char chunk[4096];
    while (::read(fd, chunk, sizeof(chunk)) > 0) {
    }
  });
  return c;
}

bool ChildProcess::running() {
  if (reaped_ || pid_ <= 0) return false;
  int status = 0;
  if (::waitpid(pid_, &status, WNOHANG) == pid_) {
    reaped_ = true;
    exit_status_ = status;
    return false;
  }
  return true;
}

std::string ChildProcess::stderr_tail(int lines) const {
  std::string text;
  if (log_fd_ >= 0) {
    char buf[65536];
    const off_t size = ::lseek(log_fd_, 0, SEEK_END);
    const off_t from = std::max<off_t>(0, size - static_cast<off_t>(sizeof(buf)));
    const ssize_t n = ::pread(log_fd_, buf, sizeof(buf), from);
    if (n > 0) text.assign(buf, static_cast<size_t>(n));
  }
  std::deque<std::string> tail;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    tail.push_back(text.substr(pos, nl - pos));
    pos = nl + 1;
    if (static_cast<int>(tail.size()) > lines) tail.pop_front();
  }
  if (tail.empty()) return "(empty)";
  std::string out;
  for (const auto& l : tail) out += l + "\n";
  if (reaped_) out += fmt::format("({} {})\n", name_, describe_status(exit_status_));
  return out;
}

void ChildProcess::stop() {
  if (pid_ > 0 && !reaped_) {
    ::kill(pid_, SIGTERM);
    const auto until = Clock::now() + std::chrono::seconds(10);
    int status = 0;
    for (;;) {
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_ || (r < 0 && errno != EINTR)) break;
      if (Clock::now() >= until) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        break;
      }
      ::usleep(10 * 1000);
    }
    reaped_ = true;
    exit_status_ = status;
  }
}

double cpu_seconds(pid_t pid, const std::string& thread) {
  namespace fs = std::filesystem;
  auto read_stat = [](const fs::path& stat) -> double {
    std::FILE* f = std::fopen(stat.c_str(), "r");
    if (f == nullptr) return -1;
    char buf[1024] = {};
    const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    const std::string text(buf, n);
    const size_t close = text.rfind(')');
    if (close == std::string::npos) return -1;
    // Fields after the command: state is field 3; utime and stime are fields 14 and 15.
    std::vector<std::string> fields;
    size_t pos = close + 2;
    while (pos < text.size() && fields.size() < 13) {
      const size_t sp = text.find(' ', pos);
      fields.push_back(text.substr(pos, sp - pos));
      if (sp == std::string::npos) break;
      pos = sp + 1;
    }
    if (fields.size() < 13) return -1;
    return (std::atof(fields[11].c_str()) + std::atof(fields[12].c_str())) /
           static_cast<double>(sysconf(_SC_CLK_TCK));
  };
  const fs::path proc = fs::path("/proc") / std::to_string(pid);
  if (thread.empty()) return read_stat(proc / "stat");
  double total = -1;
  std::error_code ec;
  for (const auto& task : fs::directory_iterator(proc / "task", ec)) {
    std::FILE* f = std::fopen((task.path() / "comm").c_str(), "r");
    if (f == nullptr) continue;
    char name[64] = {};
    const bool got = std::fgets(name, sizeof(name), f) != nullptr;
    std::fclose(f);
    std::string comm = got ? name : "";
    if (!comm.empty() && comm.back() == '\n') comm.pop_back();
    if (comm != thread) continue;
    const double t = read_stat(task.path() / "stat");
    if (t >= 0) total = std::max(total, 0.0) + t;
  }
  return total;
}

ChildProcess::~ChildProcess() {
  stop();
  if (drain_.joinable()) drain_.join();
  if (stdout_fd_ >= 0) ::close(stdout_fd_);
  if (log_fd_ >= 0) ::close(log_fd_);
}

}  // namespace cleave::bench
