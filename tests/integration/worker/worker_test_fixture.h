// The fixture of the multi-process worker tests: real `cleave worker` processes (this test's
// transfer provider on 127.0.0.1), clients to them, the router's dispatcher over a fixed pair
// (or one unified worker) to run requests through, and the checks every test ends with (the
// pools drain). Every wait is bounded.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <future>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cleave/router/dispatch_options.h"
#include <cstdlib>

#include "cleave/router/run_request.h"
#include "cleave/worker/worker_client.h"
#include "fmt/format.h"
#include "worker_process.h"

namespace cleave::worker_testing {

using namespace std::chrono_literals;

// CLEAVE_TEST_MODELS and CLEAVE_TEST_CLEAVE_BINARY override the build's paths (bench/gpu-check.sh
// runs these tests from a packed folder on a GPU machine); CLEAVE_ENGINE_DEVICE=cuda puts every
// started worker, and the in-process reference engine, on the GPU.
inline std::string models_dir() {
  if (const char* d = std::getenv("CLEAVE_TEST_MODELS")) return d;
  return std::string(CLEAVE_SOURCE_DIR) + "/../shared/models";
}
inline std::string cleave_binary() {
  if (const char* b = std::getenv("CLEAVE_TEST_CLEAVE_BINARY")) return b;
  return CLEAVE_BINARY;
}
inline std::string engine_device() {
  const char* d = std::getenv("CLEAVE_ENGINE_DEVICE");
  return d && *d ? d : "cpu";
}
inline std::string stories_path() { return models_dir() + "/stories260K.gguf"; }

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Everything one request streamed.
struct Collected {
  std::vector<int32_t> tokens;
  std::string text;
  std::string finish_reason;
  v1::Usage usage;
  int finished_events = 0;
  Status status;
  router::RequestOutcome outcome;
};

inline TokenEventCallback collect_into(Collected& c) {
  return [&c](const v1::TokenEvent& ev) {
    if (ev.has_token()) c.tokens.push_back(ev.token());
    c.text += ev.text();
    if (ev.finished()) {
      ++c.finished_events;
      c.finish_reason = ev.finish_reason();
      c.usage = ev.usage();
    }
    return true;
  };
}

// Dispatcher settings for one fixed set of workers: probes every 200 ms, one attempt per
// request (a worker's error is the test's to see), the stage deadlines of the tests' clients.
inline router::DispatcherOptions dispatcher_options() {
  router::DispatcherOptions o;
  o.health_interval = 200ms;
  o.max_attempts = 1;
  o.timeouts.reserve = 10s;
  o.timeouts.prefill = 60s;
  o.timeouts.first_token = 60s;
  o.timeouts.stream_idle = 60s;
  return o;
}
// Disaggregated over one prefill and one decode worker; `lease` of the reservations (0: the
// decode worker's default).
inline router::DispatcherOptions pair_options(const WorkerProcess& prefill,
                                              const WorkerProcess& decode,
                                              std::chrono::milliseconds lease = 0ms) {
  router::DispatcherOptions o = dispatcher_options();
  o.mode = router::DispatchMode::kDisaggregated;
  o.prefill.workers = {prefill.address()};
  o.decode.workers = {decode.address()};
  o.lease = lease;
  return o;
}
inline router::DispatcherOptions unified_options(const WorkerProcess& unified) {
  router::DispatcherOptions o = dispatcher_options();
  o.mode = router::DispatchMode::kUnified;
  o.unified.workers = {unified.address()};
  return o;
}
// The dispatcher, once ready (its workers probed and, disaggregated, the pair accepted);
// nullptr with a test failure otherwise.
inline std::unique_ptr<router::Dispatcher> ready_dispatcher(const router::DispatcherOptions& o) {
  auto d = router::make_dispatcher(o);
  if (!d.ok()) {
    ADD_FAILURE() << d.status().to_string();
    return nullptr;
  }
  const Status ready = router::wait_until_ready(**d, 10s);
  if (!ready.ok()) {
    ADD_FAILURE() << ready.to_string();
    return nullptr;
  }
  return std::move(*d);
}

// Waits until the worker holds no block: nothing running, waiting, reserved, pinned or held, and
// every block free or cached.
inline ::testing::AssertionResult drains(WorkerClient& w, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::string last = "no answer";
  for (;;) {
    auto l = w.load();
    if (l.ok()) {
      if (l->blocks_used() == 0 && l->reservations() == 0 && l->blocks_pinned() == 0 &&
          l->blocks_held() == 0 &&
          l->running() == 0 && l->waiting() == 0 &&
          l->blocks_free() + l->blocks_cached() == l->blocks_total()) {
        return ::testing::AssertionSuccess();
      }
      last = l->ShortDebugString();
    } else {
      last = l.status().to_string();
    }
    if (Clock::now() >= deadline) {
      return ::testing::AssertionFailure()
             << "worker " << w.target() << " still holds blocks after " << timeout.count()
             << " ms: " << last;
    }
    std::this_thread::sleep_for(20ms);
  }
}

// Sum over every label set of a counter or gauge in Prometheus text.
inline double metric_sum(const std::string& text, const std::string& name) {
  double sum = 0;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name, 0) != 0 || line.size() <= name.size()) continue;
    if (line[name.size()] != ' ' && line[name.size()] != '{') continue;
    sum += std::strtod(line.c_str() + line.rfind(' ') + 1, nullptr);
  }
  return sum;
}

inline SamplingParams greedy(int32_t max_tokens, uint64_t seed = 0, bool ignore_eos = false) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = max_tokens;
  p.seed = seed;
  p.ignore_eos = ignore_eos;
  return p;
}

inline std::chrono::milliseconds until(Clock::time_point t) {
  return std::max(0ms, std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()));
}

inline std::vector<int32_t> random_tokens(std::mt19937& rng, int32_t vocab, int32_t avoid_a,
                                   int32_t avoid_b, size_t n) {
  std::vector<int32_t> v;
  while (v.size() < n) {
    const auto id = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
    if (id != avoid_a && id != avoid_b) v.push_back(id);
  }
  return v;
}

// Starts real worker processes for a test parameterized by the transfer provider.
class WorkerProcessTest : public ::testing::TestWithParam<std::string> {
 protected:
  struct WorkerSpec {
    std::string role;
    std::string model;
    std::vector<std::string> extra = {};  // settings after the common ones
  };

  // Starts the workers at once (each loads its model and commits its KV pool) and waits until
  // every one listens. Every worker: this test's provider on loopback, one compute thread,
  // steps of 64 tokens, a 48 MiB KV pool.
  std::vector<std::unique_ptr<WorkerProcess>> start_workers(const std::vector<WorkerSpec>& specs) {
    std::vector<std::future<std::unique_ptr<WorkerProcess>>> starting;
    for (const WorkerSpec& w : specs) {
      WorkerProcess::Spec spec;
      spec.binary = cleave_binary();
      spec.role = w.role;
      spec.id = fmt::format("{}-{}", w.role, ++workers_started_);
      spec.model = w.model;
      spec.settings = {"transfer.provider=" + GetParam(), "transfer.node=127.0.0.1",
                       "engine.threads=1", "engine.max_tokens_per_step=64",
                       "engine.kv_cache_bytes=50331648", "log.level=warn"};
      spec.settings.insert(spec.settings.end(), w.extra.begin(), w.extra.end());
      starting.push_back(std::async(std::launch::async, [spec] {
        std::string error;
        auto p = WorkerProcess::start(spec, 60s, &error);
        EXPECT_NE(p, nullptr) << error;
        return p;
      }));
    }
    std::vector<std::unique_ptr<WorkerProcess>> out;
    for (auto& f : starting) out.push_back(f.get());
    return out;
  }
  std::unique_ptr<WorkerProcess> start_worker(const std::string& role, const std::string& model,
                                              std::vector<std::string> extra = {}) {
    return std::move(start_workers({{role, model, std::move(extra)}})[0]);
  }

  static std::unique_ptr<WorkerClient> connect(const WorkerProcess& w) {
    WorkerClientOptions o;
    o.connect_timeout = 10s;
    o.unary_timeout = 10s;
    o.prefill_timeout = 60s;
    o.stream_timeout = 60s;
    auto c = WorkerClient::connect(w.address(), o);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    return c.ok() ? std::move(*c) : nullptr;
  }

  int workers_started_ = 0;
};

inline std::string provider_name(const ::testing::TestParamInfo<std::string>& info) {
  return info.param == "shm" ? "shm" : "tcp";
}

}  // namespace cleave::worker_testing
