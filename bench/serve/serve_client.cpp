// Keep-alive connections and streamed completions over Boost.Beast coroutines.
#include "serve_client.h"

#include <sys/socket.h>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <cerrno>

#include <fmt/format.h>

namespace cleave::bench {
namespace {

constexpr auto kAwait = net::as_tuple(net::use_awaitable);
constexpr size_t kReadChunk = 16 * 1024;

double seconds_since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

// An idle keep-alive connection can carry a request when nothing is waiting on it: no end of
// stream (the server closed it), no error, no unsolicited bytes.
bool reusable(beast::tcp_stream& s) {
  char byte = 0;
  const ssize_t r = ::recv(s.socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

std::string address_text(const HttpTarget& t) { return fmt::format("{}:{}", t.url.host, t.url.port); }

http::request<http::string_body> make_request(http::verb verb, const HttpTarget& target,
                                              const std::string& path, std::string body) {
  http::request<http::string_body> req{verb, target.url.prefix + path, 11};
  req.set(http::field::host, fmt::format("{}:{}", target.url.host, target.url.port));
  req.set(http::field::user_agent, "cleave-bench-serve");
  if (!target.api_key.empty()) req.set(http::field::authorization, "Bearer " + target.api_key);
  if (verb == http::verb::post) {
    req.set(http::field::content_type, "application/json");
    req.set(http::field::accept, "text/event-stream");
  }
  req.keep_alive(true);
  req.body() = std::move(body);
  req.prepare_payload();
  return req;
}

}  // namespace

Result<HttpTarget> resolve_target(const BaseUrl& url, const std::string& api_key) {
  net::io_context ioc;
  tcp::resolver resolver(ioc);
  beast::error_code ec;
  const auto results = resolver.resolve(url.host, std::to_string(url.port), ec);
  if (ec || results.empty()) {
    return Unavailable(fmt::format("cannot resolve '{}': {}", url.host, ec.message()));
  }
  HttpTarget t;
  t.url = url;
  t.api_key = api_key;
  for (const auto& r : results) t.endpoints.push_back(r.endpoint());
  return t;
}

net::awaitable<Result<std::unique_ptr<beast::tcp_stream>>> ConnectionPool::acquire(
    Clock::time_point deadline, bool allow_reuse, bool* reused) {
  *reused = false;
  while (allow_reuse && !idle_.empty()) {
    auto s = std::move(idle_.back());
    idle_.pop_back();
    if (!reusable(*s)) {  // the server closed it meanwhile (its keep-alive timeout)
      beast::error_code ignored;
      s->socket().close(ignored);
      continue;
    }
    *reused = true;
    co_return std::move(s);
  }
  auto s = std::make_unique<beast::tcp_stream>(co_await net::this_coro::executor);
  s->expires_at(deadline);
  auto [ec, ep] = co_await s->async_connect(target_.endpoints, kAwait);
  if (ec) {
    co_return Unavailable(fmt::format("cannot connect to {}: {}", address_text(target_), ec.message()));
  }
  beast::error_code ignored;
  s->socket().set_option(tcp::no_delay(true), ignored);
  co_return std::move(s);
}

void ConnectionPool::release(std::unique_ptr<beast::tcp_stream> stream) {
  stream->expires_never();
  idle_.push_back(std::move(stream));
}

void ConnectionPool::close_all() {
  for (auto& s : idle_) {
    beast::error_code ec;
    s->socket().shutdown(tcp::socket::shutdown_both, ec);
    s->close();
  }
  idle_.clear();
}

net::awaitable<RequestRecord> stream_completion(ConnectionPool& pool, const HttpTarget& target,
                                                const std::string& path, const std::string& body,
                                                int64_t input_len, Clock::time_point t0,
                                                Clock::time_point deadline) {
  // A reused keep-alive connection the server closes as the request goes out fails before any
  // byte of the response: that attempt is repeated once on a new connection (never on another
  // idle one, which may be as old), timed from the new send.
  for (int attempt = 0;; ++attempt) {
    bool reused = false;
    const auto sent = Clock::now();
    SseTimeline timeline(seconds_since(t0, sent), input_len);
    auto conn = co_await pool.acquire(deadline, /*allow_reuse=*/attempt == 0, &reused);
    if (!conn.ok()) co_return timeline.finish(0, conn.status().message());
    auto stream = std::move(*conn);
    stream->expires_at(deadline);
    auto req = make_request(http::verb::post, target, path, body);
    auto [wec, wn] = co_await http::async_write(*stream, req, kAwait);
    beast::flat_buffer buffer;
    http::response_parser<http::buffer_body> parser;
    parser.body_limit(boost::none);
    beast::error_code ec = wec;
    if (!ec) std::tie(ec, std::ignore) = co_await http::async_read_header(*stream, buffer, parser, kAwait);
    if (ec) {
      if (reused && attempt == 0 && ec != beast::error::timeout) continue;
      co_return timeline.finish(0, ec == beast::error::timeout
                                       ? std::string("timed out before the response")
                                       : fmt::format("no response from {}: {}",
                                                     address_text(target), ec.message()));
    }
    const int status = parser.get().result_int();
    std::string error_body;
    std::vector<char> chunk(kReadChunk);
    while (!parser.is_done()) {
      parser.get().body().data = chunk.data();
      parser.get().body().size = chunk.size();
      std::tie(ec, std::ignore) = co_await http::async_read_some(*stream, buffer, parser, kAwait);
      if (ec == http::error::need_buffer) ec = {};
      const size_t got = chunk.size() - parser.get().body().size;
      if (got > 0) {
        const std::string_view bytes(chunk.data(), got);
        if (status == 200) {
          timeline.feed(seconds_since(t0, Clock::now()), bytes);
        } else if (error_body.size() < 4096) {
          error_body.append(bytes);
        }
      }
      if (ec) break;
    }
    if (ec) {
      const std::string why = ec == beast::error::timeout
                                  ? std::string("timed out while streaming")
                                  : fmt::format("the stream broke: {}", ec.message());
      co_return timeline.finish(status == 200 ? 0 : status, why, error_body);
    }
    if (parser.get().keep_alive()) pool.release(std::move(stream));
    co_return timeline.finish(status, {}, error_body);
  }
}

Result<HttpReply> http_get(const HttpTarget& target, const std::string& path,
                           std::chrono::milliseconds timeout) {
  net::io_context ioc;
  Result<HttpReply> out = Unavailable("no reply");
  net::co_spawn(
      ioc,
      [&]() -> net::awaitable<void> {
        beast::tcp_stream stream(co_await net::this_coro::executor);
        stream.expires_after(timeout);
        auto [cec, ep] = co_await stream.async_connect(target.endpoints, kAwait);
        if (cec) {
          out = Unavailable(fmt::format("cannot connect to {}: {}", address_text(target), cec.message()));
          co_return;
        }
        auto req = make_request(http::verb::get, target, path, {});
        auto [wec, wn] = co_await http::async_write(stream, req, kAwait);
        beast::flat_buffer buffer;
        http::response<http::string_body> res;
        beast::error_code ec = wec;
        if (!ec) std::tie(ec, std::ignore) = co_await http::async_read(stream, buffer, res, kAwait);
        if (ec) {
          out = Unavailable(fmt::format("GET {} on {}: {}", path, address_text(target), ec.message()));
          co_return;
        }
        out = HttpReply{static_cast<int>(res.result_int()), res.body()};
      },
      net::detached);
  ioc.run();
  return out;
}

}  // namespace cleave::bench
