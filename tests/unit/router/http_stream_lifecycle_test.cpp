// Lives of requests beyond the happy path: a client that disconnects mid-stream (or while a
// non-streaming answer is being generated) has its request cancelled and every KV block back
// in the engine's pool; a stream whose dispatch fails after it opened ends with an SSE error
// event, [DONE] and a closed connection; stopping the server with streams in flight cancels
// them; many concurrent streams on a single I/O thread all complete.
#include <gtest/gtest.h>

#include <thread>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "http_test_util.h"

namespace cleave::router::testing_http {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

// A request that runs for a long time (thousands of tokens) unless it is cancelled.
json long_request(bool stream) {
  json j = {{"prompt", "Once upon a time"}, {"max_tokens", 8000}, {"temperature", 0},
            {"ignore_eos", true}};
  if (stream) j["stream"] = true;
  return j;
}

std::string raw_post(const std::string& target, const json& body) {
  const std::string b = body.dump();
  return fmt::format("POST {} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Content-Length: {}\r\n\r\n{}",
                     target, b.size(), b);
}

class HttpStreamLifecycleTest : public ::testing::Test {
 protected:
  static void TearDownTestSuite() { remove_router_synth_dir(); }
};

TEST_F(HttpStreamLifecycleTest, ClientDisconnectCancelsStreamingAndNonStreamingRequests) {
  auto router = RouterUnderTest::start();
  ASSERT_NE(router, nullptr);
  for (const bool stream : {true, false}) {
    const uint64_t cancelled_before = router->engine->stats().requests_cancelled;
    {
      TestClient c(router->port());
      ASSERT_TRUE(c.send_raw(raw_post("/v1/completions", long_request(stream))));
      if (stream) {
        ASSERT_TRUE(c.read_until("data: ")) << "no first chunk";
      } else {
        // Wait until the engine runs it, then go away without reading.
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (router->engine->stats().running == 0 && std::chrono::steady_clock::now() < until) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        ASSERT_EQ(router->engine->stats().running, 1);
      }
      c.close();
    }
    router->expect_engine_idle();
    const EngineStats s = router->engine->stats();
    EXPECT_EQ(s.requests_cancelled, cancelled_before + 1) << (stream ? "stream" : "plain");
    EXPECT_EQ(s.blocks_used, 0);
    EXPECT_EQ(router->dispatcher->in_flight(), 0);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (router->server->connections() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(router->server->connections(), 0);
  TestClient c(router->port());
  const auto m = c.request("GET", "/metrics");
  EXPECT_NE(m.body.find("cleave:request_success_total{finished_reason=\"abort\"} 2"),
            std::string::npos)
      << m.body;
  EXPECT_NE(m.body.find("cleave:num_requests_running 0\n"), std::string::npos);
}

TEST_F(HttpStreamLifecycleTest, DispatchFailureAfterTheStreamOpenedEndsItWithAnErrorEvent) {
  auto router = RouterUnderTest::start();
  ASSERT_NE(router, nullptr);
  TestClient c(router->port());
  ASSERT_TRUE(c.send_raw(raw_post("/v1/completions", long_request(true))));
  std::string seen;
  ASSERT_TRUE(c.read_until("data: ", &seen));
  EXPECT_EQ(seen.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << seen;
  // The worker goes away mid-stream: the engine ends the request with Unavailable.
  router->engine->shutdown();
  std::string rest;
  ASSERT_TRUE(c.wait_closed(&rest)) << "the connection stays open after the failure";
  const std::string all = seen + rest;
  const size_t error_at = all.find("data: {\"error\":");
  ASSERT_NE(error_at, std::string::npos) << all.substr(all.size() > 2000 ? all.size() - 2000 : 0);
  const size_t line_end = all.find("\n\n", error_at);
  ASSERT_NE(line_end, std::string::npos);
  const json e = json::parse(all.substr(error_at + 6, line_end - error_at - 6), nullptr, false);
  ASSERT_FALSE(e.is_discarded());
  EXPECT_EQ(e["error"]["type"], "server_error");
  EXPECT_EQ(e["error"]["code"], "service_unavailable");
  EXPECT_NE(all.find("data: [DONE]\n\n", line_end), std::string::npos);
  EXPECT_NE(all.find("\r\n0\r\n\r\n", line_end), std::string::npos) << "chunked stream not ended";
  EXPECT_EQ(router->dispatcher->in_flight(), 0);

  // Before any stream opens, the same failure is a plain 503.
  TestClient d(router->port());
  const auto r = d.post_json("/v1/completions", long_request(true));
  expect_error(r, 503, "server_error");
}

TEST_F(HttpStreamLifecycleTest, StoppingTheServerCancelsStreamsInFlight) {
  auto router = RouterUnderTest::start();
  ASSERT_NE(router, nullptr);
  std::vector<std::unique_ptr<TestClient>> clients;
  for (int i = 0; i < 3; ++i) {
    clients.push_back(std::make_unique<TestClient>(router->port()));
    ASSERT_TRUE(clients.back()->send_raw(raw_post("/v1/completions", long_request(true))));
    ASSERT_TRUE(clients.back()->read_until("data: "));
  }
  const auto t0 = std::chrono::steady_clock::now();
  router->server->stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  for (auto& c : clients) EXPECT_TRUE(c->wait_closed());
  router->expect_engine_idle();
  EXPECT_EQ(router->engine->stats().requests_cancelled, 3u);
  EXPECT_EQ(router->server->connections(), 0);
}

TEST_F(HttpStreamLifecycleTest, ManyConcurrentStreamsOnOneIoThreadAllComplete) {
  auto router = RouterUnderTest::start();
  ASSERT_NE(router, nullptr);
  constexpr int kClients = 48;
  net::io_context ioc;
  struct Conn {
    tcp::socket socket;
    beast::flat_buffer buffer;
    http::request<http::string_body> req;
    http::response<http::string_body> res;
    beast::error_code ec;
    bool done = false;
    explicit Conn(net::io_context& ioc) : socket(ioc) {}
  };
  std::vector<std::unique_ptr<Conn>> conns;
  const tcp::endpoint ep(net::ip::make_address("127.0.0.1"),
                         static_cast<unsigned short>(router->port()));
  for (int i = 0; i < kClients; ++i) {
    auto conn = std::make_unique<Conn>(ioc);
    Conn* c = conn.get();
    c->req = http::request<http::string_body>(http::verb::post, "/v1/chat/completions", 11);
    c->req.set(http::field::host, "x");
    c->req.body() = json{{"messages", json::array({{{"role", "user"},
                                                    {"content", fmt::format("story {}", i)}}})},
                         {"max_tokens", 24 + i % 8},
                         {"seed", i},
                         {"ignore_eos", true},
                         {"stream", true}}
                        .dump();
    c->req.prepare_payload();
    c->socket.async_connect(ep, [c](beast::error_code ec) {
      if (ec) {
        c->ec = ec;
        c->done = true;
        return;
      }
      http::async_write(c->socket, c->req, [c](beast::error_code wec, size_t) {
        if (wec) {
          c->ec = wec;
          c->done = true;
          return;
        }
        http::async_read(c->socket, c->buffer, c->res, [c](beast::error_code rec, size_t) {
          c->ec = rec;
          c->done = true;
        });
      });
    });
    conns.push_back(std::move(conn));
  }
  ioc.run_for(std::chrono::seconds(15));
  for (int i = 0; i < kClients; ++i) {
    const Conn& c = *conns[static_cast<size_t>(i)];
    ASSERT_TRUE(c.done) << "client " << i << " did not finish";
    ASSERT_FALSE(c.ec) << c.ec.message();
    ASSERT_EQ(c.res.result_int(), 200) << c.res.body();
    bool done = false;
    const auto merged = merge_stream(sse_chunks(c.res.body(), &done), /*chat=*/true);
    EXPECT_TRUE(done);
    ASSERT_EQ(merged.size(), 1u);
    EXPECT_EQ(merged.at(0).finish_reason, "length");
  }
  router->expect_engine_idle();
  EXPECT_EQ(router->engine->stats().requests_finished, static_cast<uint64_t>(kClients));
}

}  // namespace
}  // namespace cleave::router::testing_http
