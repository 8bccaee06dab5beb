// One request over workers: the disaggregated Reserve -> Prefill -> Decode sequence, the unified
// Generate, and the pairing check of a (prefill, decode) pair.
#include <chrono>
#include <string>
#include <vector>

#include "cleave/common/log.h"
#include "cleave/control/proto_convert.h"
#include "cleave/control/worker_client.h"
#include "cleave/kvcache/kv_layout.h"
#include "fmt/format.h"

namespace cleave {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string describe(const v1::WorkerInfo& info) {
  return fmt::format("{} worker '{}'", info.role().empty() ? "a" : info.role(), info.worker_id());
}

// Best-effort clean-up calls: their failure (e.g. the worker is gone) is logged, not returned;
// the worker's own lease or cancellation frees what they would have freed.
void release_quietly(WorkerClient& decode, RequestId id) {
  auto r = decode.release(id);
  if (!r.ok()) log::warn("request {}: releasing its reservation failed: {}", id, r.status().to_string());
}

void abort_quietly(WorkerClient& worker, RequestId id) {
  auto r = worker.abort(id);
  if (!r.ok()) log::warn("request {}: abort failed: {}", id, r.status().to_string());
}

}  // namespace

Status check_pairing(const v1::WorkerInfo& prefill, const v1::WorkerInfo& decode) {
  std::vector<std::string> problems;
  if (prefill.role() != "prefill" && prefill.role() != "unified") {
    problems.push_back(fmt::format("worker '{}' has role '{}', not prefill or unified",
                                   prefill.worker_id(), prefill.role()));
  }
  if (decode.role() != "decode" && decode.role() != "unified") {
    problems.push_back(fmt::format("worker '{}' has role '{}', not decode or unified",
                                   decode.worker_id(), decode.role()));
  }
  auto prefill_layout = from_proto(prefill.kv_layout());
  if (!prefill_layout.ok()) {
    return prefill_layout.status().with_context(describe(prefill) + ": KV layout");
  }
  auto decode_layout = from_proto(decode.kv_layout());
  if (!decode_layout.ok()) {
    return decode_layout.status().with_context(describe(decode) + ": KV layout");
  }
  std::string mismatch = pairing_mismatch(prefill.model_fingerprint(), *prefill_layout,
                                          decode.model_fingerprint(), *decode_layout);
  if (!mismatch.empty()) problems.push_back(std::move(mismatch));
  if (prefill.transfer_provider() != decode.transfer_provider()) {
    problems.push_back(fmt::format("transfer provider differs (prefill {}, decode {})",
                                   prefill.transfer_provider(), decode.transfer_provider()));
  }
  if (problems.empty()) return Status::Ok();
  std::string msg = fmt::format("{} cannot write its KV into {}: ", describe(prefill), describe(decode));
  for (size_t i = 0; i < problems.size(); ++i) {
    if (i > 0) msg += "; ";
    msg += problems[i];
  }
  return FailedPrecondition(std::move(msg));
}

Status pair_workers(WorkerClient& prefill, WorkerClient& decode) {
  CLEAVE_ASSIGN_OR_RETURN(v1::WorkerInfo prefill_info, prefill.info());
  CLEAVE_ASSIGN_OR_RETURN(v1::WorkerInfo decode_info, decode.info());
  return check_pairing(prefill_info, decode_info);
}

Result<InferenceOutcome> run_disaggregated(WorkerClient& prefill, WorkerClient& decode,
                                           const InferenceRequest& req,
                                           const TokenEventCallback& on_event) {
  const auto t0 = Clock::now();
  InferenceOutcome out;
  CLEAVE_ASSIGN_OR_RETURN(
      v1::KvDestination dest,
      decode.reserve(req.id, static_cast<int64_t>(req.prompt.size()), req.lease));

  v1::PrefillRequest prefill_req;
  prefill_req.set_request_id(req.id);
  prefill_req.mutable_prompt_tokens()->Assign(req.prompt.begin(), req.prompt.end());
  to_proto(req.params, prefill_req.mutable_params());
  *prefill_req.mutable_destination() = std::move(dest);
  auto prefilled = prefill.prefill(prefill_req);
  if (!prefilled.ok()) {
    // A prefill that outlived our deadline may still be running there.
    if (prefilled.status().code() == StatusCode::kDeadlineExceeded) abort_quietly(prefill, req.id);
    release_quietly(decode, req.id);
    return prefilled.status();
  }
  v1::PrefillResponse& pr = *prefilled;
  out.kv_tail_seconds = pr.kv_tail_seconds();
  out.kv_bytes = pr.kv_bytes();
  const v1::TokenEvent& first = pr.first();
  // The prefill's usage (when it reports one) knows the prompt tokens its prefix cache served.
  const bool prefill_usage = first.has_usage();
  const int64_t cached_prompt_tokens = first.usage().cached_prompt_tokens();

  out.ttft_seconds = seconds_since(t0);
  out.events = 1;
  const bool keep_going = on_event(first);
  if (first.finished()) {
    // Nothing was written for the decode side: give its blocks back at once.
    release_quietly(decode, req.id);
    out.last = first;
    out.total_seconds = seconds_since(t0);
    return out;
  }
  if (!keep_going) {
    abort_quietly(decode, req.id);
    abort_quietly(prefill, req.id);
    out.cancelled = true;
    out.total_seconds = seconds_since(t0);
    return out;
  }

  v1::DecodeRequest decode_req;
  decode_req.set_request_id(req.id);
  decode_req.mutable_prompt_tokens()->Assign(req.prompt.begin(), req.prompt.end());
  to_proto(req.params, decode_req.mutable_params());
  decode_req.set_first_token(first.token());
  out.handed_off = true;
  // The finished event reports the usage of the whole request: the prompt tokens the prefill
  // found in its prefix cache, not the decode side's (which never computes the prompt).
  auto streamed = decode.decode(decode_req, [&](const v1::TokenEvent& ev) {
    if (!prefill_usage || !ev.finished() || !ev.has_usage()) return on_event(ev);
    v1::TokenEvent last = ev;
    last.mutable_usage()->set_cached_prompt_tokens(cached_prompt_tokens);
    return on_event(last);
  });
  if (!streamed.ok()) {
    abort_quietly(decode, req.id);
    return streamed.status();
  }
  out.events += streamed->events;
  out.cancelled = streamed->cancelled;
  if (out.cancelled) {
    abort_quietly(decode, req.id);
    abort_quietly(prefill, req.id);
  } else {
    out.last = std::move(streamed->last);
    if (prefill_usage && out.last.has_usage()) {
      out.last.mutable_usage()->set_cached_prompt_tokens(cached_prompt_tokens);
    }
  }
  out.total_seconds = seconds_since(t0);
  return out;
}

Result<InferenceOutcome> run_unified(WorkerClient& unified, const InferenceRequest& req,
                                     const TokenEventCallback& on_event) {
  const auto t0 = Clock::now();
  InferenceOutcome out;
  v1::GenerateRequest gen;
  gen.set_request_id(req.id);
  gen.mutable_prompt_tokens()->Assign(req.prompt.begin(), req.prompt.end());
  to_proto(req.params, gen.mutable_params());
  bool first_seen = false;
  auto streamed = unified.generate(gen, [&](const v1::TokenEvent& ev) {
    if (!first_seen) {
      first_seen = true;
      out.ttft_seconds = seconds_since(t0);
    }
    return on_event(ev);
  });
  if (!streamed.ok()) {
    abort_quietly(unified, req.id);
    return streamed.status();
  }
  out.events = streamed->events;
  out.cancelled = streamed->cancelled;
  if (out.cancelled) abort_quietly(unified, req.id);
  else out.last = std::move(streamed->last);
  out.total_seconds = seconds_since(t0);
  return out;
}

}  // namespace cleave
