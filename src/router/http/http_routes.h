// Routing of one HTTP request: authentication, path and method, and the answer: a complete
// response, or the dispatches of a completion request (PreparedRequest) to run.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/router/http_server.h"
#include "cleave/router/openai_error.h"
#include "cleave/router/router_frontend.h"

namespace cleave::router {

struct SimpleResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::string extra_headers;  // complete "Name: value\r\n" lines
};

struct RouteDecision {
  std::string_view handler = "other";  // metrics label: the route, or "other"
  std::optional<SimpleResponse> response;
  std::optional<PreparedRequest> prepared;  // a completion to run instead
};

// What the router needs from a request (the header values it reads, already extracted).
struct RouteInput {
  std::string_view method;  // "GET", "POST"...
  std::string_view target;  // path and query
  std::string_view authorization;
  std::string_view body;
};

SimpleResponse error_response(const openai::ApiError& error);

RouteDecision route_request(const HttpServerOptions& options, const RouterFrontend& frontend,
                            const RouteInput& input);

}  // namespace cleave::router
