// WorkerClient: one gRPC channel to one worker; every call with a deadline, every error a Status.
#include "cleave/control/worker_client.h"

#include <grpcpp/grpcpp.h>

#include <utility>

#include "cleave/control/channel.h"
#include "cleave/control/proto_convert.h"
#include "cleave/v1/worker.grpc.pb.h"
#include "fmt/format.h"

namespace cleave {

struct WorkerClient::Impl {
  std::string target;
  WorkerClientOptions opts;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Worker::Stub> stub;

  Status error(const char* rpc, const grpc::Status& s) const {
    return from_grpc(s).with_context(fmt::format("worker {}: {}", target, rpc));
  }

  template <typename Response, typename Call>
  Result<Response> unary(const char* rpc, std::chrono::milliseconds timeout, Call call) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    Response resp;
    const grpc::Status s = call(&ctx, &resp);
    if (!s.ok()) return error(rpc, s);
    return resp;
  }

  // Reads a token stream to its end, handing each event to `on_event`.
  template <typename Start>
  Result<StreamResult> stream(const char* rpc, Start start, const TokenEventCallback& on_event) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + opts.stream_timeout);
    auto reader = start(&ctx);
    StreamResult r;
    v1::TokenEvent ev;
    bool finished = false;
    bool extra_event = false;
    while (reader->Read(&ev)) {
      if (finished) {
        extra_event = true;  // a protocol error; keep draining so that Finish() returns
        continue;
      }
      ++r.events;
      finished = ev.finished();
      // false on the finished event cancels nothing: the request has ended.
      if (!on_event(ev) && !finished) {
        r.cancelled = true;
        ctx.TryCancel();
        break;
      }
      if (finished) r.last.Swap(&ev);
    }
    const grpc::Status s = reader->Finish();
    if (r.cancelled) return r;
    if (!s.ok()) return error(rpc, s);
    if (extra_event) {
      return Internal(fmt::format("worker {}: {}: an event came after the finished event",
                                  target, rpc));
    }
    if (!finished) {
      return Internal(fmt::format("worker {}: {}: the stream ended without a finished event",
                                  target, rpc));
    }
    return r;
  }
};

WorkerClient::WorkerClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
WorkerClient::~WorkerClient() = default;

Result<std::unique_ptr<WorkerClient>> WorkerClient::connect(const std::string& target,
                                                            const WorkerClientOptions& opts) {
  if (target.empty()) return InvalidArgument("the worker address is empty (want HOST:PORT)");
  auto impl = std::make_unique<Impl>();
  impl->target = target;
  impl->opts = opts;
  impl->channel = make_worker_channel(target);
  if (!impl->channel) return InvalidArgument(fmt::format("cannot make a channel to '{}'", target));
  if (!impl->channel->WaitForConnected(std::chrono::system_clock::now() + opts.connect_timeout)) {
    return Unavailable(fmt::format("cannot connect to the worker at {} within {} ms", target,
                                   opts.connect_timeout.count()));
  }
  impl->stub = v1::Worker::NewStub(impl->channel);
  return std::unique_ptr<WorkerClient>(new WorkerClient(std::move(impl)));
}

const std::string& WorkerClient::target() const { return impl_->target; }
const WorkerClientOptions& WorkerClient::options() const { return impl_->opts; }

Result<v1::WorkerInfo> WorkerClient::info() {
  return impl_->unary<v1::WorkerInfo>(
      "GetInfo", impl_->opts.unary_timeout, [&](grpc::ClientContext* c, v1::WorkerInfo* r) {
        return impl_->stub->GetInfo(c, v1::GetInfoRequest{}, r);
      });
}

Result<v1::LoadReport> WorkerClient::load() {
  return impl_->unary<v1::LoadReport>(
      "GetLoad", impl_->opts.unary_timeout, [&](grpc::ClientContext* c, v1::LoadReport* r) {
        return impl_->stub->GetLoad(c, v1::GetLoadRequest{}, r);
      });
}

Result<std::string> WorkerClient::metrics() {
  CLEAVE_ASSIGN_OR_RETURN(
      v1::MetricsText text,
      impl_->unary<v1::MetricsText>(
          "GetMetrics", impl_->opts.unary_timeout, [&](grpc::ClientContext* c, v1::MetricsText* r) {
            return impl_->stub->GetMetrics(c, v1::GetMetricsRequest{}, r);
          }));
  return std::move(*text.mutable_text());
}

Result<v1::KvDestination> WorkerClient::reserve(RequestId id, int64_t num_prompt_tokens,
                                                std::chrono::milliseconds lease) {
  v1::ReserveRequest req;
  req.set_request_id(id);
  req.set_num_prompt_tokens(num_prompt_tokens);
  req.set_lease_ms(lease.count());
  return impl_->unary<v1::KvDestination>(
      "Reserve", impl_->opts.unary_timeout, [&](grpc::ClientContext* c, v1::KvDestination* r) {
        return impl_->stub->Reserve(c, req, r);
      });
}

Result<bool> WorkerClient::release(RequestId id) {
  v1::ReleaseRequest req;
  req.set_request_id(id);
  CLEAVE_ASSIGN_OR_RETURN(
      v1::ReleaseResponse resp,
      impl_->unary<v1::ReleaseResponse>(
          "Release", impl_->opts.unary_timeout, [&](grpc::ClientContext* c, v1::ReleaseResponse* r) {
            return impl_->stub->Release(c, req, r);
          }));
  return resp.released();
}

Result<bool> WorkerClient::renew_lease(RequestId id, std::chrono::milliseconds lease) {
  v1::RenewLeaseRequest req;
  req.set_request_id(id);
  req.set_lease_ms(lease.count());
  CLEAVE_ASSIGN_OR_RETURN(
      v1::RenewLeaseResponse resp,
      impl_->unary<v1::RenewLeaseResponse>(
          "RenewLease", impl_->opts.unary_timeout,
          [&](grpc::ClientContext* c, v1::RenewLeaseResponse* r) {
            return impl_->stub->RenewLease(c, req, r);
          }));
  return resp.renewed();
}

Result<v1::PrefillResponse> WorkerClient::prefill(const v1::PrefillRequest& req) {
  return impl_->unary<v1::PrefillResponse>(
      "Prefill", impl_->opts.prefill_timeout, [&](grpc::ClientContext* c, v1::PrefillResponse* r) {
        return impl_->stub->Prefill(c, req, r);
      });
}

Result<StreamResult> WorkerClient::decode(const v1::DecodeRequest& req,
                                          const TokenEventCallback& on_event) {
  return impl_->stream(
      "Decode", [&](grpc::ClientContext* c) { return impl_->stub->Decode(c, req); }, on_event);
}

Result<StreamResult> WorkerClient::generate(const v1::GenerateRequest& req,
                                            const TokenEventCallback& on_event) {
  return impl_->stream(
      "Generate", [&](grpc::ClientContext* c) { return impl_->stub->Generate(c, req); }, on_event);
}

Result<bool> WorkerClient::abort(RequestId id) {
  v1::AbortRequest req;
  req.set_request_id(id);
  CLEAVE_ASSIGN_OR_RETURN(
      v1::AbortResponse resp,
      impl_->unary<v1::AbortResponse>(
          "Abort", impl_->opts.unary_timeout, [&](grpc::ClientContext* c, v1::AbortResponse* r) {
            return impl_->stub->Abort(c, req, r);
          }));
  return resp.aborted();
}

}  // namespace cleave
