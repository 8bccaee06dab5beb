// WorkerServer: start-up (model, engine loop, transfer engine, gRPC server), the decode
// worker's notice thread, and the graceful shutdown.
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <condition_variable>
#include <thread>

#include "cleave/common/log.h"
#include "cleave/common/thread_pool.h"
#include "cleave/common/version.h"
#include "cleave/kvcache/prefix_hash.h"
#include "cleave/model/default_model.h"
#include "cleave/model/model_file.h"
#include "cleave/worker/worker_service.h"
#include "fmt/format.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "metrics_http.h"
#include "token_stream.h"
#include "worker_core.h"

namespace cleave {

using worker_service::WorkerCore;
using worker_service::WorkerRpcs;

std::string_view worker_role_name(WorkerRole r) {
  switch (r) {
    case WorkerRole::kPrefill: return "prefill";
    case WorkerRole::kDecode: return "decode";
    case WorkerRole::kUnified: return "unified";
  }
  return "unknown";
}

Result<WorkerRole> parse_worker_role(std::string_view name) {
  if (name == "prefill") return WorkerRole::kPrefill;
  if (name == "decode") return WorkerRole::kDecode;
  if (name == "unified") return WorkerRole::kUnified;
  return InvalidArgument(
      fmt::format("worker role '{}' is not one of prefill, decode, unified", name));
}

namespace {

bool is_loopback(const std::string& host) {
  return host.rfind("127.", 0) == 0 || host == "localhost" || host == "[::1]";
}

}  // namespace

struct WorkerServer::Impl {
  WorkerCore core;
  std::unique_ptr<worker_service::TokenStreamPump> pump;  // stopped after the server: streams need it to end
  std::unique_ptr<WorkerRpcs> rpcs;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<worker_service::MetricsHttpServer> metrics_http;
  std::string host;
  int port = 0;

  std::atomic<bool> stop_notices{false};
  std::thread notice_thread;

  std::mutex state_mu;
  std::condition_variable state_cv;
  bool shutting_down = false;
  bool shut_down = false;

  Status load(const WorkerConfig& config);
  Status serve();
  void notice_loop();
  void set_health(bool serving);
  void begin_drain();
  int64_t in_flight() const;
  std::string in_flight_text() const;
  void shutdown();
};

Status WorkerServer::Impl::load(const WorkerConfig& config) {
  core.config = config;
  CLEAVE_ASSIGN_OR_RETURN(core.role, parse_worker_role(config.worker.role));
  CLEAVE_ASSIGN_OR_RETURN(ListenAddress listen, parse_listen_address(config.worker.listen));
  host = listen.host;
  core.id = config.worker.id.empty()
                ? fmt::format("{}-{}", worker_role_name(core.role), ::getpid())
                : config.worker.id;

  const auto t0 = std::chrono::steady_clock::now();
  std::string path = config.model.path;
  if (path.empty()) {
    CLEAVE_ASSIGN_OR_RETURN(path, ensure_default_model());
  }
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<ModelFile> loaded, load_model(path));
  std::shared_ptr<const ModelFile> file(std::move(loaded));
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, Tokenizer::create(file->tokenizer()));
  core.model_name = file->config().name;
  core.model_fingerprint = file->fingerprint();
  core.vocab_size = file->config().vocab_size;

  EngineOptions model_opts;
  model_opts.threads = static_cast<int>(config.engine.threads);
  model_opts.max_context = config.engine.max_context;
  model_opts.device = config.engine.device;
  CLEAVE_ASSIGN_OR_RETURN(std::unique_ptr<LlamaModel> model, LlamaModel::create(file, model_opts));
  core.max_context = model->max_context();

  EngineLoopOptions opts = engine_loop_options(config.engine);
  opts.scheduler.hash_seed = prefix_hash_seed_for_model(core.model_fingerprint);
  if (core.role != WorkerRole::kUnified) {
    // Before the engine: whether a GPU pool is reached directly or through a host mirror
    // depends on the provider.
    CLEAVE_ASSIGN_OR_RETURN(core.transfer,
                            transfer::TransferEngine::create(config.transfer, is_loopback(host)));
    opts.kv_staging = kv_mirror_needed(model->backend().device(), core.transfer->hmem());
  }
  CLEAVE_ASSIGN_OR_RETURN(core.engine, EngineLoop::create(std::move(model),
                                                          std::shared_ptr<const Tokenizer>(std::move(tok)),
                                                          opts));
  const KvLayout& layout = core.engine->kv_layout();
  log::info("worker {}: model '{}' ({}) loaded from {} in {:.2f} s; KV pool {} blocks of {} tokens "
            "({} MiB)",
            core.id, core.model_name, core.model_fingerprint, path,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
            layout.num_blocks, layout.block_size, core.engine->kv_bytes() >> 20);

  if (core.role != WorkerRole::kUnified) {
    if (core.engine->kv_staged()) {
      log::warn("worker {}: the KV pool is in cuda:{} memory and transfer provider {} cannot "
                "reach it (no FI_HMEM): KV goes through a pinned host mirror of {} MiB, a copy "
                "each way per transfer (GPUDirect needs a provider with FI_HMEM, e.g. efa with "
                "transfer.hmem)",
                core.id, core.engine->kv_device(), core.transfer->provider(),
                core.engine->kv_bytes() >> 20);
    } else if (core.engine->kv_device() >= 0) {
      log::info("worker {}: KV transfers read and write cuda:{} memory directly (FI_HMEM)",
                core.id, core.engine->kv_device());
    }
    CLEAVE_ASSIGN_OR_RETURN(core.kv_region,
                            core.transfer->register_memory(core.engine->kv_transfer_data(),
                                                           core.engine->kv_bytes(),
                                                           core.kv_transfer_kind()));
    const std::string& fence = config.worker.kv_fence;
    if (fence == "hold" || (fence == "auto" && !core.transfer->revokes_keys())) {
      // A write posted before the writer's lease ended completes, or fails within the
      // completion timeout and its endpoint is rebuilt; the second is slack for the clocks of
      // the two hosts' lease bounds (the writer's starts when its Prefill arrives).
      core.kv_fence_hold = std::chrono::milliseconds(config.transfer.completion_timeout_ms + 1000);
    }
    log::info("worker {}: KV pool registered with the transfer engine ({}, {} rail(s)); late "
              "writes fenced by {}",
              core.id, core.transfer->provider(), core.transfer->rails(),
              core.kv_fence_hold.count() > 0
                  ? fmt::format("holding ended reservations' blocks {} ms past their lease",
                                core.kv_fence_hold.count())
                  : std::string("a key per reservation, revoked at its end"));
  }
  CLEAVE_RETURN_IF_ERROR(core.metrics.init());
  core.metrics.kv_transfer_staged->set(core.engine->kv_staged() ? 1 : 0);
  if (const int dev = core.engine->kv_device(); dev >= 0) {
    if (auto gpu = GpuMonitor::open(dev); gpu.ok()) {
      log::info("worker {}: GPU metrics from NVML for device {} (PCI {})", core.id, dev,
                (*gpu)->pci_bus_id());
      CLEAVE_RETURN_IF_ERROR(core.metrics.watch_gpu(std::move(*gpu)));
    } else {
      log::warn("worker {}: no GPU metrics: {}", core.id, gpu.status().message());
    }
  }
  return core.metrics.set_info(core.id, worker_role_name(core.role), config.worker.instance_type,
                               config.worker.profile, kVersion);
}

Status WorkerServer::Impl::serve() {
  grpc::EnableDefaultHealthCheckService(true);
  pump = std::make_unique<worker_service::TokenStreamPump>(core);
  rpcs = std::make_unique<WorkerRpcs>(core, *pump);
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort(core.config.worker.listen, grpc::InsecureServerCredentials(), &bound);
  builder.RegisterService(rpcs.get());
  builder.SetMaxReceiveMessageSize(64 << 20);
  // A second worker on a port in use must fail, not share the port (gRPC's default).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  server = builder.BuildAndStart();
  if (!server || bound == 0) {
    if (server) server->Shutdown();
    server.reset();
    return Unavailable(fmt::format("worker {}: cannot listen on '{}' (address in use or not "
                                   "local?)",
                                   core.id, core.config.worker.listen));
  }
  port = bound;
  if (core.role == WorkerRole::kDecode) {
    notice_thread = std::thread([this] { notice_loop(); });
  }
  set_health(true);
  if (core.config.worker.metrics_port >= 0) {
    auto http = worker_service::MetricsHttpServer::start(
        host, static_cast<int>(core.config.worker.metrics_port),
        [this] { return core.metrics.render(core.engine->stats(), core.reservations.size()); },
        [this] { return !core.draining.load() && !core.stopping.load(); });
    if (!http.ok()) return http.status();
    metrics_http = std::move(http).value();
    log::info("worker {}: metrics on http://{}:{}/metrics", core.id, host, metrics_http->port());
  }
  log::info("worker {}: {} worker serving on {}:{}", core.id, worker_role_name(core.role), host,
            port);
  return Status::Ok();
}

void WorkerServer::Impl::set_health(bool serving) {
  if (!server) return;
  if (auto* health = server->GetHealthCheckService()) {
    health->SetServingStatus(serving);
    health->SetServingStatus(v1::Worker::service_full_name(), serving);
  }
}

void WorkerServer::Impl::begin_drain() {
  if (core.draining.exchange(true)) return;
  set_health(false);
  core.metrics.draining->set(1);
}

int64_t WorkerServer::Impl::in_flight() const {
  const EngineStats s = core.engine ? core.engine->stats() : EngineStats{};
  return core.calls_in_flight.load() + static_cast<int64_t>(core.reservations.size()) + s.running +
         s.waiting;
}

std::string WorkerServer::Impl::in_flight_text() const {
  const EngineStats s = core.engine ? core.engine->stats() : EngineStats{};
  return fmt::format(
      "{} call(s), {} reservation(s) waiting for their Decode, {} request(s) in "
      "the engine",
      core.calls_in_flight.load(), core.reservations.size(), s.running + s.waiting);
}

void WorkerServer::Impl::notice_loop() {
  set_thread_name("notices");
  constexpr auto kWait = std::chrono::milliseconds(50);
  // Matching only: a reservation's lease ends in the engine's ledger, which tells the table.
  while (!stop_notices.load(std::memory_order_acquire)) {
    Result<transfer::Notice> n = core.transfer->wait_notice(kWait);
    if (n.ok()) {
      using worker_service::ReservationTable;
      const ReservationTable::NoticeMatch m = core.reservations.mark_filled(n->tag, n->from_engine, n->value);
      if (m.outcome == ReservationTable::Notice::kWrongWriter) {
        core.metrics.notices_unmatched->inc();
        log::warn("worker {}: the notice of request {} came from engine {:016x}, not from the "
                  "prefill worker's engine {:016x} it was reserved for: refused",
                  core.id, m.id, n->from_engine, m.expected);
      } else if (m.outcome != ReservationTable::Notice::kFilled) {
        core.metrics.notices_unmatched->inc();
        log::debug("worker {}: notice {:016x} from engine {:016x} matches no reservation "
                   "(expired, released or aborted)",
                   core.id, n->tag, n->from_engine);
      }
    } else if (n.status().code() != StatusCode::kDeadlineExceeded) {
      log::warn("worker {}: waiting for notices: {}", core.id, n.status().to_string());
      std::this_thread::sleep_for(kWait);
    }
  }
}

void WorkerServer::Impl::shutdown() {
  {
    std::unique_lock<std::mutex> lock(state_mu);
    if (shutting_down) {
      state_cv.wait(lock, [&] { return shut_down; });
      return;
    }
    shutting_down = true;
  }
  if (server) log::info("worker {}: shutting down", core.id);
  core.stopping.store(true);
  set_health(false);
  if (metrics_http) metrics_http->stop();
  core.reservations.shutdown();
  if (core.engine) core.engine->shutdown();
  if (server) server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (pump) pump->stop();
  stop_notices.store(true, std::memory_order_release);
  if (notice_thread.joinable()) notice_thread.join();
  if (core.transfer && core.kv_region.id != 0) {
    if (Status s = core.transfer->deregister(core.kv_region.id); !s.ok()) {
      log::warn("worker {}: deregistering the KV pool: {}", core.id, s.to_string());
    }
    core.kv_region = {};
  }
  {
    std::lock_guard<std::mutex> lock(state_mu);
    shut_down = true;
  }
  state_cv.notify_all();
  if (server) log::info("worker {}: stopped", core.id);
}

Result<std::unique_ptr<WorkerServer>> WorkerServer::start(const WorkerConfig& config) {
  auto impl = std::make_unique<Impl>();
  Status s = impl->load(config);
  if (s.ok()) s = impl->serve();
  if (!s.ok()) {
    impl->shutdown();
    return s;
  }
  return std::unique_ptr<WorkerServer>(new WorkerServer(std::move(impl)));
}

WorkerServer::WorkerServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

WorkerServer::~WorkerServer() { shutdown(); }

WorkerRole WorkerServer::role() const { return impl_->core.role; }
const std::string& WorkerServer::id() const { return impl_->core.id; }
const std::string& WorkerServer::host() const { return impl_->host; }
int WorkerServer::port() const { return impl_->port; }
std::string WorkerServer::address() const { return fmt::format("{}:{}", impl_->host, impl_->port); }

void WorkerServer::shutdown() { impl_->shutdown(); }

int WorkerServer::metrics_port() const {
  return impl_->metrics_http ? impl_->metrics_http->port() : -1;
}

int64_t WorkerServer::in_flight() const {
  return impl_->in_flight();
}

bool WorkerServer::drain(std::chrono::milliseconds limit,
                         const std::function<bool()>& interrupted) {
  Impl& m = *impl_;
  const auto t0 = std::chrono::steady_clock::now();
  m.begin_drain();
  int64_t left = m.in_flight();
  log::info(
      "worker {}: draining: health NOT_SERVING, new requests refused; in flight: {}; "
      "waiting up to {} s",
      m.core.id, m.in_flight_text(), limit.count() / 1000.0);
  bool drained = left == 0;
  while (!drained) {
    if (std::chrono::steady_clock::now() - t0 >= limit) break;
    if (interrupted && interrupted()) {
      log::info("worker {}: drain interrupted", m.core.id);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    left = m.in_flight();
    drained = left == 0;
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (drained) {
    log::info("worker {}: drained in {:.2f} s", m.core.id, took);
  } else {
    log::warn("worker {}: still in flight after {:.2f} s of draining: {}; stopping", m.core.id,
              took, m.in_flight_text());
  }
  shutdown();
  return drained;
}

void WorkerServer::wait() {
  std::unique_lock<std::mutex> lock(impl_->state_mu);
  impl_->state_cv.wait(lock, [&] { return impl_->shut_down; });
}

EngineStats WorkerServer::engine_stats() const { return impl_->core.engine->stats(); }

}  // namespace cleave
