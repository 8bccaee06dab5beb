#include "cleave/common/rlimit.h"

#include <sys/resource.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "cleave/common/log.h"

namespace cleave {
namespace {

constexpr rlim_t kLowHardLimit = 4096;

}  // namespace

int64_t raise_open_files_limit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) {
    log::warn("open files limit: getrlimit failed: {}", std::strerror(errno));
    return -1;
  }
  if (lim.rlim_max != RLIM_INFINITY && lim.rlim_max < kLowHardLimit) {
    log::warn("open files limit: the hard limit is {} (below {}); each connection holds a file "
              "descriptor, raise it (ulimit -Hn, LimitNOFILE=) to serve more clients",
              static_cast<uint64_t>(lim.rlim_max), static_cast<uint64_t>(kLowHardLimit));
  }
  if (lim.rlim_cur != lim.rlim_max) {
    const rlim_t old = lim.rlim_cur;
    lim.rlim_cur = lim.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &lim) != 0) {
      log::warn("open files limit: cannot raise the soft limit {} to {}: {}",
                static_cast<uint64_t>(old), static_cast<uint64_t>(lim.rlim_max),
                std::strerror(errno));
      lim.rlim_cur = old;
    }
  }
  return lim.rlim_cur == RLIM_INFINITY ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(lim.rlim_cur);
}

}  // namespace cleave
