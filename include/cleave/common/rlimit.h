// Process resource limits.
#pragma once

#include <cstdint>

namespace cleave {

// Raises this process's soft RLIMIT_NOFILE (open file descriptors) to its hard limit, so that a
// server holding one socket per client is not stopped at the usual soft limit of 1,024. Returns
// the soft limit in force afterwards (the old one when it cannot be raised; -1 when it cannot
// be read). Logs a warning when the hard limit is below 4,096 or the raise fails. Call once,
// early at start-up (it changes process-wide state); safe from any thread.
int64_t raise_open_files_limit();

}  // namespace cleave
