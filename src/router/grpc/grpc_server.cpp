// The router's gRPC API: the Inference service, its Generate reactor, the health service.
#include "cleave/router/grpc_server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "cleave/common/log.h"
#include "cleave/common/thread_pool.h"
#include "cleave/control/proto_convert.h"
#include "cleave/v1/inference.grpc.pb.h"
#include "frontend/api_key.h"
#include "frontend/exchange.h"
#include "frontend/router_metrics.h"
#include "grpc/grpc_request.h"

namespace cleave::router {
namespace {

namespace net = boost::asio;
using Clock = std::chrono::steady_clock;

std::string_view authorization_of(const grpc::CallbackServerContext* ctx) {
  const auto& md = ctx->client_metadata();
  const auto it = md.find("authorization");
  if (it == md.end()) return {};
  return std::string_view(it->second.data(), it->second.size());
}

std::string listen_address(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  return v6 ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
}

}  // namespace

class InferenceService;

struct GrpcServer::Impl {
  Impl(const GrpcServerOptions& o, RouterFrontend& f) : options(o), frontend(f) {}

  void health_loop();

  const GrpcServerOptions options;
  RouterFrontend& frontend;
  net::io_context io;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;
  std::thread out_thread;
  std::unique_ptr<InferenceService> service;
  std::unique_ptr<grpc::Server> server;
  std::thread health_thread;
  std::mutex health_mu;
  std::condition_variable health_cv;
  bool health_stop = false;
  std::atomic<int64_t> active{0};
  int port = 0;
  bool stopped = false;
};

namespace {

// One Generate call: an Exchange on the gRPC wire, written one message at a time.
class GenerateCall final : public grpc::ServerWriteReactor<v1::GenerateTextResponse> {
 public:
  // Creates the call, owned by itself until OnDone.
  static void begin(GrpcServer::Impl& server, grpc::CallbackServerContext* ctx,
                    const v1::GenerateTextRequest* request,
                    grpc::ServerWriteReactor<v1::GenerateTextResponse>** out) {
    auto call = std::shared_ptr<GenerateCall>(new GenerateCall(server, ctx));
    call->self_ = call;
    *out = call.get();
    call->start(*request);
  }

  void OnWriteDone(bool ok) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      writing_ = false;
      if (!ok) client_gone_ = true;
    }
    if (!ok && exchange_) exchange_->cancel();  // the client is gone
    pump();
  }

  void OnCancel() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      client_gone_ = true;
    }
    if (exchange_) exchange_->cancel();
    pump();
  }

  void OnDone() override {
    std::shared_ptr<GenerateCall> keep;
    {
      std::lock_guard<std::mutex> lk(mu_);
      done_ = true;
      keep = std::move(self_);
    }
    if (exchange_) {
      exchange_->cancel();
      exchange_->detach();
    }
    server_.frontend.metrics().count_grpc("Generate", grpc_code_name(final_code_));
    server_.active.fetch_sub(1, std::memory_order_relaxed);
    // `keep` goes last: a wake-up still queued on the output thread may hold the call too.
  }

 private:
  GenerateCall(GrpcServer::Impl& server, grpc::CallbackServerContext* ctx)
      : server_(server), ctx_(ctx), arrival_(Clock::now()) {
    server_.active.fetch_add(1, std::memory_order_relaxed);
  }

  void start(const v1::GenerateTextRequest& request) {
    if (auto err = check_api_key(server_.options.api_keys, authorization_of(ctx_))) {
      finish_now(*err);
      return;
    }
    auto prepared = prepare_generate(server_.frontend, request);
    if (!prepared.ok()) {
      finish_now(prepared.error());
      return;
    }
    exchange_ = std::make_shared<Exchange>(std::move(*prepared), server_.frontend.tokenizer(),
                                           server_.frontend.metrics(), arrival_,
                                           ExchangeWire::kGrpc);
    // Runs under the exchange's lock: only post. Detached in OnDone (the cycle ends there).
    exchange_->set_notify([self = self_, &io = server_.io] {
      net::post(io, [self] { self->pump(); });
    });
    if (auto err = exchange_->start(server_.frontend.dispatcher())) {
      exchange_->detach();
      finish_now(*err);  // unless a wake-up already answered it with the same failure
    }
  }

  // Answers the call with `error` (nothing was written), unless it is already finishing.
  void finish_now(const openai::ApiError& error) {
    grpc::Status status;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (finishing_) return;
      finishing_ = true;
      status = grpc_status_of(error, ctx_);
      final_code_ = status.error_code();
    }
    Finish(status);
  }

  // Writes what the exchange has, when no write is in flight; finishes the call at its end.
  void pump() {
    enum class Action : uint8_t { kNone, kWrite, kWriteAndFinish, kFinish } action = Action::kNone;
    grpc::Status status;
    bool cancel = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (done_ || writing_ || finishing_ || !exchange_) return;
      exchange_->take(out_);
      cancel = out_.cancel_dispatches;
      switch (out_.state) {
        case ExchangeState::kActive:
          if (out_.has_message) {
            writing_ = true;
            action = Action::kWrite;
          }
          break;
        case ExchangeState::kComplete:
          finishing_ = true;
          action = out_.has_message ? Action::kWriteAndFinish : Action::kFinish;
          break;
        case ExchangeState::kFailed:
        case ExchangeState::kFailedAfterOpen:
          finishing_ = true;
          status = grpc_status_of(out_.error ? *out_.error
                                             : openai::internal_error("the request failed"),
                                  ctx_);
          action = out_.has_message ? Action::kWriteAndFinish : Action::kFinish;
          break;
        case ExchangeState::kCancelled:
          finishing_ = true;
          // A failed write means the client went away too, even where IsCancelled() does not
          // say so yet: counted CANCELLED, not as a router shutting down.
          status = client_gone_ || ctx_->IsCancelled()
                       ? grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled")
                       : grpc::Status(grpc::StatusCode::UNAVAILABLE, "the router is shutting down");
          action = Action::kFinish;
          break;
      }
      if (action == Action::kWriteAndFinish || action == Action::kFinish) {
        final_code_ = status.error_code();
      }
    }
    if (cancel) exchange_->cancel();
    switch (action) {
      case Action::kNone: break;
      case Action::kWrite: StartWrite(&out_.message); break;
      case Action::kWriteAndFinish: StartWriteAndFinish(&out_.message, grpc::WriteOptions(), status); break;
      case Action::kFinish: Finish(status); break;
    }
  }

  GrpcServer::Impl& server_;
  grpc::CallbackServerContext* const ctx_;
  const Clock::time_point arrival_;
  std::shared_ptr<Exchange> exchange_;  // set once in start(), before any wake-up

  std::mutex mu_;
  std::shared_ptr<GenerateCall> self_;  // until OnDone
  ExchangeOutput out_;                  // the message being written (only when !writing_)
  bool writing_ = false;
  bool finishing_ = false;
  bool client_gone_ = false;  // a write failed or OnCancel came
  bool done_ = false;
  grpc::StatusCode final_code_ = grpc::StatusCode::OK;
};

}  // namespace

class InferenceService final : public v1::Inference::CallbackService {
 public:
  explicit InferenceService(GrpcServer::Impl& server) : server_(server) {}

  grpc::ServerWriteReactor<v1::GenerateTextResponse>* Generate(
      grpc::CallbackServerContext* ctx, const v1::GenerateTextRequest* request) override {
    grpc::ServerWriteReactor<v1::GenerateTextResponse>* reactor = nullptr;
    GenerateCall::begin(server_, ctx, request, &reactor);
    return reactor;
  }

  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* ctx,
                                       const v1::ListModelsRequest* /*request*/,
                                       v1::ListModelsResponse* response) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    grpc::Status status;
    if (auto err = check_api_key(server_.options.api_keys, authorization_of(ctx))) {
      status = grpc_status_of(*err, ctx);
    } else {
      const RouterFrontend& f = server_.frontend;
      const int64_t len = f.max_model_len();
      for (const auto& name : f.served_model_names()) {
        v1::ModelCard* card = response->add_models();
        card->set_id(name);
        card->set_created(f.created());
        card->set_owned_by("cleave");
        card->set_max_model_len(len);
      }
    }
    server_.frontend.metrics().count_grpc("ListModels", grpc_code_name(status.error_code()));
    reactor->Finish(status);
    return reactor;
  }

 private:
  GrpcServer::Impl& server_;
};

void GrpcServer::Impl::health_loop() {
  set_thread_name("grpc-health");
  std::optional<bool> reported;
  std::unique_lock<std::mutex> lk(health_mu);
  while (!health_stop) {
    const bool ready = frontend.dispatcher().ready();
    if (reported != ready) {
      // The service first, then the server as a whole: a client that sees the overall status
      // change finds the service's already changed.
      if (auto* health = server->GetHealthCheckService()) {
        health->SetServingStatus(v1::Inference::service_full_name(), ready);
        health->SetServingStatus(ready);
      }
      reported = ready;
    }
    health_cv.wait_for(lk, std::chrono::milliseconds(100), [this] { return health_stop; });
  }
}

GrpcServer::GrpcServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

GrpcServer::~GrpcServer() { stop(); }

Result<std::unique_ptr<GrpcServer>> GrpcServer::start(const GrpcServerOptions& options,
                                                      RouterFrontend& frontend) {
  if (options.port < 0 || options.port > 65535) {
    return InvalidArgument(fmt::format("router.grpc_port {} is not a port", options.port));
  }
  if (options.host.empty()) return InvalidArgument("the gRPC API needs a host to listen on");
  auto impl = std::make_unique<Impl>(options, frontend);
  grpc::EnableDefaultHealthCheckService(true);
  impl->service = std::make_unique<InferenceService>(*impl);
  grpc::ServerBuilder builder;
  const std::string address = listen_address(options.host, options.port);
  int bound = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &bound);
  builder.RegisterService(impl->service.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(
      std::min<uint64_t>(options.max_message_bytes, static_cast<uint64_t>(INT32_MAX))));
  // A second router on a port in use must fail, not share the port (gRPC's default).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  impl->server = builder.BuildAndStart();
  if (!impl->server || bound == 0) {
    if (impl->server) impl->server->Shutdown();
    return Unavailable(fmt::format(
        "the gRPC API cannot listen on {} (port in use? router.grpc_port -1 turns it off)",
        address));
  }
  impl->port = bound;
  // Known from the start (NOT_SERVING), so that a check never finds the service unknown.
  if (auto* health = impl->server->GetHealthCheckService()) {
    health->SetServingStatus(v1::Inference::service_full_name(), false);
    health->SetServingStatus(false);
  }
  impl->work.emplace(impl->io.get_executor());
  impl->out_thread = std::thread([raw = impl.get()] {
    set_thread_name("grpc-out");
    raw->io.run();
  });
  impl->health_thread = std::thread([raw = impl.get()] { raw->health_loop(); });
  return std::unique_ptr<GrpcServer>(new GrpcServer(std::move(impl)));
}

int GrpcServer::port() const { return impl_->port; }

int64_t GrpcServer::active_calls() const { return impl_->active.load(std::memory_order_relaxed); }

void GrpcServer::stop() {
  if (!impl_ || impl_->stopped) return;
  impl_->stopped = true;
  {
    std::lock_guard<std::mutex> lk(impl_->health_mu);
    impl_->health_stop = true;
  }
  impl_->health_cv.notify_all();
  if (impl_->health_thread.joinable()) impl_->health_thread.join();
  // Calls in flight are cancelled at once (their dispatches end on the workers); Shutdown
  // returns once every call is done.
  impl_->server->Shutdown(std::chrono::system_clock::now());
  impl_->server->Wait();
  impl_->work.reset();
  if (impl_->out_thread.joinable()) impl_->out_thread.join();
}

}  // namespace cleave::router
