// Test helpers for multi-process transfer tests: a child process with line-based pipes, hex
// encoding and a fast checksum shared by the test and its peer.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace cleave::transfer::testing {

inline uint64_t checksum(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

inline std::string to_hex(std::string_view b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (unsigned char c : b) {
    s.push_back(d[c >> 4]);
    s.push_back(d[c & 15]);
  }
  return s;
}

inline std::string from_hex(std::string_view h) {
  auto v = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  std::string s;
  for (size_t i = 0; i + 1 < h.size(); i += 2) s.push_back(static_cast<char>(v(h[i]) * 16 + v(h[i + 1])));
  return s;
}

// A child process; its stdout lines are collected by a reader thread.
class PeerProcess {
 public:
  explicit PeerProcess(const std::vector<std::string>& argv) {
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) return;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_addclose(&fa, in[1]);
    posix_spawn_file_actions_addclose(&fa, out[0]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    if (posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(out[1]);
    stdin_fd_ = in[1];
    stdout_fd_ = out[0];
    reader_ = std::thread([this] { read_loop(); });
  }
  ~PeerProcess() {
    if (stdin_fd_ >= 0) close(stdin_fd_);  // EOF: the peer exits
    if (pid_ > 0) {
      for (int i = 0; i < 200 && !reaped_; ++i) {
        if (waitpid(pid_, nullptr, WNOHANG) == pid_) reaped_ = true;
        else std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (!reaped_) {
        ::kill(pid_, SIGKILL);
        waitpid(pid_, nullptr, 0);
      }
    }
    if (reader_.joinable()) reader_.join();
    if (stdout_fd_ >= 0) close(stdout_fd_);
  }
  bool started() const { return pid_ > 0; }
  // Writes `line` and a newline to the child's stdin.
  bool send_line(const std::string& line) {
    std::string l = line + "\n";
    return ::write(stdin_fd_, l.data(), l.size()) == static_cast<ssize_t>(l.size());
  }
  void kill_now() {
    ::kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    reaped_ = true;
  }

  // The first line starting with `prefix ` (removed from the queue), without the prefix.
  std::optional<std::string> wait_line(const std::string& prefix, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    std::optional<std::string> found;
    cv_.wait_for(lock, timeout, [&] {
      for (auto it = lines_.begin(); it != lines_.end(); ++it) {
        if (it->rfind(prefix + " ", 0) == 0) {
          found = it->substr(prefix.size() + 1);
          lines_.erase(it);
          return true;
        }
      }
      return eof_;
    });
    return found;
  }

 private:
  void read_loop() {
    std::string buf;
    char chunk[4096];
    for (;;) {
      ssize_t n = read(stdout_fd_, chunk, sizeof(chunk));
      if (n <= 0) break;
      buf.append(chunk, static_cast<size_t>(n));
      size_t pos;
      while ((pos = buf.find('\n')) != std::string::npos) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          lines_.push_back(buf.substr(0, pos));
        }
        cv_.notify_all();
        buf.erase(0, pos + 1);
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      eof_ = true;
    }
    cv_.notify_all();
  }

  pid_t pid_ = -1;
  bool reaped_ = false;
  int stdin_fd_ = -1, stdout_fd_ = -1;
  std::thread reader_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> lines_;
  bool eof_ = false;
};

}  // namespace cleave::transfer::testing
