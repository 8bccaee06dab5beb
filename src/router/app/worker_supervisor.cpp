// WorkerSupervisor: starts `cleave worker` children, reads their listening lines, restarts the
// ones that die (same address, exponential backoff) and stops them all.
#include "cleave/router/worker_supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "cleave/common/listen_address.h"
#include "cleave/common/log.h"
#include "cleave/common/thread_pool.h"
#include "fmt/format.h"

namespace cleave::router {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr std::string_view kListeningMarker = " listening on ";

std::string describe_wait_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exit status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return fmt::format("killed by signal {} (SIG{})", sig, name ? name : "?");
  }
  return fmt::format("wait status {}", status);
}

std::string join_host_port(const std::string& host, int port) {
  if (host.find(':') != std::string::npos && host.front() != '[') {
    return fmt::format("[{}]:{}", host, port);
  }
  return fmt::format("{}:{}", host, port);
}

enum class ChildState { kStarting, kRunning, kBackoff, kFailed };

struct Child {
  WorkerProcessSpec spec;
  ChildState state = ChildState::kBackoff;
  pid_t pid = 0;
  int out_fd = -1;      // read end of the child's stdout
  std::string out_buf;  // partial line
  int port = 0;         // 0 until the first listening line; reused by restarts
  std::string address;  // "host:port" as the child printed it
  bool ever_listened = false;
  int restarts = 0;
  Clock::time_point started_at{};
  Clock::time_point deadline{};  // kStarting: start_timeout; kBackoff: next start
  milliseconds backoff{0};
  bool start_timed_out = false;
};

}  // namespace

struct WorkerSupervisor::Impl {
  SupervisorOptions options;
  std::vector<Child> children;  // touched only by the thread, except under `mu` as noted
  pid_t self_pid = 0;
  int devnull = -1;
  int wake[2] = {-1, -1};

  mutable std::mutex mu;
  std::condition_variable cv;
  bool stop_requested = false;         // under mu
  bool finished = false;               // under mu: the thread has stopped every child
  size_t listened_once = 0;            // under mu
  Status first_failure;                // under mu
  std::vector<std::string> addresses;  // under mu, per child
  std::thread thread;

  ~Impl() {
    if (devnull >= 0) ::close(devnull);
    for (int fd : wake) {
      if (fd >= 0) ::close(fd);
    }
  }

  void emit(const Child& c, ChildEvent::Kind kind, std::string reason) {
    if (!options.on_event) return;
    ChildEvent e;
    e.kind = kind;
    e.pool = c.spec.pool;
    e.id = c.spec.id;
    e.pid = c.pid;
    e.address = c.address;
    e.reason = std::move(reason);
    e.restarts = c.restarts;
    options.on_event(e);
  }

  bool stopping() const {
    std::lock_guard<std::mutex> lock(mu);
    return stop_requested;
  }

  // fork + exec of one child; async-signal-safe calls only between the two.
  Status spawn(Child& c) {
    int out[2];
    if (::pipe2(out, O_CLOEXEC) != 0) {
      return Internal(fmt::format("pipe2: {}", std::strerror(errno)));
    }
    std::vector<std::string> args;
    args.reserve(c.spec.args.size() + 3);
    args.push_back("cleave");
    args.insert(args.end(), c.spec.args.begin(), c.spec.args.end());
    args.push_back("--listen");
    args.push_back(join_host_port(c.spec.listen_host, c.port));
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const char* exe = options.executable.c_str();
    const pid_t parent = self_pid;
    const int null_fd = devnull;

    const pid_t pid = ::fork();
    if (pid < 0) {
      const int err = errno;
      ::close(out[0]);
      ::close(out[1]);
      return Unavailable(fmt::format("fork: {}", std::strerror(err)));
    }
    if (pid == 0) {
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      sigaction(SIGPIPE, &dfl, nullptr);
      // stop() sends SIGINT, which a shell may have set to be ignored (a background job).
      sigaction(SIGINT, &dfl, nullptr);
      sigaction(SIGTERM, &dfl, nullptr);
      ::setpgid(0, 0);
      if (::prctl(PR_SET_PDEATHSIG, SIGTERM) != 0) ::_exit(127);
      if (::getppid() != parent) ::_exit(127);  // the supervisor died before prctl
      if (::dup2(null_fd, STDIN_FILENO) < 0 || ::dup2(out[1], STDOUT_FILENO) < 0) ::_exit(127);
      ::execv(exe, argv.data());
      static const char kMsg[] = "cleave serve: cannot exec the worker binary\n";
      [[maybe_unused]] ssize_t w = ::write(STDERR_FILENO, kMsg, sizeof(kMsg) - 1);
      ::_exit(127);
    }
    ::close(out[1]);
    ::fcntl(out[0], F_SETFL, ::fcntl(out[0], F_GETFL) | O_NONBLOCK);
    c.pid = pid;
    c.out_fd = out[0];
    c.out_buf.clear();
    c.state = ChildState::kStarting;
    c.started_at = Clock::now();
    c.deadline = c.started_at + options.start_timeout;
    c.start_timed_out = false;
    log::info("serve: started worker {} (pid {}): {} {}", c.spec.id, pid, options.executable,
              fmt::join(args.begin() + 1, args.end(), " "));
    return Status::Ok();
  }

  void on_line(size_t index, std::string_view line) {
    Child& c = children[index];
    const size_t at = line.find(kListeningMarker);
    if (c.state == ChildState::kStarting && line.rfind("cleave worker ", 0) == 0 &&
        at != std::string_view::npos) {
      const std::string_view addr_text = line.substr(at + kListeningMarker.size());
      auto addr = parse_listen_address(addr_text);
      if (addr.ok() && addr->port > 0) {
        c.port = addr->port;
        c.address = std::string(addr_text);
        c.state = ChildState::kRunning;
        log::info("serve: worker {} (pid {}) listening on {}", c.spec.id, c.pid, c.address);
        if (!c.ever_listened) {
          c.ever_listened = true;
          std::lock_guard<std::mutex> lock(mu);
          addresses[index] = c.address;
          ++listened_once;
          cv.notify_all();
        }
        emit(c, ChildEvent::Kind::kListening, "");
        return;
      }
    }
    log::info("serve: worker {} says: {}", c.spec.id, line);
  }

  // Reads what the child's stdout has; closes it at end of file.
  void drain(size_t index) {
    Child& c = children[index];
    char buf[4096];
    for (;;) {
      const ssize_t n = ::read(c.out_fd, buf, sizeof(buf));
      if (n > 0) {
        c.out_buf.append(buf, static_cast<size_t>(n));
        size_t nl;
        while ((nl = c.out_buf.find('\n')) != std::string::npos) {
          std::string line = c.out_buf.substr(0, nl);
          c.out_buf.erase(0, nl + 1);
          on_line(index, line);
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      ::close(c.out_fd);  // end of file or an error
      c.out_fd = -1;
      return;
    }
  }

  void on_exit(size_t index, int wait_status) {
    Child& c = children[index];
    if (c.out_fd >= 0) drain(index);
    if (c.out_fd >= 0) {
      ::close(c.out_fd);
      c.out_fd = -1;
    }
    std::string reason = describe_wait_status(wait_status);
    if (c.start_timed_out) {
      reason =
          fmt::format("no listening line within {} ms ({})", options.start_timeout.count(), reason);
    }
    const bool was_running = c.state == ChildState::kRunning;
    const pid_t pid = c.pid;
    emit(c, ChildEvent::Kind::kExited, reason);
    c.pid = 0;
    if (!c.ever_listened) {
      c.state = ChildState::kFailed;
      log::error("serve: worker {} (pid {}) ended before it was serving: {}", c.spec.id, pid,
                 reason);
      std::lock_guard<std::mutex> lock(mu);
      if (first_failure.ok()) {
        first_failure = Unavailable(
            fmt::format("worker {} ({} pool) ended before it was serving: {} (its log is above)",
                        c.spec.id, c.spec.pool, reason));
      }
      cv.notify_all();
      return;
    }
    const Clock::time_point now = Clock::now();
    if (was_running && now - c.started_at >= options.stable_after) c.backoff = milliseconds{0};
    c.backoff = c.backoff.count() == 0 ? options.restart_backoff
                                       : std::min(options.restart_backoff_max, c.backoff * 2);
    c.state = ChildState::kBackoff;
    c.deadline = now + c.backoff;
    log::warn("serve: worker {} (pid {}, {}) {}; restarting it on {} in {} ms", c.spec.id, pid,
              c.spec.pool, reason, c.address, c.backoff.count());
  }

  void reap() {
    for (size_t i = 0; i < children.size(); ++i) {
      Child& c = children[i];
      if (c.pid <= 0) continue;
      int status = 0;
      const pid_t r = ::waitpid(c.pid, &status, WNOHANG);
      if (r == c.pid) on_exit(i, status);
    }
  }

  void restart_due() {
    const Clock::time_point now = Clock::now();
    for (Child& c : children) {
      if (c.state == ChildState::kStarting && c.pid > 0 && now >= c.deadline &&
          !c.start_timed_out) {
        log::error("serve: worker {} (pid {}) printed no listening line within {} ms; killing it",
                   c.spec.id, c.pid, options.start_timeout.count());
        c.start_timed_out = true;
        ::kill(c.pid, SIGKILL);
      }
      if (c.state == ChildState::kBackoff && now >= c.deadline) {
        ++c.restarts;
        Status s = spawn(c);
        if (!s.ok()) {
          c.backoff = std::min(options.restart_backoff_max,
                               std::max(options.restart_backoff, c.backoff * 2));
          c.deadline = now + c.backoff;
          log::error("serve: cannot restart worker {}: {}; next try in {} ms", c.spec.id,
                     s.to_string(), c.backoff.count());
        }
      }
    }
  }

  Clock::time_point next_deadline() const {
    Clock::time_point next = Clock::now() + milliseconds(100);
    for (const Child& c : children) {
      if ((c.state == ChildState::kStarting || c.state == ChildState::kBackoff) &&
          c.deadline < next) {
        next = c.deadline;
      }
    }
    return next;
  }

  void watch_once() {
    std::vector<pollfd> fds;
    std::vector<size_t> owner;
    fds.push_back({wake[0], POLLIN, 0});
    owner.push_back(children.size());
    for (size_t i = 0; i < children.size(); ++i) {
      if (children[i].out_fd >= 0) {
        fds.push_back({children[i].out_fd, POLLIN, 0});
        owner.push_back(i);
      }
    }
    const auto wait = std::chrono::duration_cast<milliseconds>(next_deadline() - Clock::now());
    const int timeout_ms = static_cast<int>(std::clamp<int64_t>(wait.count(), 0, 100));
    const int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (n > 0) {
      for (size_t k = 0; k < fds.size(); ++k) {
        if (fds[k].revents == 0) continue;
        if (owner[k] == children.size()) {
          char buf[64];
          while (::read(wake[0], buf, sizeof(buf)) > 0) {
          }
        } else if (children[owner[k]].out_fd >= 0) {
          drain(owner[k]);
        }
      }
    }
    reap();
  }

  void stop_children() {
    for (Child& c : children) {
      // SIGINT: shut down now (SIGTERM would drain, and the router has already stopped).
      if (c.pid > 0) ::kill(c.pid, SIGINT);
    }
    const Clock::time_point kill_at = Clock::now() + options.stop_grace;
    for (;;) {
      bool alive = false;
      for (size_t i = 0; i < children.size(); ++i) {
        Child& c = children[i];
        if (c.pid <= 0) continue;
        int status = 0;
        const pid_t r = ::waitpid(c.pid, &status, WNOHANG);
        if (r == c.pid || (r < 0 && errno == ECHILD)) {
          log::info("serve: worker {} (pid {}) stopped: {}", c.spec.id, c.pid,
                    describe_wait_status(status));
          if (c.out_fd >= 0) {
            ::close(c.out_fd);
            c.out_fd = -1;
          }
          c.pid = 0;
          continue;
        }
        alive = true;
      }
      if (!alive) break;
      if (Clock::now() >= kill_at) {
        for (Child& c : children) {
          if (c.pid <= 0) continue;
          log::warn("serve: worker {} (pid {}) still running {} ms after SIGINT; SIGKILL",
                    c.spec.id, c.pid, options.stop_grace.count());
          ::kill(c.pid, SIGKILL);
          int status = 0;
          while (::waitpid(c.pid, &status, 0) < 0 && errno == EINTR) {
          }
          if (c.out_fd >= 0) {
            ::close(c.out_fd);
            c.out_fd = -1;
          }
          c.pid = 0;
        }
        break;
      }
      std::this_thread::sleep_for(milliseconds(20));
    }
  }

  void run() {
    set_thread_name("serve-supervise");
    for (size_t i = 0; i < children.size(); ++i) {
      Status s = spawn(children[i]);
      if (!s.ok()) {
        children[i].state = ChildState::kFailed;
        std::lock_guard<std::mutex> lock(mu);
        if (first_failure.ok()) {
          first_failure =
              s.with_context(fmt::format("cannot start worker {}", children[i].spec.id));
        }
        cv.notify_all();
      }
    }
    while (!stopping()) {
      watch_once();
      if (!stopping()) restart_due();
    }
    stop_children();
    std::lock_guard<std::mutex> lock(mu);
    finished = true;
    cv.notify_all();
  }
};

WorkerSupervisor::WorkerSupervisor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

WorkerSupervisor::~WorkerSupervisor() {
  stop();
}

Result<std::unique_ptr<WorkerSupervisor>> WorkerSupervisor::start(
    std::vector<WorkerProcessSpec> specs, SupervisorOptions options) {
  if (specs.empty()) return InvalidArgument("no worker to start");
  std::set<std::string> ids;
  for (const auto& s : specs) {
    if (s.pool.empty() || s.id.empty()) {
      return InvalidArgument("every worker needs a pool name and an id");
    }
    if (!ids.insert(s.id).second) {
      return InvalidArgument(fmt::format("worker id '{}' is given twice", s.id));
    }
  }
  if (options.start_timeout.count() <= 0 || options.stop_grace.count() < 0 ||
      options.restart_backoff.count() <= 0 ||
      options.restart_backoff_max < options.restart_backoff) {
    return InvalidArgument(
        "supervisor timeouts: start_timeout and restart_backoff must be > 0, stop_grace >= 0, "
        "restart_backoff_max >= restart_backoff");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  impl->self_pid = ::getpid();
  impl->devnull = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  if (impl->devnull < 0) return Internal(fmt::format("open /dev/null: {}", std::strerror(errno)));
  if (::pipe2(impl->wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    return Internal(fmt::format("pipe2: {}", std::strerror(errno)));
  }
  impl->addresses.resize(specs.size());
  for (auto& s : specs) {
    Child c;
    c.spec = std::move(s);
    impl->children.push_back(std::move(c));
  }
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->run(); });
  return std::unique_ptr<WorkerSupervisor>(new WorkerSupervisor(std::move(impl)));
}

Status WorkerSupervisor::wait_started(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  const size_t n = impl_->children.size();
  impl_->cv.wait_for(lock, timeout, [&] {
    return !impl_->first_failure.ok() || impl_->listened_once == n || impl_->stop_requested;
  });
  if (!impl_->first_failure.ok()) return impl_->first_failure;
  if (impl_->listened_once == n) return Status::Ok();
  if (impl_->stop_requested) return Cancelled("the workers are being stopped");
  std::vector<std::string> waiting;
  for (size_t i = 0; i < n; ++i) {
    if (impl_->addresses[i].empty()) waiting.push_back(impl_->children[i].spec.id);
  }
  return DeadlineExceeded(fmt::format("{} of {} workers serving; waiting for {}",
                                      impl_->listened_once, n, fmt::join(waiting, ", ")));
}

std::vector<std::string> WorkerSupervisor::addresses(std::string_view pool) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<std::string> out;
  for (size_t i = 0; i < impl_->children.size(); ++i) {
    if (impl_->children[i].spec.pool == pool && !impl_->addresses[i].empty()) {
      out.push_back(impl_->addresses[i]);
    }
  }
  return out;
}

void WorkerSupervisor::stop() {
  if (!impl_) return;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop_requested = true;
  }
  impl_->cv.notify_all();
  const char one = 1;
  [[maybe_unused]] ssize_t w = ::write(impl_->wake[1], &one, 1);
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace cleave::router
