// The cleave version (CMake's project version), for --version, GetInfo and /v1/models.
#pragma once

namespace cleave {

inline constexpr const char* kVersion = CLEAVE_VERSION;

}  // namespace cleave
