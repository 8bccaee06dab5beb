// A network address to listen on or dial, as the settings spell it (worker.listen, the router's
// worker list, DNS discovery answers).
#pragma once

#include <string>
#include <string_view>

#include "cleave/common/status.h"

namespace cleave {

// "HOST:PORT" ("[::1]:PORT" for IPv6) split and checked; InvalidArgument naming the value.
struct ListenAddress {
  std::string host;
  int port = 0;
};
Result<ListenAddress> parse_listen_address(std::string_view text);

}  // namespace cleave
