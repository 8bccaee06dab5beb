// The pairing check of a (prefill, decode) pair (worker_client.h).
#include <string>
#include <vector>

#include "cleave/control/proto_convert.h"
#include "cleave/control/worker_client.h"
#include "cleave/kvcache/kv_layout.h"
#include "fmt/format.h"

namespace cleave {
namespace {

std::string describe(const v1::WorkerInfo& info) {
  return fmt::format("{} worker '{}'", info.role().empty() ? "a" : info.role(), info.worker_id());
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

}  // namespace cleave
