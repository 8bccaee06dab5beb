// Harness of the HTTP frontend tests: a real Dispatcher over an in-process EngineLoop (tokens
// come from the engine, not from a script), the router (frontend + HTTP server) on
// 127.0.0.1:0, and an HTTP client with timeouts (http_test_client.cpp).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../worker/engine_test_util.h"
#include "cleave/common/metrics.h"
#include "cleave/model/chat_template.h"
#include "cleave/router/dispatcher.h"
#include "cleave/router/http_server.h"
#include "cleave/router/router_frontend.h"
#include "cleave/worker/engine_loop.h"
#include "cleave/worker/proto_convert.h"
#include "fmt/format.h"

namespace cleave::router::testing_http {

using json = nlohmann::json;
using testing_engine::ModelUnderTest;

// A synthetic model with a context long enough for streams that outlast a client.
inline std::string router_synth_path() {
  static const std::string path = [] {
    const auto dir = std::filesystem::temp_directory_path() /
                     fmt::format("cleave-router-test-{}", ::getpid());
    std::filesystem::create_directories(dir);
    const std::string p = (dir / "synth.gguf").string();
    SynthOptions o;
    o.layers = 2;
    o.dim = 128;
    o.heads = 4;
    o.kv_heads = 2;
    o.ffn = 256;
    o.vocab = 512;
    o.context = 8192;
    o.seed = 11;
    o.name = "synth-router";
    const Status st = write_synth_model(o, p);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return p;
  }();
  return path;
}

inline void remove_router_synth_dir() {
  std::error_code ec;
  std::filesystem::remove_all(std::filesystem::temp_directory_path() /
                                  fmt::format("cleave-router-test-{}", ::getpid()),
                              ec);
}

// A Dispatcher with one "worker": an EngineLoop in this process. Admission (queue limit,
// readiness) is the dispatcher's; tokens, stops, usage, errors and cancellation are the
// engine's. Callbacks run on the engine thread, one at a time per request, as the real
// dispatcher's run on gRPC threads.
class EngineDispatcher final : public Dispatcher {
 public:
  EngineDispatcher(EngineLoop& engine, std::string model_name)
      : engine_(engine), model_name_(std::move(model_name)) {}

  Result<std::shared_ptr<DispatchHandle>> submit(
      DispatchRequest request, std::shared_ptr<RequestObserver> observer) override {
    if (!ready_.load()) return Unavailable("no worker is ready");
    if (in_flight_.fetch_add(1) >= queue_limit_.load()) {
      in_flight_.fetch_sub(1);
      return ResourceExhausted(
          fmt::format("the router's queue is full ({} requests)", queue_limit_.load()));
    }
    auto call = std::make_shared<Call>();
    call->engine = &engine_;
    call->id = next_id_.fetch_add(1);
    call->observer = std::move(observer);
    EngineRequest er;
    er.id = call->id;
    er.prompt = std::move(request.prompt);
    er.params = std::move(request.params);
    submitted_.fetch_add(1);
    const Status st = engine_.submit(std::move(er), [this, call](const EngineEvent& ev) {
      deliver(*call, ev);
    });
    if (!st.ok()) {
      in_flight_.fetch_sub(1);
      return st;
    }
    return std::shared_ptr<DispatchHandle>(call);
  }

  bool ready() const override { return ready_.load(); }

  std::vector<PoolSnapshot> pools() const override {
    const EngineStats s = engine_.stats();
    PoolSnapshot p;
    p.name = "unified";
    p.workers_known = 1;
    p.workers_ready = ready_.load() ? 1 : 0;
    p.waiting = s.waiting;
    p.running = s.running;
    p.blocks_total = s.blocks_total;
    p.blocks_used = s.blocks_used;
    p.kv_usage = s.blocks_total > 0 ? static_cast<double>(s.blocks_used) / s.blocks_total : 0;
    return {p};
  }

  v1::WorkerInfo model_info() const override {
    v1::WorkerInfo info;
    if (!ready_.load()) return info;
    info.set_model_name(model_name_);
    info.set_max_context(engine_.config().context_length);
    info.set_vocab_size(engine_.config().vocab_size);
    return info;
  }

  void shutdown() override { ready_.store(false); }

  void set_ready(bool ready) { ready_.store(ready); }
  void set_queue_limit(int64_t limit) { queue_limit_.store(limit); }
  int64_t in_flight() const { return in_flight_.load(); }
  int64_t submitted() const { return submitted_.load(); }

 private:
  struct Call final : DispatchHandle {
    EngineLoop* engine = nullptr;
    RequestId id = 0;
    std::mutex mu;  // held while the observer runs: cancel() waits for a running callback
    bool cancelled = false;
    bool started = false;
    std::shared_ptr<RequestObserver> observer;
    void cancel() override {
      {
        std::lock_guard<std::mutex> lk(mu);
        if (cancelled) return;
        cancelled = true;
        observer.reset();
      }
      engine->cancel(id);
    }
  };

  void deliver(Call& call, const EngineEvent& ev) {
    if (ev.finished) in_flight_.fetch_sub(1);
    std::lock_guard<std::mutex> lk(call.mu);
    if (call.cancelled || !call.observer) return;
    if (!ev.error.ok()) {
      call.observer->on_error(ev.error, call.started);
      call.observer.reset();
      return;
    }
    v1::TokenEvent te;
    to_proto(ev, &te);
    call.started = true;
    call.observer->on_event(te);
    if (ev.finished) call.observer.reset();
  }

  EngineLoop& engine_;
  std::string model_name_;
  std::atomic<bool> ready_{true};
  std::atomic<int64_t> queue_limit_{1024};
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> submitted_{0};
  std::atomic<RequestId> next_id_{1};
};

// Engine + dispatcher + frontend + HTTP server on 127.0.0.1:0.
struct RouterUnderTest {
  ModelUnderTest model;
  std::unique_ptr<EngineLoop> engine;
  std::unique_ptr<EngineDispatcher> dispatcher;
  std::unique_ptr<metrics::MetricsRegistry> registry;
  std::unique_ptr<RouterFrontend> frontend;
  std::unique_ptr<HttpServer> server;

  // `chat_template`: a template source; nullopt: the model's (the fallback for synth models).
  static std::unique_ptr<RouterUnderTest> start(HttpServerOptions options = {},
                                                std::optional<std::string> chat_template = {}) {
    auto r = std::make_unique<RouterUnderTest>();
    r->model = ModelUnderTest::load(router_synth_path());
    if (!r->model.file) return nullptr;
    EngineLoopOptions eo;
    eo.kv_cache_bytes = 64ull << 20;
    r->engine = r->model.engine(eo);
    if (!r->engine) return nullptr;
    r->dispatcher = std::make_unique<EngineDispatcher>(*r->engine, "synth-router");
    r->registry = std::make_unique<metrics::MetricsRegistry>();
    auto tmpl = chat_template ? ChatTemplate::parse(*chat_template)
                              : chat_template_or_fallback(r->model.file->tokenizer().chat_template);
    EXPECT_TRUE(tmpl.ok()) << tmpl.status().to_string();
    if (!tmpl.ok()) return nullptr;
    FrontendOptions fo;
    fo.served_model_names = {"synth-router", "synth-alias"};
    auto frontend = RouterFrontend::create(fo, r->model.tok, std::move(*tmpl), *r->dispatcher,
                                           *r->registry);
    EXPECT_TRUE(frontend.ok()) << frontend.status().to_string();
    if (!frontend.ok()) return nullptr;
    r->frontend = std::move(*frontend);
    options.host = "127.0.0.1";
    options.port = 0;
    auto server = HttpServer::start(options, *r->frontend);
    EXPECT_TRUE(server.ok()) << server.status().to_string();
    if (!server.ok()) return nullptr;
    r->server = std::move(*server);
    return r;
  }

  ~RouterUnderTest() {
    if (server) server->stop();
    server.reset();
    frontend.reset();
    if (engine) engine->shutdown();
  }

  int port() const { return server->port(); }

  // Every block back in the pool and nothing running.
  void expect_engine_idle() { testing_engine::expect_all_blocks_back(*engine); }
};

struct HttpResponse {
  int status = 0;  // 0: no response (timeout, connection closed)
  std::string body;
  std::map<std::string, std::string> headers;  // lower-case names
  bool keep_alive = false;

  std::string header(const std::string& lower_name) const {
    auto it = headers.find(lower_name);
    return it == headers.end() ? std::string() : it->second;
  }
  json json_body() const { return json::parse(body, nullptr, false); }
};

// One client connection (Boost.Beast, in http_test_client.cpp, so that the tests that use it do
// not compile Beast); every operation is bounded by `timeout`.
class TestClient {
 public:
  explicit TestClient(int port, std::chrono::milliseconds timeout = std::chrono::seconds(15));
  ~TestClient();
  TestClient(const TestClient&) = delete;
  TestClient& operator=(const TestClient&) = delete;

  bool connect();
  bool is_open() const;
  void close();

  HttpResponse request(const std::string& method, const std::string& target,
                       const std::string& body = "",
                       const std::vector<std::pair<std::string, std::string>>& headers = {});
  HttpResponse post_json(const std::string& target, const json& body,
                         const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    return request("POST", target, body.dump(), headers);
  }
  bool send_raw(std::string_view bytes);
  // A HEAD request; the response is read as HTTP reads it: a head only, whatever its
  // Content-Length says, so that any body the server sent stays in the stream for the next read.
  HttpResponse head(const std::string& target,
                    const std::vector<std::pair<std::string, std::string>>& headers = {});
  HttpResponse read_response(bool head = false);
  // Reads raw bytes until `needle` has been seen (true) or the timeout / end of stream (false).
  bool read_until(std::string_view needle, std::string* seen = nullptr);
  // True when the server closes the connection (EOF or reset) within the timeout; the bytes
  // read meanwhile go to `seen`.
  bool wait_closed(std::string* seen = nullptr,
                   std::optional<std::chrono::milliseconds> timeout = std::nullopt);

 private:
  struct Connection;
  std::unique_ptr<Connection> c_;
};

// The data of each SSE event of a stream body, in order ("[DONE]" included).
inline std::vector<std::string> sse_events(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < body.size()) {
    const size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) {
      ADD_FAILURE() << "unterminated SSE event: " << body.substr(pos);
      break;
    }
    const std::string event = body.substr(pos, end - pos);
    EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
    out.push_back(event.size() >= 6 ? event.substr(6) : event);
    pos = end + 2;
  }
  return out;
}

// The JSON chunks of a stream (without [DONE]); `done` says whether [DONE] ended it.
inline std::vector<json> sse_chunks(const std::string& body, bool* done = nullptr) {
  std::vector<json> out;
  const auto events = sse_events(body);
  if (done) *done = !events.empty() && events.back() == "[DONE]";
  for (const auto& e : events) {
    if (e == "[DONE]") continue;
    json j = json::parse(e, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << e;
    out.push_back(std::move(j));
  }
  return out;
}

// Per choice index: the concatenated text (completions "text", chat "delta.content") and the
// finish reason of the stream's chunks.
struct StreamedChoice {
  std::string text;
  std::string finish_reason;
  int chunks = 0;
};
inline std::map<int, StreamedChoice> merge_stream(const std::vector<json>& chunks, bool chat) {
  std::map<int, StreamedChoice> out;
  for (const auto& c : chunks) {
    if (!c.contains("choices")) continue;
    for (const auto& ch : c["choices"]) {
      auto& s = out[ch["index"].get<int>()];
      ++s.chunks;
      if (chat) {
        if (ch["delta"].contains("content")) s.text += ch["delta"]["content"].get<std::string>();
      } else {
        s.text += ch["text"].get<std::string>();
      }
      if (!ch["finish_reason"].is_null()) {
        EXPECT_TRUE(s.finish_reason.empty()) << "two finish reasons for choice " << ch["index"];
        s.finish_reason = ch["finish_reason"].get<std::string>();
      }
    }
  }
  return out;
}

// The error object's fields, checked for OpenAI's shape.
inline json expect_error(const HttpResponse& r, int status, const std::string& type) {
  EXPECT_EQ(r.status, status) << r.body;
  json j = r.json_body();
  EXPECT_TRUE(j.is_object() && j.contains("error")) << r.body;
  if (!j.is_object() || !j.contains("error")) return json::object();
  const json& e = j["error"];
  EXPECT_TRUE(e.contains("message") && e["message"].is_string()) << r.body;
  EXPECT_TRUE(e.contains("param")) << r.body;
  EXPECT_TRUE(e.contains("code")) << r.body;
  EXPECT_EQ(e.value("type", ""), type) << r.body;
  return e;
}

}  // namespace cleave::router::testing_http
