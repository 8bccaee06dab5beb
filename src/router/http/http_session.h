// One HTTP connection of the router: reads requests (keep-alive), answers them or runs their
// Exchange, streams its output, and cancels it when the client goes away. Everything runs on
// the connection's strand; the Exchange wakes it by posting there.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "cleave/router/http_server.h"
#include "frontend/exchange.h"
#include "http_routes.h"

namespace cleave::router {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

// The exchanges in flight, so that stopping the server can cancel them all.
class ExchangeRegistry {
 public:
  uint64_t add(std::shared_ptr<Exchange> exchange);
  void remove(uint64_t id);
  std::vector<std::shared_ptr<Exchange>> snapshot() const;

 private:
  mutable std::mutex mu_;
  uint64_t next_ = 1;
  std::unordered_map<uint64_t, std::weak_ptr<Exchange>> live_;
};

// What every connection of one server shares.
struct ServerContext {
  ServerContext(const HttpServerOptions& o, RouterFrontend& f) : options(o), frontend(f) {}
  const HttpServerOptions options;
  RouterFrontend& frontend;
  ExchangeRegistry exchanges;
  std::atomic<int64_t> connections{0};
  std::atomic<bool> stopping{false};
};

class HttpSession : public std::enable_shared_from_this<HttpSession> {
 public:
  using Clock = std::chrono::steady_clock;

  // `socket`'s executor must be a strand of the server's io_context.
  HttpSession(tcp::socket&& socket, ServerContext& ctx);
  ~HttpSession();
  HttpSession(const HttpSession&) = delete;
  HttpSession& operator=(const HttpSession&) = delete;

  void start();

 private:
  // Reading a request.
  void read_next();
  void on_idle_read(beast::error_code ec, size_t n);
  void read_header();
  void on_header(beast::error_code ec, size_t n);
  void read_body();
  void on_body(beast::error_code ec, size_t n);
  void fail_read(beast::error_code ec);
  void handle_request();

  // Complete responses.
  void respond(SimpleResponse response, bool close_after = false);
  void on_response_written(beast::error_code ec, bool close_after);

  // Completions.
  void start_exchange(PreparedRequest prepared);
  void pump();
  void on_stream_written(beast::error_code ec, bool done, bool close_after);
  void watch_disconnect();
  void on_readable(beast::error_code ec);
  void end_exchange();
  void abort_exchange(std::string_view why);

  // Closing.
  void linger_close();
  void drain();
  void close();

  beast::tcp_stream stream_;
  ServerContext& ctx_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  Clock::time_point arrival_{};
  bool keep_alive_ = false;
  bool head_request_ = false;  // the request is HEAD: replies carry headers only, never a body
  unsigned version_ = 11;
  std::string_view handler_ = "other";

  std::string head_;  // the response head being written
  std::string body_;  // a complete response's body being written
  bool writing_ = false;
  bool closed_ = false;
  size_t drained_ = 0;

  std::shared_ptr<Exchange> exchange_;
  uint64_t exchange_id_ = 0;
  ExchangeOutput out_;  // its bytes are being written while writing_
  bool stream_raw_ = false;  // HTTP/1.0: no chunked encoding; the stream ends with the connection
  bool watching_ = false;    // an async_wait for readability is pending
  char chunk_size_[24] = {};
};

}  // namespace cleave::router
