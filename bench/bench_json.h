// JSON output helpers shared by the benches' --json files.
#pragma once

#include <string>

#include "fmt/format.h"

namespace cleave::bench {

// A JSON string literal (quotes, backslashes and control characters escaped).
inline std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) out += fmt::format("\\u{:04x}", static_cast<int>(c));
    else out += c;
  }
  return out + "\"";
}

}  // namespace cleave::bench
