// TestClient (http_test_util.h) over Boost.Beast: one connection, every operation run on the
// client's own io_context for at most its timeout.
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cctype>

#include "http_test_util.h"

namespace cleave::router::testing_http {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

struct TestClient::Connection {
  Connection(int port, std::chrono::milliseconds timeout)
      : port(port), timeout(timeout), socket(ioc) {}

  // Runs the pending operation; false (and the socket closed) on timeout.
  bool run(std::optional<std::chrono::milliseconds> limit = std::nullopt) {
    ioc.restart();
    ioc.run_for(limit.value_or(timeout));
    if (!ioc.stopped()) {
      close();
      ioc.restart();
      ioc.run();  // lets the cancelled handler run
      return false;
    }
    return true;
  }

  void close() {
    beast::error_code ec;
    socket.shutdown(tcp::socket::shutdown_both, ec);
    socket.close(ec);
  }

  template <typename Message>
  bool write(Message& msg) {
    beast::error_code result = net::error::timed_out;
    http::async_write(socket, msg, [&](beast::error_code ec, size_t) { result = ec; });
    return run() && !result;
  }

  // One read of at most sizeof(buf) bytes, appended to `got`; false on timeout, `*ended` on EOF
  // or an error.
  bool read_some(std::string& got, bool* ended,
                 std::optional<std::chrono::milliseconds> limit = std::nullopt) {
    char buf[4096];
    beast::error_code result = net::error::timed_out;
    size_t n = 0;
    socket.async_read_some(net::buffer(buf), [&](beast::error_code ec, size_t k) {
      result = ec;
      n = k;
    });
    if (!run(limit)) return false;
    got.append(buf, n);
    *ended = static_cast<bool>(result);
    return true;
  }

  int port;
  std::chrono::milliseconds timeout;
  net::io_context ioc;
  tcp::socket socket;
  beast::flat_buffer buffer;
};

TestClient::TestClient(int port, std::chrono::milliseconds timeout)
    : c_(std::make_unique<Connection>(port, timeout)) {
  connect();
}

TestClient::~TestClient() = default;

bool TestClient::connect() {
  beast::error_code ec;
  c_->socket.close(ec);
  c_->socket = tcp::socket(c_->ioc);
  c_->socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"),
                                   static_cast<unsigned short>(c_->port)),
                     ec);
  c_->buffer.consume(c_->buffer.size());
  return !ec;
}

bool TestClient::is_open() const { return c_->socket.is_open(); }

void TestClient::close() { c_->close(); }

HttpResponse TestClient::request(const std::string& method, const std::string& target,
                                 const std::string& body,
                                 const std::vector<std::pair<std::string, std::string>>& headers) {
  http::request<http::string_body> req;
  req.method_string(method);
  req.target(target);
  req.version(11);
  req.set(http::field::host, "127.0.0.1");
  if (!body.empty() || method == "POST") req.set(http::field::content_type, "application/json");
  for (const auto& [k, v] : headers) req.set(k, v);
  req.body() = body;
  req.prepare_payload();
  if (!c_->write(req)) return {};
  return read_response();
}

bool TestClient::send_raw(std::string_view bytes) {
  beast::error_code result = net::error::timed_out;
  net::async_write(c_->socket, net::buffer(bytes.data(), bytes.size()),
                   [&](beast::error_code ec, size_t) { result = ec; });
  return c_->run() && !result;
}

HttpResponse TestClient::head(const std::string& target,
                              const std::vector<std::pair<std::string, std::string>>& headers) {
  http::request<http::empty_body> req{http::verb::head, target, 11};
  req.set(http::field::host, "127.0.0.1");
  for (const auto& [k, v] : headers) req.set(k, v);
  if (!c_->write(req)) return {};
  return read_response(/*head=*/true);
}

HttpResponse TestClient::read_response(bool head) {
  HttpResponse out;
  http::response_parser<http::string_body> parser;
  parser.skip(head);
  parser.body_limit(64u << 20);
  beast::error_code result = net::error::timed_out;
  http::async_read(c_->socket, c_->buffer, parser,
                   [&](beast::error_code ec, size_t) { result = ec; });
  if (!c_->run() || result) return out;
  const auto& res = parser.get();
  out.status = res.result_int();
  out.body = res.body();
  out.keep_alive = res.keep_alive();
  for (const auto& f : res) {
    std::string name(f.name_string());
    for (auto& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    out.headers[name] = std::string(f.value());
  }
  return out;
}

bool TestClient::read_until(std::string_view needle, std::string* seen) {
  std::string got;
  const auto deadline = std::chrono::steady_clock::now() + c_->timeout;
  while (got.find(needle) == std::string::npos) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    bool ended = false;
    if (!c_->read_some(got, &ended) || ended) {
      if (seen) *seen = got;
      return false;
    }
  }
  if (seen) *seen = got;
  return true;
}

bool TestClient::wait_closed(std::string* seen, std::optional<std::chrono::milliseconds> timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout.value_or(c_->timeout);
  std::string got(static_cast<const char*>(c_->buffer.data().data()), c_->buffer.size());
  c_->buffer.consume(c_->buffer.size());
  for (;;) {
    if (std::chrono::steady_clock::now() > deadline) break;
    bool ended = false;
    const bool done = c_->read_some(
        got, &ended,
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                              std::chrono::steady_clock::now()));
    if (!done) break;
    if (ended) {
      if (seen) *seen = got;
      return true;
    }
  }
  if (seen) *seen = got;
  return false;
}

}  // namespace cleave::router::testing_http
