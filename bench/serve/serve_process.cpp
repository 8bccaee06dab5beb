// fork/exec of `cleave serve`, its listening line, its health, and its stop.
#include "serve_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "serve_client.h"

namespace cleave::bench {
namespace {

constexpr std::string_view kListening = "cleave serve listening on ";

}  // namespace

Result<std::unique_ptr<ServeProcess>> ServeProcess::start(const std::string& binary,
                                                         const std::string& config_path,
                                                         std::chrono::seconds timeout) {
  std::unique_ptr<ServeProcess> p(new ServeProcess());
  p->log_path_ = fmt::format("/tmp/cleave-tune-serve-{}-{}.log", ::getpid(),
                             std::chrono::steady_clock::now().time_since_epoch().count());
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return Internal(fmt::format("pipe: {}", std::strerror(errno)));
  std::vector<std::string> args = {binary, "serve", "--config", config_path, "--host", "127.0.0.1",
                                   "--port", "0", "--grpc-port", "0"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return Internal(fmt::format("fork: {}", std::strerror(errno)));
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);
    const int in = ::open("/dev/null", O_RDONLY);
    const int err = ::open(p->log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(in, 0);
    ::dup2(fds[1], 1);
    if (err >= 0) ::dup2(err, 2);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  p->pid_ = pid;
  p->out_fd_ = fds[0];
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string seen;
  while (p->url_.empty()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return DeadlineExceeded(fmt::format("cleave serve printed no listening line within {} s:\n{}",
                                          timeout.count(), p->log_tail()));
    }
    pollfd pfd{p->out_fd_, POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), 500)));
    if (r < 0 && errno != EINTR) return Internal(fmt::format("poll: {}", std::strerror(errno)));
    if (r <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(p->out_fd_, buf, sizeof(buf));
    if (n <= 0) {
      return Unavailable(fmt::format("cleave serve exited before listening:\n{}", p->log_tail()));
    }
    seen.append(buf, static_cast<size_t>(n));
    const size_t at = seen.find(kListening);
    if (at != std::string::npos) {
      const size_t end = seen.find_first_of(" \n", at + kListening.size());
      if (end == std::string::npos) continue;
      std::string url = seen.substr(at + kListening.size(), end - at - kListening.size());
      while (!url.empty() && url.back() == '/') url.pop_back();
      p->url_ = url;
    }
  }
  const int fd = p->out_fd_;
  p->drain_ = std::thread([fd] {
    char buf[4096];
    while (::read(fd, buf, sizeof(buf)) > 0) {
    }
  });
  auto base = parse_base_url(p->url_);
  if (!base.ok()) return base.status();
  auto target = resolve_target(*base, "");
  if (!target.ok()) return target.status();
  for (;;) {
    auto reply = http_get(*target, "/health", std::chrono::seconds(2));
    if (reply.ok() && reply->status == 200) break;
    if (std::chrono::steady_clock::now() > deadline) {
      return DeadlineExceeded(fmt::format("cleave serve at {} was not healthy within {} s:\n{}",
                                          p->url_, timeout.count(), p->log_tail()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return p;
}

std::string ServeProcess::log_tail() const {
  std::ifstream f(log_path_);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string s = ss.str();
  return s.size() > 2000 ? s.substr(s.size() - 2000) : s;
}

Status ServeProcess::stop(std::chrono::seconds grace) {
  if (pid_ <= 0) return Status::Ok();
  ::kill(pid_, SIGTERM);
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + grace;
  pid_t r = 0;
  while ((r = ::waitpid(pid_, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  bool killed = false;
  if (r == 0) {
    ::kill(-pid_, SIGKILL);
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status, 0);
    killed = true;
  }
  pid_ = -1;
  if (drain_.joinable()) drain_.join();
  if (out_fd_ >= 0) ::close(out_fd_);
  out_fd_ = -1;
  if (killed) return DeadlineExceeded("cleave serve did not stop within the grace period; killed");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return Internal(fmt::format("cleave serve ended with status {}:\n{}", status, log_tail()));
  }
  std::remove(log_path_.c_str());
  return Status::Ok();
}

ServeProcess::~ServeProcess() {
  if (pid_ > 0) stop().ignore_error();
  if (drain_.joinable()) drain_.join();
  if (out_fd_ >= 0) ::close(out_fd_);
}

}  // namespace cleave::bench
