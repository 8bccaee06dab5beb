// One keep-alive HTTP connection: request reading with limits and timeouts, complete responses,
// and streamed (chunked SSE) or buffered completions driven by an Exchange.
#include "http_session.h"

#include <sys/socket.h>

#include <array>
#include <cerrno>
#include <exception>

#include <fmt/format.h>

#include "cleave/common/log.h"
#include "frontend/router_metrics.h"

namespace cleave::router {
namespace {

constexpr size_t kReadChunk = 4096;
constexpr size_t kDrainLimit = 1u << 20;  // bytes read and dropped before closing after an error
constexpr std::chrono::seconds kDrainTimeout{1};
constexpr std::string_view k100Continue = "HTTP/1.1 100 Continue\r\n\r\n";
constexpr std::string_view kCrlf = "\r\n";
constexpr std::string_view kLastChunk = "0\r\n\r\n";

std::string_view reason_phrase(int status) {
  return http::obsolete_reason(static_cast<http::status>(status));
}

void append_head(std::string& out, int status, std::string_view content_type,
                 std::string_view extra_headers, bool close) {
  fmt::format_to(std::back_inserter(out), "HTTP/1.1 {} {}\r\nServer: cleave\r\nContent-Type: {}\r\n{}",
                 status, reason_phrase(status), content_type, extra_headers);
  out += close ? "Connection: close\r\n" : "Connection: keep-alive\r\n";
}

openai::ApiError header_too_large(uint32_t limit) {
  openai::ApiError e;
  e.http_status = 431;
  e.message = fmt::format("The request header is larger than this server's limit of {} bytes.",
                          limit);
  e.code = "request_header_too_large";
  return e;
}

}  // namespace

// ---- ExchangeRegistry ----

uint64_t ExchangeRegistry::add(std::shared_ptr<Exchange> exchange) {
  std::lock_guard<std::mutex> lk(mu_);
  const uint64_t id = next_++;
  live_.emplace(id, exchange);
  return id;
}

void ExchangeRegistry::remove(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  live_.erase(id);
}

std::vector<std::shared_ptr<Exchange>> ExchangeRegistry::snapshot() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::shared_ptr<Exchange>> out;
  out.reserve(live_.size());
  for (const auto& [id, weak] : live_) {
    if (auto e = weak.lock()) out.push_back(std::move(e));
  }
  return out;
}

// ---- HttpSession ----

HttpSession::HttpSession(tcp::socket&& socket, ServerContext& ctx)
    : stream_(std::move(socket)), ctx_(ctx) {
  ctx_.connections.fetch_add(1, std::memory_order_relaxed);
}

HttpSession::~HttpSession() {
  if (exchange_) {
    exchange_->cancel();
    exchange_->detach();
    ctx_.exchanges.remove(exchange_id_);
  }
  ctx_.connections.fetch_sub(1, std::memory_order_relaxed);
}

void HttpSession::start() {
  net::dispatch(stream_.get_executor(),
                beast::bind_front_handler(&HttpSession::read_next, shared_from_this()));
}

void HttpSession::read_next() {
  if (closed_) return;
  if (ctx_.stopping.load(std::memory_order_relaxed)) {
    close();
    return;
  }
  head_request_ = false;
  parser_.emplace();
  parser_->header_limit(ctx_.options.max_header_bytes);
  parser_->body_limit(ctx_.options.max_body_bytes);
  if (buffer_.size() > 0) {  // the client sent its next request already (pipelining)
    read_header();
    return;
  }
  stream_.expires_after(ctx_.options.idle_timeout);
  stream_.async_read_some(buffer_.prepare(kReadChunk),
                          beast::bind_front_handler(&HttpSession::on_idle_read, shared_from_this()));
}

void HttpSession::on_idle_read(beast::error_code ec, size_t n) {
  if (ec) {  // idle timeout, or the client closed its keep-alive connection
    close();
    return;
  }
  buffer_.commit(n);
  read_header();
}

void HttpSession::read_header() {
  stream_.expires_after(ctx_.options.header_timeout);
  http::async_read_header(stream_, buffer_, *parser_,
                          beast::bind_front_handler(&HttpSession::on_header, shared_from_this()));
}

void HttpSession::on_header(beast::error_code ec, size_t) {
  if (ec) {
    fail_read(ec);
    return;
  }
  if (parser_->is_done()) {
    handle_request();
    return;
  }
  const auto& req = parser_->get();
  if (beast::iequals(req[http::field::expect], "100-continue")) {
    stream_.expires_after(ctx_.options.write_timeout);
    net::async_write(stream_, net::buffer(k100Continue.data(), k100Continue.size()),
                     [self = shared_from_this()](beast::error_code wec, size_t) {
                       if (wec) {
                         self->close();
                       } else {
                         self->read_body();
                       }
                     });
    return;
  }
  read_body();
}

void HttpSession::read_body() {
  stream_.expires_after(ctx_.options.body_timeout);
  http::async_read(stream_, buffer_, *parser_,
                   beast::bind_front_handler(&HttpSession::on_body, shared_from_this()));
}

void HttpSession::on_body(beast::error_code ec, size_t) {
  if (ec) {
    fail_read(ec);
    return;
  }
  handle_request();
}

void HttpSession::fail_read(beast::error_code ec) {
  handler_ = "other";
  keep_alive_ = false;
  head_request_ = parser_ && parser_->is_header_done() && parser_->get().method() == http::verb::head;
  if (ec == http::error::body_limit) {
    respond(error_response(openai::body_too_large(ctx_.options.max_body_bytes)), true);
  } else if (ec == http::error::header_limit) {
    respond(error_response(header_too_large(ctx_.options.max_header_bytes)), true);
  } else if (ec.category() == http::make_error_code(http::error::end_of_stream).category() &&
             ec != http::error::end_of_stream && ec != http::error::partial_message) {
    // The bytes are not HTTP/1.1 (bad method, target, version, header or chunk syntax).
    respond(error_response(openai::invalid_request(
                fmt::format("The request is not valid HTTP/1.1: {}.", ec.message()))),
            true);
  } else {
    close();  // end of stream, timeout, reset: nobody to answer
  }
}

void HttpSession::handle_request() {
  stream_.expires_never();
  arrival_ = Clock::now();
  auto& req = parser_->get();
  keep_alive_ = req.keep_alive();
  version_ = req.version();
  head_request_ = req.method() == http::verb::head;
  RouteDecision decision;
  try {
    const RouteInput input{.method = req.method_string(),
                           .target = req.target(),
                           .authorization = req[http::field::authorization],
                           .body = req.body()};
    decision = route_request(ctx_.options, ctx_.frontend, input);
  } catch (const std::exception& e) {
    log::error("http: request handling threw: {}", e.what());
    decision = RouteDecision{};
    decision.response = error_response(openai::internal_error(e.what()));
  }
  handler_ = decision.handler;
  // Idle connections (thousands of open streams) keep no request-sized buffers.
  req.body().clear();
  req.body().shrink_to_fit();
  if (buffer_.size() == 0) buffer_.shrink_to_fit();
  if (decision.response) {
    respond(std::move(*decision.response));
    return;
  }
  start_exchange(std::move(*decision.prepared));
}

void HttpSession::respond(SimpleResponse response, bool close_after) {
  ctx_.frontend.metrics().count_http(handler_, response.status);
  close_after = close_after || !keep_alive_ || ctx_.stopping.load(std::memory_order_relaxed);
  head_.clear();
  append_head(head_, response.status, response.content_type, response.extra_headers, close_after);
  fmt::format_to(std::back_inserter(head_), "Content-Length: {}\r\n\r\n", response.body.size());
  // A reply to HEAD never has a body (RFC 9110 9.3.2), errors included: bytes after the head
  // would be read as the start of the next response on this keep-alive connection.
  body_ = head_request_ ? std::string() : std::move(response.body);
  writing_ = true;
  stream_.expires_after(ctx_.options.write_timeout);
  const std::array<net::const_buffer, 2> buffers{net::buffer(head_), net::buffer(body_)};
  net::async_write(stream_, buffers,
                   [self = shared_from_this(), close_after](beast::error_code ec, size_t) {
                     self->on_response_written(ec, close_after);
                   });
}

void HttpSession::on_response_written(beast::error_code ec, bool close_after) {
  writing_ = false;
  body_.clear();
  if (ec) {
    close();
  } else if (close_after) {
    linger_close();
  } else {
    read_next();
  }
}

// ---- completions ----

void HttpSession::start_exchange(PreparedRequest prepared) {
  stream_raw_ = version_ < 11;
  auto exchange = std::make_shared<Exchange>(std::move(prepared), ctx_.frontend.tokenizer(),
                                             ctx_.frontend.metrics(), arrival_);
  // The exchange keeps this session alive until end_exchange() detaches it.
  exchange->set_notify([self = shared_from_this(), executor = stream_.get_executor()] {
    net::post(executor, [self] { self->pump(); });
  });
  exchange_ = exchange;
  exchange_id_ = ctx_.exchanges.add(exchange);
  if (auto error = exchange->start(ctx_.frontend.dispatcher())) {
    end_exchange();
    respond(error_response(*error));
    return;
  }
  watch_disconnect();
}

void HttpSession::pump() {
  if (writing_ || !exchange_ || closed_) return;
  exchange_->take(out_);
  if (out_.cancel_dispatches) exchange_->cancel();
  if (out_.state == ExchangeState::kFailed) {
    const openai::ApiError error = *out_.error;
    end_exchange();
    respond(error_response(error));
    return;
  }
  if (out_.state == ExchangeState::kCancelled) {  // the server is stopping
    end_exchange();
    close();
    return;
  }
  if (!exchange_->streaming()) {
    if (out_.state == ExchangeState::kComplete) {
      SimpleResponse r;
      r.body.swap(out_.bytes);
      end_exchange();
      respond(std::move(r));
    }
    return;
  }

  const bool done = out_.state == ExchangeState::kComplete ||
                    out_.state == ExchangeState::kFailedAfterOpen;
  const bool close_after = done && (out_.state == ExchangeState::kFailedAfterOpen || stream_raw_ ||
                                    !keep_alive_);
  std::array<net::const_buffer, 5> buffers{};
  if (out_.open) {
    ctx_.frontend.metrics().count_http(handler_, 200);
    head_.clear();
    append_head(head_, 200, "text/event-stream; charset=utf-8",
                "Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n", stream_raw_ || !keep_alive_);
    if (!stream_raw_) head_ += "Transfer-Encoding: chunked\r\n";
    head_ += kCrlf;
    buffers[0] = net::buffer(head_);
  }
  if (!out_.bytes.empty()) {
    if (stream_raw_) {
      buffers[2] = net::buffer(out_.bytes);
    } else {
      const auto r = fmt::format_to_n(chunk_size_, sizeof(chunk_size_), "{:x}\r\n", out_.bytes.size());
      buffers[1] = net::buffer(chunk_size_, r.size);
      buffers[2] = net::buffer(out_.bytes);
      buffers[3] = net::buffer(kCrlf.data(), kCrlf.size());
    }
  }
  if (done && !stream_raw_) buffers[4] = net::buffer(kLastChunk.data(), kLastChunk.size());
  if (net::buffer_size(buffers) == 0) {
    if (done) {  // nothing left to send (cannot happen with [DONE], kept for safety)
      end_exchange();
      if (close_after) close(); else read_next();
    }
    return;
  }
  writing_ = true;
  stream_.expires_after(ctx_.options.write_timeout);
  net::async_write(stream_, buffers,
                   [self = shared_from_this(), done, close_after](beast::error_code ec, size_t) {
                     self->on_stream_written(ec, done, close_after);
                   });
}

void HttpSession::on_stream_written(beast::error_code ec, bool done, bool close_after) {
  writing_ = false;
  stream_.expires_never();
  if (ec) {
    abort_exchange(ec.message());
    return;
  }
  if (!done) {
    pump();
    return;
  }
  end_exchange();
  if (close_after) {
    close();
  } else {
    read_next();
  }
}

void HttpSession::watch_disconnect() {
  if (watching_ || closed_) return;
  watching_ = true;
  stream_.socket().async_wait(tcp::socket::wait_read,
                              beast::bind_front_handler(&HttpSession::on_readable,
                                                        shared_from_this()));
}

void HttpSession::on_readable(beast::error_code ec) {
  watching_ = false;
  if (ec || !exchange_ || closed_) return;
  // Readable while a response is being produced: the client closed (or reset) the connection,
  // or it sent its next request early (pipelining), which stays in the socket for later.
  char byte = 0;
  const ssize_t r = ::recv(stream_.socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
    abort_exchange("the client closed the connection");
    return;
  }
  if (r < 0) watch_disconnect();  // spurious wake-up
  // r > 0: pipelined bytes; a closed peer will show as a failed write.
}

void HttpSession::end_exchange() {
  if (!exchange_) return;
  exchange_->detach();
  ctx_.exchanges.remove(exchange_id_);
  exchange_.reset();
}

void HttpSession::abort_exchange(std::string_view why) {
  if (exchange_) {
    log::debug("http: cancelling a request: {}", why);
    exchange_->cancel();
    end_exchange();
  }
  close();
}

// ---- closing ----

void HttpSession::linger_close() {
  // Stop sending, then read and drop what the client still sends (a body we refused), so that
  // closing does not reset the connection before the client has read our answer.
  if (closed_) return;
  beast::error_code ec;
  stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
  if (ec) {
    close();
    return;
  }
  buffer_.consume(buffer_.size());
  drained_ = 0;
  stream_.expires_after(kDrainTimeout);
  drain();
}

void HttpSession::drain() {
  stream_.async_read_some(buffer_.prepare(kReadChunk),
                          [self = shared_from_this()](beast::error_code ec, size_t n) {
                            self->drained_ += n;
                            if (ec || self->drained_ > kDrainLimit) {
                              self->close();
                              return;
                            }
                            self->drain();
                          });
}

void HttpSession::close() {
  if (closed_) return;
  closed_ = true;
  beast::error_code ec;
  stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
  stream_.close();
}

}  // namespace cleave::router
