// One request through a Dispatcher (dispatcher.h), run synchronously: for callers that block
// until the request is over (`cleave client`, the multi-process tests, the benches) instead of
// observing it. The orchestration (Reserve -> Prefill -> Decode, or Generate; retries, stage
// deadlines, clean-ups) is the dispatcher's; this only waits for it.
//
// Thread-safety: any number of run_request calls may run at once on one dispatcher. The
// callback runs on the dispatcher's threads (gRPC's), one event at a time, in order: it must not
// block for long, and must not call into the same dispatcher's shutdown().
#pragma once

#include <chrono>
#include <cstdint>

#include "cleave/common/status.h"
#include "cleave/control/worker_client.h"
#include "cleave/router/dispatcher.h"
#include "cleave/v1/worker.pb.h"

namespace cleave::router {

struct RequestOutcome {
  // The finished event as the callback saw it (its usage is the whole request's:
  // cached_prompt_tokens is the prefill's); empty when the request was cancelled.
  v1::TokenEvent last;
  bool cancelled = false;       // the callback returned false before the finished event
  bool handed_off = false;      // disaggregated: the decode worker generated the later tokens
  int64_t events = 0;           // events delivered to the callback
  double ttft_seconds = 0;      // from the submit to the first event's callback
  double total_seconds = 0;     // from the submit to the end of the request
  // Disaggregated: the prefill's report (PrefillFigures); 0 in unified mode.
  uint64_t kv_bytes = 0;
  double kv_tail_seconds = 0;
};

// Submits `request` and blocks until the dispatcher has ended it, delivering its events to
// `on_event` (TokenEventCallback, control/worker_client.h: return false to cancel; false on the
// finished event changes nothing). Returns the outcome when it finished or was cancelled (then
// once the dispatcher has stopped its RPCs and sent the workers their Aborts); the error of
// submit (ResourceExhausted, Unavailable, InvalidArgument) or of the request (as the
// observer's on_error hears it) otherwise.
// Bounded by the dispatcher's stage deadlines (DispatchTimeouts: reserve, prefill, first_token,
// stream_idle per event, each attempt) and by its shutdown(); it adds no wait of its own.
Result<RequestOutcome> run_request(Dispatcher& dispatcher, DispatchRequest request,
                                   const TokenEventCallback& on_event);

// Waits until `dispatcher` is ready, polling readiness() every 10 ms: OK once ready; the
// FailedPrecondition of a refused pairing at once (waiting does not mend it); the last
// readiness() (Unavailable, naming the workers and why) when `timeout` passes first.
Status wait_until_ready(const Dispatcher& dispatcher, std::chrono::milliseconds timeout);

}  // namespace cleave::router
