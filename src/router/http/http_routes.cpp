// Route table and the non-completion endpoints (the API key check: frontend/api_key.h).
#include "http_routes.h"

#include <fmt/format.h>

#include "cleave/router/json_writer.h"
#include "frontend/api_key.h"

namespace cleave::router {
namespace {

constexpr std::string_view kCompletions = "/v1/completions";
constexpr std::string_view kChatCompletions = "/v1/chat/completions";
constexpr std::string_view kModels = "/v1/models";
constexpr std::string_view kModelsPrefix = "/v1/models/";
constexpr std::string_view kHealth = "/health";
constexpr std::string_view kMetrics = "/metrics";

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// %XX decoding (a malformed escape is kept as it is).
std::string percent_decode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size()) {
      const int hi = hex_value(s[i + 1]);
      const int lo = hex_value(s[i + 2]);
      if (hi >= 0 && lo >= 0) {
        out.push_back(static_cast<char>(hi * 16 + lo));
        i += 2;
        continue;
      }
    }
    out.push_back(s[i]);
  }
  return out;
}

SimpleResponse json_response(int status, std::string body) {
  SimpleResponse r;
  r.status = status;
  r.body = std::move(body);
  return r;
}

SimpleResponse health_response(const RouterFrontend& frontend) {
  const Dispatcher& dispatcher = frontend.dispatcher();
  const bool ready = dispatcher.ready();
  std::string body;
  openai::JsonWriter w(body);
  w.begin_object();
  w.key("status").string(ready ? "ok" : "unavailable");
  w.key("pools").begin_array();
  for (const auto& p : dispatcher.pools()) {
    w.begin_object();
    w.key("name").string(p.name);
    w.key("workers_ready").integer(p.workers_ready);
    w.key("workers_known").integer(p.workers_known);
    w.end_object();
  }
  w.end_array();
  w.end_object();
  return json_response(ready ? 200 : 503, std::move(body));
}

SimpleResponse method_not_allowed(std::string_view method, std::string_view path,
                                  std::string_view allowed) {
  SimpleResponse r = error_response(openai::method_not_allowed(method, path));
  r.extra_headers = fmt::format("Allow: {}\r\n", allowed);
  return r;
}

}  // namespace

SimpleResponse error_response(const openai::ApiError& error) {
  return json_response(error.http_status, error.to_json());
}

RouteDecision route_request(const HttpServerOptions& options, const RouterFrontend& frontend,
                            const RouteInput& input) {
  RouteDecision d;
  std::string_view path = input.target;
  if (const size_t q = path.find('?'); q != std::string_view::npos) path = path.substr(0, q);

  if (path.starts_with("/v1/")) {
    if (auto err = check_api_key(options.api_keys, input.authorization)) {
      if (path == kCompletions) d.handler = kCompletions;
      if (path == kChatCompletions) d.handler = kChatCompletions;
      if (path == kModels || path.starts_with(kModelsPrefix)) d.handler = kModels;
      d.response = error_response(*err);
      return d;
    }
  }

  // HEAD is served wherever GET is (the session drops the body, keeping its Content-Length).
  const bool get = input.method == "GET" || input.method == "HEAD";
  const bool post = input.method == "POST";
  if (path == kCompletions || path == kChatCompletions) {
    d.handler = path == kCompletions ? kCompletions : kChatCompletions;
    if (!post) {
      d.response = method_not_allowed(input.method, path, "POST");
      return d;
    }
    auto prepared = path == kCompletions ? frontend.prepare_completion(input.body)
                                         : frontend.prepare_chat(input.body);
    if (!prepared.ok()) {
      d.response = error_response(prepared.error());
    } else {
      d.prepared = std::move(*prepared);
    }
    return d;
  }
  if (path == kModels || path.starts_with(kModelsPrefix)) {
    d.handler = kModels;
    if (!get) {
      d.response = method_not_allowed(input.method, path, "GET, HEAD");
      return d;
    }
    if (path == kModels) {
      d.response = json_response(200, frontend.models_json());
    } else {
      auto card = frontend.model_json(percent_decode(path.substr(kModelsPrefix.size())));
      d.response = card.ok() ? json_response(200, std::move(*card)) : error_response(card.error());
    }
    return d;
  }
  if (path == kHealth) {
    d.handler = kHealth;
    d.response =
        get ? health_response(frontend) : method_not_allowed(input.method, path, "GET, HEAD");
    return d;
  }
  if (path == kMetrics) {
    d.handler = kMetrics;
    if (!get) {
      d.response = method_not_allowed(input.method, path, "GET, HEAD");
      return d;
    }
    SimpleResponse r;
    r.content_type = "text/plain; version=0.0.4; charset=utf-8";
    r.body = frontend.render_metrics();
    d.response = std::move(r);
    return d;
  }
  d.response = error_response(openai::unknown_route(input.method, path));
  return d;
}

}  // namespace cleave::router
