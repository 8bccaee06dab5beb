// The client side of the worker control plane (proto/cleave/v1/worker.proto): WorkerClient, one
// gRPC channel to one worker with a deadline on every call, and the pairing check of a
// (prefill, decode) pair. The orchestration of a request over workers is the router's
// Dispatcher (router/dispatcher.h; router/run_request.h to run one and wait for it).
//
// Errors: every RPC failure comes back as a cleave::Status (from_grpc, control/proto_convert.h)
// whose message names the worker and the RPC, e.g. "worker 127.0.0.1:7001: Prefill: ...".
// The codes are the control plane's (worker.proto): RESOURCE_EXHAUSTED (no KV blocks: try
// another worker or later), FAILED_PRECONDITION (refused pairing, expired reservation),
// UNAVAILABLE (worker unreachable or shutting down, transfer failed), DEADLINE_EXCEEDED (the
// call's deadline passed), INVALID_ARGUMENT / OUT_OF_RANGE (bad request).
//
// Channels: make_worker_channel (control/channel.h).
//
// Thread-safety: a WorkerClient may be used from any number of threads at once (calls are
// multiplexed over its one channel). The callbacks of a streaming call run on the calling
// thread, one at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cleave/common/status.h"
#include "cleave/request/request.h"
#include "cleave/v1/worker.pb.h"

namespace cleave {

struct WorkerClientOptions {
  // connect() waits this long for the channel to become ready.
  std::chrono::milliseconds connect_timeout{5000};
  // Deadline of GetInfo, GetLoad, GetMetrics, Reserve, Release, RenewLease and Abort.
  std::chrono::milliseconds unary_timeout{10000};
  // Deadline of a Prefill call (compute and transfer of the whole prompt).
  std::chrono::milliseconds prefill_timeout{120000};
  // Deadline of a whole Decode or Generate stream.
  std::chrono::milliseconds stream_timeout{600000};
};

// Receives the token events of a request in order (the last one has finished = true). Return
// false to cancel the request: the stream is cancelled and no further event comes (false on
// the finished event changes nothing).
using TokenEventCallback = std::function<bool(const v1::TokenEvent&)>;

// How a streaming call ended (its error, if any, is the Result's status instead).
struct StreamResult {
  v1::TokenEvent last;     // the finished event; empty when cancelled
  bool cancelled = false;  // the callback returned false
  int64_t events = 0;      // events delivered to the callback
};

class WorkerClient {
 public:
  // Opens a channel to `target` ("host:port") and waits until it is ready or
  // opts.connect_timeout passes (Unavailable, naming the target).
  static Result<std::unique_ptr<WorkerClient>> connect(const std::string& target,
                                                       const WorkerClientOptions& opts = {});
  ~WorkerClient();
  WorkerClient(const WorkerClient&) = delete;
  WorkerClient& operator=(const WorkerClient&) = delete;

  const std::string& target() const;
  const WorkerClientOptions& options() const;

  Result<v1::WorkerInfo> info();
  Result<v1::LoadReport> load();
  // Prometheus text exposition of the worker's metrics.
  Result<std::string> metrics();

  // Decode (or unified) worker: reserves KV blocks for a prompt of `num_prompt_tokens` tokens
  // under `id` for `lease` (0: the worker's default). The destination goes to prefill() as is.
  Result<v1::KvDestination> reserve(RequestId id, int64_t num_prompt_tokens,
                                    std::chrono::milliseconds lease = std::chrono::milliseconds{0});
  // true when a reservation was given back; false when there was none under `id`.
  Result<bool> release(RequestId id);
  // RenewLease (decode or prefill worker): true when the reservation (or the Prefill writing
  // into it) was found and its lease runs again from now for `lease`.
  Result<bool> renew_lease(RequestId id, std::chrono::milliseconds lease);
  // Prefill (or unified) worker: computes the prompt, writes its KV into req.destination and
  // answers with the first token once the KV is in place.
  Result<v1::PrefillResponse> prefill(const v1::PrefillRequest& req);
  // Decode worker: continues a prefilled reservation; streams every later token.
  Result<StreamResult> decode(const v1::DecodeRequest& req, const TokenEventCallback& on_event);
  // Unified worker: the whole request in one process; streams every token.
  Result<StreamResult> generate(const v1::GenerateRequest& req, const TokenEventCallback& on_event);
  // Ends `id` on this worker whatever its stage; false when the worker did not know it.
  Result<bool> abort(RequestId id);

 private:
  struct Impl;
  explicit WorkerClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---- Pairing (DESIGN.md §3 "KV pool"): checked once per (prefill, decode) pair ----

// OK when a worker described by `prefill` may write its KV into one described by `decode`:
// roles (prefill or unified; decode or unified), then the model fingerprint and the KV layout
// (pairing_mismatch, kvcache/kv_layout.h). FailedPrecondition whose message says what differs, with
// both values, otherwise; InvalidArgument when an info's layout cannot be read.
Status check_pairing(const v1::WorkerInfo& prefill, const v1::WorkerInfo& decode);
// GetInfo on both workers, then check_pairing.
Status pair_workers(WorkerClient& prefill, WorkerClient& decode);

}  // namespace cleave
