// The worker's GET /metrics and /health over plain sockets.
#include "metrics_http.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "cleave/common/log.h"
#include "cleave/common/thread_pool.h"
#include "fmt/format.h"

namespace cleave::worker_service {
namespace {

constexpr int kIoTimeoutSeconds = 5;
constexpr size_t kMaxRequestBytes = 16 << 10;

void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    data.remove_prefix(static_cast<size_t>(n));
  }
}

std::string response(int status, std::string_view reason, std::string_view content_type,
                     const std::string& body, bool head) {
  std::string out = fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
      status, reason, content_type, body.size());
  if (!head) out += body;
  return out;
}

}  // namespace

Result<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::start(
    const std::string& host_in, int port, std::function<std::string()> render,
    std::function<bool()> healthy) {
  std::string host = host_in;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
      rc != 0) {
    return InvalidArgument(
        fmt::format("worker.metrics_port: cannot resolve '{}': {}", host_in, ::gai_strerror(rc)));
  }
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  std::string why = "no address";
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    const int one = 1;
    (void)::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 64) != 0) {
      why = std::strerror(errno);
      ::close(fd);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
    server->port_ = bound.ss_family == AF_INET6
                        ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                        : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    server->listen_fd_ = fd;
    break;
  }
  ::freeaddrinfo(res);
  if (server->listen_fd_ < 0) {
    return Unavailable(
        fmt::format("worker.metrics_port: cannot listen on {}:{}: {}", host_in, port, why));
  }
  server->render_ = std::move(render);
  server->healthy_ = std::move(healthy);
  MetricsHttpServer* raw = server.get();
  server->thread_ = std::thread([raw] { raw->loop(); });
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  stop();
}

void MetricsHttpServer::stop() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
}

void MetricsHttpServer::loop() {
  set_thread_name("metrics-http");
  while (!stop_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    const int n = ::poll(&p, 1, 100);
    if (n <= 0 || (p.revents & POLLIN) == 0) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    serve_one(fd);
    ::close(fd);
  }
}

void MetricsHttpServer::serve_one(int fd) {
  timeval tv{kIoTimeoutSeconds, 0};
  (void)::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  (void)::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  std::string request;
  char buf[4096];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestBytes) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
  }
  const size_t line_end = request.find("\r\n");
  const std::string line = request.substr(0, line_end);
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? std::string::npos : line.find(' ', sp1 + 1);
  if (sp2 == std::string::npos) {
    write_all(fd, response(400, "Bad Request", "text/plain", "bad request\n", false));
    return;
  }
  const std::string method = line.substr(0, sp1);
  std::string path = line.substr(sp1 + 1, sp2 - sp1 - 1);
  if (const size_t q = path.find('?'); q != std::string::npos) path.resize(q);
  const bool head = method == "HEAD";
  if (method != "GET" && !head) {
    write_all(fd, response(405, "Method Not Allowed", "text/plain", "GET only\n", false));
    return;
  }
  if (path == "/metrics") {
    write_all(fd, response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", render_(), head));
  } else if (path == "/health") {
    const bool ok = healthy_();
    write_all(fd, response(ok ? 200 : 503, ok ? "OK" : "Service Unavailable", "text/plain",
                           ok ? "ok\n" : "draining\n", head));
  } else {
    write_all(fd, response(404, "Not Found", "text/plain", "not found (try /metrics)\n", head));
  }
}

}  // namespace cleave::worker_service
