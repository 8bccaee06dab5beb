// router_bench's HTTP side: the response parser, the blocking client and the stream load.
#include "router_bench_sse.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/asio.hpp>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "fmt/format.h"

namespace cleave::bench {
namespace {

constexpr size_t kMaxHead = 64 << 10;
constexpr size_t kKeptBody = 4 << 10;

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

}  // namespace

void HttpResponseParser::reset() {
  state_ = State::kHead;
  in_.clear();
  sse_.clear();
  body_.clear();
  error_.clear();
  status_ = 0;
  keep_alive_ = true;
  event_stream_ = false;
  left_ = 0;
}

bool HttpResponseParser::fail(std::string why) {
  if (error_.empty()) error_ = std::move(why);
  return false;
}

bool HttpResponseParser::parse_head(std::string_view head) {
  const size_t eol = head.find("\r\n");
  const std::string_view status_line = head.substr(0, eol);
  if (status_line.rfind("HTTP/1.", 0) != 0 || status_line.size() < 12) {
    return fail(fmt::format("bad status line '{}'", status_line));
  }
  status_ = std::atoi(std::string(status_line.substr(9, 3)).c_str());
  keep_alive_ = status_line.rfind("HTTP/1.1", 0) == 0;
  bool chunked = false;
  int64_t length = -1;
  size_t pos = eol == std::string_view::npos ? head.size() : eol + 2;
  while (pos < head.size()) {
    size_t end = head.find("\r\n", pos);
    if (end == std::string_view::npos) end = head.size();
    const std::string_view line = head.substr(pos, end - pos);
    pos = end + 2;
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;
    const std::string name = lower(trim(line.substr(0, colon)));
    const std::string value = lower(trim(line.substr(colon + 1)));
    if (name == "transfer-encoding") chunked = value.find("chunked") != std::string::npos;
    else if (name == "content-length") length = std::strtoll(value.c_str(), nullptr, 10);
    else if (name == "connection") keep_alive_ = value.find("close") == std::string::npos;
    else if (name == "content-type") event_stream_ = value.rfind("text/event-stream", 0) == 0;
  }
  if (chunked) {
    state_ = State::kChunkSize;
  } else if (length >= 0) {
    left_ = static_cast<uint64_t>(length);
    state_ = left_ == 0 ? State::kDone : State::kLength;
  } else {
    state_ = State::kUntilClose;
    keep_alive_ = false;
  }
  return true;
}

void HttpResponseParser::on_body(std::string_view bytes, const EventFn& on_event) {
  if (!(event_stream_ && status_ == 200)) {
    body_.append(bytes.substr(0, kKeptBody - std::min(kKeptBody, body_.size())));
    return;
  }
  sse_.append(bytes);
  size_t start = 0;
  for (;;) {
    const size_t end = sse_.find("\n\n", start);
    if (end == std::string::npos) break;
    std::string_view event(sse_.data() + start, end - start);
    start = end + 2;
    // One event may hold several lines; only data lines matter here.
    while (!event.empty()) {
      size_t nl = event.find('\n');
      const std::string_view line = event.substr(0, nl);
      event.remove_prefix(nl == std::string_view::npos ? event.size() : nl + 1);
      if (line.rfind("data:", 0) != 0) continue;
      std::string_view data = line.substr(5);
      if (!data.empty() && data.front() == ' ') data.remove_prefix(1);
      on_event(data);
    }
  }
  sse_.erase(0, start);
}

bool HttpResponseParser::feed(const char* data, size_t size, const EventFn& on_event) {
  if (!error_.empty()) return false;
  in_.append(data, size);
  size_t pos = 0;
  for (;;) {
    const std::string_view rest(in_.data() + pos, in_.size() - pos);
    if (state_ == State::kHead) {
      const size_t end = rest.find("\r\n\r\n");
      if (end == std::string_view::npos) {
        if (rest.size() > kMaxHead) return fail("response head over 64 KiB");
        break;
      }
      if (!parse_head(rest.substr(0, end))) return false;
      pos += end + 4;
    } else if (state_ == State::kChunkSize) {
      const size_t end = rest.find("\r\n");
      if (end == std::string_view::npos) {
        if (rest.size() > 1024) return fail("chunk size line too long");
        break;
      }
      const std::string line(rest.substr(0, end));
      char* stop = nullptr;
      const unsigned long long n = std::strtoull(line.c_str(), &stop, 16);
      if (stop == line.c_str()) return fail(fmt::format("bad chunk size '{}'", line));
      pos += end + 2;
      left_ = n;
      state_ = n == 0 ? State::kTrailer : State::kChunkData;
    } else if (state_ == State::kChunkData || state_ == State::kLength) {
      if (rest.empty()) break;
      const size_t take = static_cast<size_t>(std::min<uint64_t>(left_, rest.size()));
      on_body(rest.substr(0, take), on_event);
      pos += take;
      left_ -= take;
      if (left_ == 0) state_ = state_ == State::kChunkData ? State::kChunkEnd : State::kDone;
    } else if (state_ == State::kChunkEnd) {
      if (rest.size() < 2) break;
      if (rest.substr(0, 2) != "\r\n") return fail("chunk not followed by CRLF");
      pos += 2;
      state_ = State::kChunkSize;
    } else if (state_ == State::kTrailer) {
      const size_t end = rest.find("\r\n");
      if (end == std::string_view::npos) break;
      pos += end + 2;
      if (end == 0) state_ = State::kDone;
    } else if (state_ == State::kUntilClose) {
      if (rest.empty()) break;
      on_body(rest, on_event);
      pos = in_.size();
    } else {  // kDone: bytes past the response (a pipelined one cannot come: we send one)
      if (!rest.empty()) return fail("bytes after the end of the response");
      break;
    }
  }
  in_.erase(0, pos);
  return true;
}

bool HttpResponseParser::on_eof() {
  if (state_ == State::kUntilClose) {
    state_ = State::kDone;
    return true;
  }
  if (state_ == State::kDone) return true;
  return fail(head_done() ? "the connection closed in the middle of the body"
                          : "the connection closed before the response head");
}

SseEvent classify_sse(std::string_view data) {
  SseEvent e;
  if (data == "[DONE]") {
    e.kind = SseEvent::Kind::kDone;
  } else if (data.rfind("{\"error\"", 0) == 0) {
    e.kind = SseEvent::Kind::kError;
  } else if (data.find("\"choices\":[{") != std::string_view::npos) {
    e.kind = SseEvent::Kind::kChunk;
  } else if (const size_t u = data.find("\"usage\":{"); u != std::string_view::npos) {
    e.kind = SseEvent::Kind::kUsage;
    constexpr std::string_view kKey = "\"completion_tokens\":";
    const size_t k = data.find(kKey, u);
    if (k != std::string_view::npos) {
      e.completion_tokens = std::strtoll(std::string(data.substr(k + kKey.size(), 20)).c_str(),
                                         nullptr, 10);
    }
  }
  return e;
}

// ---------------------------------------------------------------------------------------------
// Blocking client.

BlockingHttpClient::~BlockingHttpClient() {
  close_connection();
}

void BlockingHttpClient::close_connection() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

namespace {

int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, 60000));
}

// Waits for `events` on fd until the deadline; false on timeout.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int left = ms_left(deadline);
    const int r = ::poll(&p, 1, left);
    if (r > 0) return true;
    if (r == 0 && left == 0) return false;
    if (r < 0 && errno != EINTR) return false;
  }
}

}  // namespace

bool BlockingHttpClient::ensure_connected(Clock::time_point deadline, std::string* error) {
  if (fd_ >= 0) return true;
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd_ < 0) {
    *error = fmt::format("socket: {}", std::strerror(errno));
    return false;
  }
  const int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port_));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int r = ::connect(fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  if (r != 0 && errno == EINPROGRESS) {
    if (!wait_fd(fd_, POLLOUT, deadline)) {
      *error = "connect timed out";
      close_connection();
      return false;
    }
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len);
    errno = err;
    r = err == 0 ? 0 : -1;
  }
  if (r != 0) {
    *error = fmt::format("connect to 127.0.0.1:{}: {}", port_, std::strerror(errno));
    close_connection();
    return false;
  }
  ++connects_;
  return true;
}

BlockingHttpClient::Response BlockingHttpClient::request(std::string_view method,
                                                         std::string_view target,
                                                         std::string_view body,
                                                         Clock::time_point deadline) {
  Response resp;
  if (!ensure_connected(deadline, &resp.error)) return resp;
  std::string req = fmt::format("{} {} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n", method, target, port_);
  if (!body.empty()) {
    req += fmt::format("Content-Type: application/json\r\nContent-Length: {}\r\n", body.size());
  }
  req += "\r\n";
  req += body;
  parser_.reset();
  auto fail = [&](std::string why) {
    resp.error = std::move(why);
    close_connection();
    return resp;
  };
  const auto t0 = Clock::now();
  size_t sent = 0;
  while (sent < req.size()) {
    const ssize_t n = ::send(fd_, req.data() + sent, req.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!wait_fd(fd_, POLLOUT, deadline)) return fail("send timed out");
    } else {
      return fail(fmt::format("send: {}", std::strerror(errno)));
    }
  }
  auto on_event = [&](std::string_view data) {
    const SseEvent e = classify_sse(data);
    switch (e.kind) {
      case SseEvent::Kind::kChunk:
        if (resp.chunks++ == 0) {
          resp.first_chunk_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
        }
        break;
      case SseEvent::Kind::kUsage: resp.completion_tokens = e.completion_tokens; break;
      case SseEvent::Kind::kError: resp.error_event = true; break;
      case SseEvent::Kind::kDone: resp.done_event = true; break;
      case SseEvent::Kind::kOther: break;
    }
  };
  std::array<char, 16384> buf{};
  while (!parser_.done()) {
    const ssize_t n = ::recv(fd_, buf.data(), buf.size(), 0);
    if (n > 0) {
      if (!parser_.feed(buf.data(), static_cast<size_t>(n), on_event)) return fail(parser_.error());
    } else if (n == 0) {
      if (!parser_.on_eof()) return fail(parser_.error());
    } else if (errno == EAGAIN || errno == EINTR) {
      if (!wait_fd(fd_, POLLIN, deadline)) return fail("timed out waiting for the response");
    } else {
      return fail(fmt::format("recv: {}", std::strerror(errno)));
    }
  }
  resp.ok = true;
  resp.status = parser_.status();
  resp.body = parser_.body();
  if (!parser_.keep_alive()) close_connection();
  return resp;
}

// ---------------------------------------------------------------------------------------------
// Stream load: one io_context on this thread, one socket per stream.

namespace {

namespace net = boost::asio;
using tcp = net::ip::tcp;

struct LoadState;

struct Stream : std::enable_shared_from_this<Stream> {
  Stream(LoadState& s, net::io_context& io) : load(s), socket(io) {}
  void start();
  void on_connect(const boost::system::error_code& ec);
  void send(const std::shared_ptr<const std::string>& request);
  void read();
  void on_read(const boost::system::error_code& ec, size_t n);
  void finish(bool ok);
  void fail(int64_t StreamLoadResult::*counter, std::string why);
  void on_event(std::string_view data);

  LoadState& load;
  tcp::socket socket;
  HttpResponseParser parser;
  std::array<char, 8192> buf{};
  bool connecting = false;
  bool connected = false;
  bool sent = false;
  bool open = false;  // head received, [DONE] not yet
  bool ended = false;
  bool error_event = false;
  bool done_event = false;
  int64_t completion_tokens = -1;
};

struct LoadState {
  const StreamLoadOptions& options;
  net::io_context& io;
  StreamLoadResult result;
  Clock::time_point t0;
  std::vector<std::shared_ptr<Stream>> streams;
  int64_t next = 0;        // index of the next stream to start
  int64_t connecting = 0;
  int64_t connected = 0;
  int64_t open = 0;
  int64_t heads = 0;
  int64_t sent = 0;
  int64_t ended = 0;
  bool first_end_seen = false;
  bool stopping = false;
  bool requests_sent = false;
  Clock::time_point sends_started;
  std::map<int, int64_t> statuses;

  LoadState(const StreamLoadOptions& o, net::io_context& i) : options(o), io(i) {}

  void start_more() {
    while (!stopping && next < options.streams && connecting < options.max_connecting) {
      auto s = std::make_shared<Stream>(*this, io);
      streams.push_back(s);
      ++next;
      ++result.started;
      s->start();
    }
  }
  // Once every connect has ended, each connected stream sends its request: the requests go
  // out together, so that no stream ends before the last one started.
  void send_when_all_connected() {
    if (requests_sent || next < options.streams || connecting > 0) return;
    requests_sent = true;
    result.connect_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    auto request = std::make_shared<const std::string>(fmt::format(
        "POST {} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Type: application/json\r\n"
        "Content-Length: {}\r\n\r\n{}",
        options.target, options.port, options.body.size(), options.body));
    sends_started = Clock::now();
    for (auto& s : streams) {
      if (s->connected && !s->ended) s->send(request);
    }
  }
  void note_error(const std::string& why) {
    if (result.first_error.empty()) result.first_error = why;
  }
};

void Stream::start() {
  connecting = true;
  ++load.connecting;
  const tcp::endpoint ep(net::ip::address_v4::loopback(), static_cast<uint16_t>(load.options.port));
  socket.async_connect(ep, [self = shared_from_this()](const boost::system::error_code& ec) {
    self->on_connect(ec);
  });
}

void Stream::on_connect(const boost::system::error_code& ec) {
  connecting = false;
  --load.connecting;
  if (ended) return;  // closed by the deadline
  if (ec) {
    fail(&StreamLoadResult::connect_errors, "connect: " + ec.message());
    load.start_more();
    load.send_when_all_connected();
    return;
  }
  connected = true;
  load.result.peak_connected = std::max(load.result.peak_connected, ++load.connected);
  boost::system::error_code ignored;
  socket.set_option(tcp::no_delay(true), ignored);
  load.start_more();
  load.send_when_all_connected();
}

void Stream::send(const std::shared_ptr<const std::string>& request) {
  net::async_write(socket, net::buffer(*request),
                   [self = shared_from_this(), request](const boost::system::error_code& ec,
                                                        size_t) {
                     if (self->ended) return;
                     if (ec) {
                       self->fail(&StreamLoadResult::io_errors, "write: " + ec.message());
                       return;
                     }
                     self->sent = true;
                     ++self->load.sent;
                   });
  read();
}

void Stream::read() {
  socket.async_read_some(net::buffer(buf),
                         [self = shared_from_this()](const boost::system::error_code& ec,
                                                     size_t n) { self->on_read(ec, n); });
}

void Stream::on_event(std::string_view data) {
  const SseEvent e = classify_sse(data);
  switch (e.kind) {
    case SseEvent::Kind::kChunk: ++load.result.chunks; break;
    case SseEvent::Kind::kUsage: completion_tokens = e.completion_tokens; break;
    case SseEvent::Kind::kError:
      if (!error_event) load.note_error(fmt::format("error event: {}", data.substr(0, 300)));
      error_event = true;
      break;
    case SseEvent::Kind::kDone: done_event = true; break;
    case SseEvent::Kind::kOther: break;
  }
}

void Stream::on_read(const boost::system::error_code& ec, size_t n) {
  if (ended) return;
  const bool had_head = parser.head_done();
  bool parsed = true;
  if (!ec) {
    parsed = parser.feed(buf.data(), n, [this](std::string_view d) { on_event(d); });
  } else if (ec == net::error::eof) {
    parsed = parser.on_eof();
  } else {
    fail(&StreamLoadResult::io_errors, "read: " + ec.message());
    return;
  }
  if (!parsed) {
    fail(&StreamLoadResult::io_errors, parser.error());
    return;
  }
  if (!had_head && parser.head_done()) {
    ++load.heads;
    ++load.statuses[parser.status()];
    if (parser.status() == 200) {
      open = true;
      load.result.peak_open = std::max(load.result.peak_open, ++load.open);
    }
    if (load.heads == load.options.streams) {
      load.result.all_open_seconds =
          std::chrono::duration<double>(Clock::now() - load.sends_started).count();
    }
  }
  if (parser.done()) {
    if (parser.status() != 200) {
      fail(&StreamLoadResult::http_errors,
           fmt::format("HTTP {}: {}", parser.status(), parser.body().substr(0, 300)));
    } else if (error_event) {
      fail(&StreamLoadResult::error_events, "");
    } else if (!done_event) {
      fail(&StreamLoadResult::io_errors, "the stream ended without data: [DONE]");
    } else if (completion_tokens != load.options.expected_tokens) {
      fail(&StreamLoadResult::wrong_tokens,
           fmt::format("usage.completion_tokens {} (expected {})", completion_tokens,
                       load.options.expected_tokens));
    } else {
      finish(true);
    }
    return;
  }
  if (ec) {  // EOF on a complete response is handled above
    fail(&StreamLoadResult::io_errors, "the connection closed before [DONE]");
    return;
  }
  read();
}

void Stream::finish(bool ok) {
  if (ended) return;
  ended = true;
  if (!load.first_end_seen) {
    load.first_end_seen = true;
    load.result.all_sent_before_first_done = load.sent == load.options.streams ? 1 : 0;
  }
  if (ok) ++load.result.completed;
  if (open) --load.open;
  if (connected) --load.connected;
  open = false;
  connected = false;
  boost::system::error_code ignored;
  socket.shutdown(tcp::socket::shutdown_both, ignored);
  socket.close(ignored);
  ++load.ended;
}

void Stream::fail(int64_t StreamLoadResult::*counter, std::string why) {
  if (ended) return;
  ++(load.result.*counter);
  if (!why.empty()) load.note_error(why);
  finish(false);
}

}  // namespace

StreamLoadResult run_stream_load(const StreamLoadOptions& options) {
  net::io_context io(1);
  LoadState state(options, io);
  state.streams.reserve(static_cast<size_t>(options.streams));
  state.t0 = Clock::now();
  net::steady_timer deadline(io, options.deadline);
  deadline.async_wait([&](const boost::system::error_code& ec) {
    if (ec) return;
    state.stopping = true;
    for (auto& s : state.streams) s->fail(&StreamLoadResult::timeouts, "");
    if (state.result.timeouts > 0) {
      state.note_error(fmt::format("{} streams still open at the deadline", state.result.timeouts));
    }
  });
  // Cancels the deadline once every stream has ended, so that run() returns.
  net::steady_timer check(io);
  std::function<void()> poll_end = [&] {
    check.expires_after(std::chrono::milliseconds(20));
    check.async_wait([&](const boost::system::error_code& ec) {
      if (ec) return;
      if (state.ended == options.streams || state.stopping) {
        deadline.cancel();
        return;
      }
      poll_end();
    });
  };
  state.start_more();
  poll_end();
  io.run();
  state.result.wall_seconds = std::chrono::duration<double>(Clock::now() - state.t0).count();
  for (const auto& [status, n] : state.statuses) {
    if (status == 200) continue;
    if (!state.result.status_counts.empty()) state.result.status_counts += ", ";
    state.result.status_counts += fmt::format("{} x{}", status, n);
  }
  return state.result;
}

}  // namespace cleave::bench
