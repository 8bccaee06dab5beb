// The HTTP side of `cleave bench serve`: keep-alive connections to one endpoint, a streamed
// completion read event by event into an SseTimeline, and a plain GET. Coroutines on one
// io_context; nothing here is thread-safe.
#pragma once

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "cleave/bench/serve_bench.h"
#include "cleave/bench/serve_metrics.h"

namespace cleave::bench {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;

struct HttpTarget {
  BaseUrl url;
  std::vector<tcp::endpoint> endpoints;  // what the host resolved to
  std::string api_key;
};

// Resolves the host of `url` (synchronously, once).
Result<HttpTarget> resolve_target(const BaseUrl& url, const std::string& api_key);

// Idle keep-alive connections, reused most recent first; one the server has closed is dropped
// when it comes up.
class ConnectionPool {
 public:
  explicit ConnectionPool(const HttpTarget& target) : target_(target) {}
  // An idle connection still open (reused = true) when `allow_reuse`, else a new one; an error
  // names the address.
  net::awaitable<Result<std::unique_ptr<beast::tcp_stream>>> acquire(Clock::time_point deadline,
                                                                      bool allow_reuse, bool* reused);
  void release(std::unique_ptr<beast::tcp_stream> stream);
  void close_all();

 private:
  const HttpTarget& target_;
  std::vector<std::unique_ptr<beast::tcp_stream>> idle_;
};

// POSTs `body` (a streaming completion request) to `path` and reads the stream. `t0` is the
// run's start (record times are from it); the request gives up at `deadline`.
net::awaitable<RequestRecord> stream_completion(ConnectionPool& pool, const HttpTarget& target,
                                                const std::string& path, const std::string& body,
                                                int64_t input_len, Clock::time_point t0,
                                                Clock::time_point deadline);

struct HttpReply {
  int status = 0;
  std::string body;
};
// GET `path` on a fresh connection, within `timeout`.
Result<HttpReply> http_get(const HttpTarget& target, const std::string& path,
                           std::chrono::milliseconds timeout);

}  // namespace cleave::bench
