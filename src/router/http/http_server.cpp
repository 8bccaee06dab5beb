// The listener, the I/O threads and the server's life.
#include "cleave/router/http_server.h"

#include <thread>

#include <fmt/format.h>

#include "cleave/common/log.h"
#include "cleave/common/thread_pool.h"
#include "http_session.h"

namespace cleave::router {

Status validate_http_server_options(const HttpServerOptions& o) {
  if (o.port < 0 || o.port > 65535) {
    return InvalidArgument(fmt::format("router port {} is not in [0, 65535]", o.port));
  }
  if (o.io_threads < 1 || o.io_threads > 256) {
    return InvalidArgument(fmt::format("router io_threads {} is not in [1, 256]", o.io_threads));
  }
  if (o.backlog < 1) return InvalidArgument(fmt::format("router backlog {} is < 1", o.backlog));
  if (o.max_body_bytes < 1) return InvalidArgument("router max_body_bytes must be >= 1");
  if (o.max_header_bytes < 1024) {
    return InvalidArgument(fmt::format("router max_header_bytes {} is < 1024", o.max_header_bytes));
  }
  const auto positive = [](std::chrono::milliseconds d) { return d.count() > 0; };
  if (!positive(o.idle_timeout) || !positive(o.header_timeout) || !positive(o.body_timeout) ||
      !positive(o.write_timeout)) {
    return InvalidArgument("router timeouts must be > 0 ms");
  }
  for (const auto& key : o.api_keys) {
    if (key.empty()) return InvalidArgument("an empty router API key");
  }
  return Status::Ok();
}

struct HttpServer::Impl {
  explicit Impl(ServerContext& context)
      : ctx(context),
        ioc(context.options.io_threads),
        work(net::make_work_guard(ioc)),
        acceptor(net::make_strand(ioc)),
        accept_retry(acceptor.get_executor()) {}

  void accept();
  void on_accept(beast::error_code ec, tcp::socket socket);

  ServerContext& ctx;  // outlives the io_context: the sessions it destroys use it
  net::io_context ioc;
  net::executor_work_guard<net::io_context::executor_type> work;
  tcp::acceptor acceptor;
  net::steady_timer accept_retry;
  std::vector<std::thread> threads;
  int port = 0;
};

void HttpServer::Impl::accept() {
  acceptor.async_accept(net::make_strand(ioc),
                        beast::bind_front_handler(&Impl::on_accept, this));
}

void HttpServer::Impl::on_accept(beast::error_code ec, tcp::socket socket) {
  if (ec) {
    if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
    // Out of file descriptors (or another transient failure): try again shortly rather than
    // spinning on an error.
    log::warn("http: accept failed: {}", ec.message());
    accept_retry.expires_after(std::chrono::milliseconds(50));
    accept_retry.async_wait([this](beast::error_code wec) {
      if (!wec && acceptor.is_open()) accept();
    });
    return;
  }
  beast::error_code opt_ec;
  socket.set_option(tcp::no_delay(true), opt_ec);  // SSE chunks go out at once
  std::make_shared<HttpSession>(std::move(socket), ctx)->start();
  accept();
}

HttpServer::HttpServer(std::unique_ptr<ServerContext> ctx, std::unique_ptr<Impl> impl)
    : ctx_(std::move(ctx)), impl_(std::move(impl)), port_(impl_->port) {}

Result<std::unique_ptr<HttpServer>> HttpServer::start(const HttpServerOptions& options,
                                                      RouterFrontend& frontend) {
  CLEAVE_RETURN_IF_ERROR(validate_http_server_options(options));
  beast::error_code ec;
  const auto address = net::ip::make_address(options.host, ec);
  if (ec) {
    return InvalidArgument(fmt::format("router host '{}' is not an IP address: {}", options.host,
                                       ec.message()));
  }
  auto ctx = std::make_unique<ServerContext>(options, frontend);
  auto impl = std::make_unique<Impl>(*ctx);
  const tcp::endpoint endpoint(address, static_cast<unsigned short>(options.port));
  const std::string where = fmt::format("{}:{}", options.host, options.port);
  tcp::acceptor& acceptor = impl->acceptor;
  if (acceptor.open(endpoint.protocol(), ec); ec) {
    return Unavailable(fmt::format("cannot open a socket for {}: {}", where, ec.message()));
  }
  if (acceptor.set_option(net::socket_base::reuse_address(true), ec); ec) {
    return Unavailable(fmt::format("cannot set SO_REUSEADDR on {}: {}", where, ec.message()));
  }
  if (acceptor.bind(endpoint, ec); ec) {
    return Unavailable(fmt::format("cannot listen on {}: {}", where, ec.message()));
  }
  if (acceptor.listen(options.backlog, ec); ec) {
    return Unavailable(fmt::format("cannot listen on {}: {}", where, ec.message()));
  }
  impl->port = acceptor.local_endpoint(ec).port();
  impl->accept();
  Impl* raw = impl.get();
  for (int i = 0; i < options.io_threads; ++i) {
    raw->threads.emplace_back([raw, i] {
      set_thread_name(fmt::format("http-io-{}", i));
      for (;;) {
        try {
          raw->ioc.run();
          return;
        } catch (const std::exception& e) {
          // A handler threw: that connection is lost, the server goes on.
          log::error("http: an I/O handler threw: {}", e.what());
        }
      }
    });
  }
  log::info("http: listening on {}:{} ({} I/O thread{})", options.host, raw->port,
            options.io_threads, options.io_threads == 1 ? "" : "s");
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(ctx), std::move(impl)));
}

HttpServer::~HttpServer() { stop(); }

int HttpServer::port() const { return port_; }

int64_t HttpServer::connections() const {
  return ctx_->connections.load(std::memory_order_relaxed);
}

void HttpServer::stop() {
  if (!impl_) return;
  ctx_->stopping.store(true);
  // No new connections.
  net::post(impl_->acceptor.get_executor(), [impl = impl_.get()] {
    beast::error_code ec;
    impl->acceptor.close(ec);
    impl->accept_retry.cancel();
  });
  // Every request in flight ends on its workers; its session hears kCancelled and closes.
  for (auto& exchange : ctx_->exchanges.snapshot()) exchange->cancel();
  impl_->work.reset();
  impl_->ioc.stop();
  for (auto& t : impl_->threads) {
    if (t.joinable()) t.join();
  }
  // What is left (an exchange registered while we were cancelling) ends here; detaching drops
  // the sessions the exchanges hold, so the io_context destroys them with its handlers.
  for (auto& exchange : ctx_->exchanges.snapshot()) {
    exchange->cancel();
    exchange->detach();
  }
  beast::error_code ec;
  impl_->acceptor.close(ec);
  impl_.reset();  // destroys the connections left, with the io_context's handlers
}

}  // namespace cleave::router
