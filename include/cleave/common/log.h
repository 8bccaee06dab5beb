// Logging facade over spdlog. Every line carries the process role and worker id, set once at
// start-up with init_logging(). Diagnostics go to stderr so that stdout stays for program output.
#pragma once

#include <string>
#include <string_view>

#include "cleave/common/status.h"
#include "spdlog/spdlog.h"

namespace cleave {

struct LogOptions {
  std::string level = "info";  // trace, debug, info, warn, error, off
  std::string role = "cli";    // router, prefill, decode, unified, cli
  std::string worker_id;       // empty: none
};

// Configures the default logger; InvalidArgument for an unknown level.
Status init_logging(const LogOptions& opts);

namespace log {
template <typename... Args>
void trace(spdlog::format_string_t<Args...> f, Args&&... a) { spdlog::trace(f, std::forward<Args>(a)...); }
template <typename... Args>
void debug(spdlog::format_string_t<Args...> f, Args&&... a) { spdlog::debug(f, std::forward<Args>(a)...); }
template <typename... Args>
void info(spdlog::format_string_t<Args...> f, Args&&... a) { spdlog::info(f, std::forward<Args>(a)...); }
template <typename... Args>
void warn(spdlog::format_string_t<Args...> f, Args&&... a) { spdlog::warn(f, std::forward<Args>(a)...); }
template <typename... Args>
void error(spdlog::format_string_t<Args...> f, Args&&... a) { spdlog::error(f, std::forward<Args>(a)...); }
}  // namespace log

}  // namespace cleave
