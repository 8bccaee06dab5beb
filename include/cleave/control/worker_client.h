// The client side of the worker control plane (proto/cleave/v1/worker.proto): WorkerClient, one
// gRPC channel to one worker with a deadline on every call, and the orchestration of one
// request over workers that the router and `cleave client` share:
//
//   disaggregated:  decode.Reserve -> prefill.Prefill(destination) -> first token to the caller
//                   -> decode.Decode (stream) for the rest, unless the first token ended it
//   unified:        unified.Generate (stream)
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
#include "cleave/request/sampling_params.h"
#include "cleave/v1/worker.pb.h"

namespace cleave {

struct WorkerClientOptions {
  // connect() waits this long for the channel to become ready.
  std::chrono::milliseconds connect_timeout{5000};
  // Deadline of GetInfo, GetLoad, GetMetrics, Reserve, Release and Abort.
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

// ---- One request over workers ----

struct InferenceRequest {
  RequestId id = 0;  // unique among the requests in flight on the workers it goes to
  std::vector<int32_t> prompt;
  SamplingParams params;
  std::chrono::milliseconds lease{0};  // the decode reservation's lease (0: the worker's default)
};

struct InferenceOutcome {
  // The finished event as the callback saw it (usage of the whole request: cached_prompt_tokens
  // is the prefill's when its first event carries a usage); empty when the request was
  // cancelled.
  v1::TokenEvent last;
  bool cancelled = false;        // the callback returned false
  bool handed_off = false;       // the decode worker generated the tokens after the first
  int64_t events = 0;            // events delivered to the callback
  double ttft_seconds = 0;       // from the call to the first token's callback
  double total_seconds = 0;      // from the call to the end
  double kv_tail_seconds = 0;    // the prefill's report (disaggregated, handed off)
  uint64_t kv_bytes = 0;         // KV bytes the prefill wrote into the decode worker
};

// Runs `req` disaggregated. Reserve on `decode`; Prefill on `prefill` with that destination;
// the first token goes to `on_event`; unless it finished the request, Decode on `decode`
// streams the rest. When the prefill fails or finishes the request the reservation is
// released; when `on_event` returns false the request is aborted on both workers. An error of
// any step is returned (the reservation released or the request aborted first, best effort).
// The pairing is not checked here (pair_workers once per pair).
Result<InferenceOutcome> run_disaggregated(WorkerClient& prefill, WorkerClient& decode,
                                           const InferenceRequest& req,
                                           const TokenEventCallback& on_event);
// Runs `req` on a unified worker (Generate); on_event returning false aborts it.
Result<InferenceOutcome> run_unified(WorkerClient& unified, const InferenceRequest& req,
                                     const TokenEventCallback& on_event);

}  // namespace cleave
