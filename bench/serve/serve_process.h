// One `cleave serve` child of `cleave tune`: started with a config file on 127.0.0.1 and a free
// port, ready when it has printed its listening line and /health answers 200; stopped with
// SIGTERM (then SIGKILL of its process group after a grace period). The child dies with the
// thread that started it (PR_SET_PDEATHSIG); its stdout is drained by a thread, its stderr goes
// to a log file whose tail is quoted when it fails to start.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "cleave/common/status.h"

namespace cleave::bench {

class ServeProcess {
 public:
  static Result<std::unique_ptr<ServeProcess>> start(const std::string& binary,
                                                     const std::string& config_path,
                                                     std::chrono::seconds timeout);
  ~ServeProcess();
  ServeProcess(const ServeProcess&) = delete;
  ServeProcess& operator=(const ServeProcess&) = delete;

  const std::string& url() const { return url_; }  // http://127.0.0.1:PORT
  // SIGTERM, and SIGKILL after `grace`; OK when it exited with status 0.
  Status stop(std::chrono::seconds grace = std::chrono::seconds(20));

 private:
  ServeProcess() = default;
  std::string log_tail() const;

  pid_t pid_ = -1;
  int out_fd_ = -1;
  std::string url_, log_path_;
  std::thread drain_;
};

}  // namespace cleave::bench
