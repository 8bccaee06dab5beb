// RouterApp: the dispatcher, frontend and HTTP server built from the configuration.
#include "cleave/router/router_app.h"

#include <algorithm>
#include <thread>

#include "cleave/common/listen_address.h"
#include "cleave/common/log.h"
#include "cleave/common/rlimit.h"
#include "cleave/model/default_model.h"
#include "fmt/format.h"

namespace cleave::router {
namespace {

std::string trim_blanks(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t' || s[b] == '\n')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t' || s[e - 1] == '\n')) --e;
  return std::string(s.substr(b, e - b));
}

Result<WorkerPoolOptions> pool_from_settings(std::string_view name, const PoolSettings& pool,
                                             std::string_view policy,
                                             std::chrono::milliseconds dns_refresh) {
  WorkerPoolOptions out;
  auto kind = parse_dispatch_policy(policy);
  if (!kind.ok()) return kind.status().with_context(fmt::format("router.policy_{}", name));
  out.policy = *kind;
  out.workers = split_comma_list(pool.workers);
  const std::string dns = trim_blanks(pool.dns);
  if (!dns.empty()) {
    auto addr = parse_listen_address(dns);
    if (!addr.ok() || addr->port <= 0) {
      return InvalidArgument(fmt::format(
          "pools.{}.dns: '{}' is not NAME:PORT (a DNS name and the workers' port)", name, dns));
    }
    out.dns_name = addr->host;
    out.dns_port = addr->port;
  }
  out.dns_refresh = dns_refresh;
  if (out.empty()) {
    return InvalidArgument(fmt::format(
        "the {} pool names no worker: set pools.{}.workers (HOST:PORT,...) or pools.{}.dns "
        "(NAME:PORT), or use `cleave serve`, which starts the workers",
        name, name, name));
  }
  return out;
}

}  // namespace

std::vector<std::string> split_comma_list(std::string_view text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string_view::npos) comma = text.size();
    std::string item = trim_blanks(text.substr(start, comma - start));
    if (!item.empty()) out.push_back(std::move(item));
    start = comma + 1;
  }
  return out;
}

Result<DispatcherOptions> dispatcher_options_from_config(const RouterSettings& r,
                                                         const PoolsSettings& pools) {
  const std::chrono::milliseconds dns_refresh(r.dns_refresh_ms);
  DispatcherOptions o;
  CLEAVE_ASSIGN_OR_RETURN(o.mode, parse_dispatch_mode(r.mode));
  if (o.mode == DispatchMode::kUnified) {
    CLEAVE_ASSIGN_OR_RETURN(
        o.unified, pool_from_settings("unified", pools.unified, r.policy_unified, dns_refresh));
  } else {
    CLEAVE_ASSIGN_OR_RETURN(
        o.prefill, pool_from_settings("prefill", pools.prefill, r.policy_prefill, dns_refresh));
    CLEAVE_ASSIGN_OR_RETURN(
        o.decode, pool_from_settings("decode", pools.decode, r.policy_decode, dns_refresh));
  }
  o.health_interval = std::chrono::milliseconds(r.health_interval_ms);
  o.timeouts.probe = std::chrono::milliseconds(r.health_timeout_ms);
  o.probe_failures = static_cast<int>(r.health_failures);
  o.queue_limit = r.max_queue;
  o.prefill_queue_tokens = r.prefill_queue_tokens;
  o.max_migrations = static_cast<int>(r.max_migrations);
  o.early_decode = r.early_decode;
  const std::chrono::milliseconds first_token(r.request_timeout_ms);
  o.timeouts.prefill = first_token;
  o.timeouts.first_token = first_token;
  CLEAVE_RETURN_IF_ERROR(validate_dispatcher_options(o));
  return o;
}

Result<HttpServerOptions> http_server_options_from_config(const RouterSettings& r) {
  HttpServerOptions o;
  o.host = trim_blanks(r.host);
  o.port = static_cast<int>(r.port);
  o.io_threads = static_cast<int>(r.io_threads);
  o.max_body_bytes = static_cast<uint64_t>(r.max_body_bytes);
  o.idle_timeout = std::chrono::milliseconds(r.idle_timeout_ms);
  o.api_keys = split_comma_list(r.api_keys);
  CLEAVE_RETURN_IF_ERROR(validate_http_server_options(o));
  return o;
}

std::optional<GrpcServerOptions> grpc_server_options_from_config(const RouterSettings& r) {
  if (r.grpc_port < 0) return std::nullopt;
  GrpcServerOptions o;
  o.host = trim_blanks(r.host);
  o.port = static_cast<int>(r.grpc_port);
  o.api_keys = split_comma_list(r.api_keys);
  o.max_message_bytes = static_cast<uint64_t>(r.max_body_bytes);
  return o;
}

std::string client_url(std::string_view host, int port) {
  std::string h(host);
  if (h.empty() || h == "0.0.0.0")
    h = "127.0.0.1";
  else if (h == "::" || h == "[::]")
    h = "[::1]";
  else if (h.find(':') != std::string::npos && h.front() != '[')
    h = "[" + h + "]";
  return fmt::format("http://{}:{}/", h, port);
}

Result<std::unique_ptr<RouterApp>> RouterApp::start(const RouterAppConfig& config) {
  (void)raise_open_files_limit();
  CLEAVE_ASSIGN_OR_RETURN(DispatcherOptions dispatch,
                          dispatcher_options_from_config(config.router, config.pools));
  CLEAVE_ASSIGN_OR_RETURN(HttpServerOptions http, http_server_options_from_config(config.router));
  std::string model_path = config.model.path;
  std::string default_name;
  if (model_path.empty()) {
    CLEAVE_ASSIGN_OR_RETURN(DefaultModel def, resolve_default_model());
    model_path = def.path;
    default_name = def.served_name;
  }

  std::unique_ptr<RouterApp> app(new RouterApp());
  app->host_ = http.host;
  app->registry_ = std::make_unique<metrics::MetricsRegistry>();
  dispatch.metrics = app->registry_.get();
  CLEAVE_ASSIGN_OR_RETURN(app->dispatcher_, make_dispatcher(dispatch));

  FrontendOptions front;
  const std::string served = trim_blanks(config.router.served_model_name);
  if (!served.empty()) {
    front.served_model_names.push_back(served);
  } else if (!default_name.empty()) {
    front.served_model_names.push_back(default_name);
  }
  if (config.max_context > 0) front.max_model_len = config.max_context;
  auto frontend = RouterFrontend::create_from_model_file(model_path, std::move(front),
                                                         *app->dispatcher_, *app->registry_);
  if (!frontend.ok()) {
    app->dispatcher_->shutdown();
    return frontend.status().with_context(fmt::format("router model {}", model_path));
  }
  app->frontend_ = std::move(frontend).value();

  auto server = HttpServer::start(http, *app->frontend_);
  if (!server.ok()) {
    app->dispatcher_->shutdown();
    return server.status();
  }
  app->server_ = std::move(server).value();
  app->port_ = app->server_->port();
  if (auto grpc_options = grpc_server_options_from_config(config.router)) {
    auto grpc = GrpcServer::start(*grpc_options, *app->frontend_);
    if (!grpc.ok()) {
      app->server_->stop();
      app->dispatcher_->shutdown();
      return grpc.status();
    }
    app->grpc_ = std::move(grpc).value();
  }
  log::info("router: {} mode, model '{}' ({}), HTTP on {}:{}{}{}",
            dispatch_mode_name(dispatch.mode), app->frontend_->model_name(), model_path,
            http.host, app->port_,
            app->grpc_ ? fmt::format(", gRPC on {}:{}", http.host, app->grpc_->port()) : "",
            http.api_keys.empty() ? "" : ", API keys required");
  return app;
}

RouterApp::~RouterApp() {
  stop();
}

bool RouterApp::wait_ready(std::chrono::milliseconds timeout, bool all_workers) const {
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    bool ready = dispatcher_->ready();
    if (ready && all_workers) {
      for (const PoolSnapshot& p : dispatcher_->pools()) {
        if (p.workers_ready < p.workers_known || p.workers_known == 0) ready = false;
      }
    }
    if (ready) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

int RouterApp::port() const {
  return port_;
}

int RouterApp::grpc_port() const {
  return grpc_ ? grpc_->port() : -1;
}

std::string RouterApp::url() const {
  return client_url(host_, port_);
}

const std::string& RouterApp::model_name() const {
  return frontend_->model_name();
}

std::string RouterApp::grpc_target() const {
  if (!grpc_) return {};
  std::string url = client_url(host_, grpc_->port());  // "http://HOST:PORT/"
  return url.substr(7, url.size() - 8);
}

Dispatcher& RouterApp::dispatcher() const {
  return *dispatcher_;
}

void RouterApp::stop() {
  if (grpc_) grpc_->stop();
  if (server_) server_->stop();
  if (dispatcher_) dispatcher_->shutdown();
}

}  // namespace cleave::router
