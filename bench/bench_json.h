// JSON output helpers shared by the benches' --json files.
#pragma once

#include <cstdio>
#include <string>

#include "cleave/common/status.h"
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

// Writes `text` to the --json file `path` (appends when `append`); the error names the file.
inline Status write_json_file(const std::string& path, const std::string& text,
                              bool append = false) {
  std::FILE* out = std::fopen(path.c_str(), append ? "a" : "w");
  if (out == nullptr) return InvalidArgument("cannot write --json file " + path);
  const bool written = std::fputs(text.c_str(), out) >= 0;
  if (std::fclose(out) != 0 || !written) return InvalidArgument("cannot write --json file " + path);
  return Status::Ok();
}

}  // namespace cleave::bench
