// parse_listen_address: HOST:PORT, IPv6 hosts in brackets.
#include "cleave/common/listen_address.h"

#include <charconv>

#include "fmt/format.h"

namespace cleave {

Result<ListenAddress> parse_listen_address(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return InvalidArgument(fmt::format("listen address '{}' {}; expected HOST:PORT "
                                       "(e.g. 127.0.0.1:0, 0.0.0.0:50051, [::1]:50051)",
                                       text, why));
  };
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos) return bad("has no port");
  ListenAddress out;
  out.host = std::string(text.substr(0, colon));
  const std::string_view port = text.substr(colon + 1);
  if (out.host.empty()) return bad("has no host");
  if (out.host.front() == '[' ? out.host.back() != ']' || out.host.size() < 3
                              : out.host.find(':') != std::string::npos) {
    return bad("has a malformed host (IPv6 hosts go in brackets)");
  }
  int value = -1;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || end != port.data() + port.size() || value < 0 ||
      value > 65535) {
    return bad(fmt::format("has a bad port '{}' (0-65535)", port));
  }
  out.port = value;
  return out;
}

}  // namespace cleave
