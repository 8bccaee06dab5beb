// Conversions of the control plane's request vocabulary, and Status <-> grpc::Status.
#include "cleave/control/proto_convert.h"

#include "fmt/format.h"

namespace cleave {

void to_proto(const SamplingParams& p, v1::SamplingParams* out) {
  out->set_max_tokens(p.max_tokens);
  out->set_temperature(p.temperature);
  out->set_top_p(p.top_p);
  out->set_top_k(p.top_k);
  out->set_min_p(p.min_p);
  out->set_seed(p.seed);
  out->clear_stop();
  for (const auto& s : p.stop) out->add_stop(s);
  out->clear_stop_token_ids();
  for (int32_t id : p.stop_token_ids) out->add_stop_token_ids(id);
  out->set_presence_penalty(p.presence_penalty);
  out->set_frequency_penalty(p.frequency_penalty);
  out->set_repetition_penalty(p.repetition_penalty);
  out->set_logprobs(p.logprobs);
  out->set_ignore_eos(p.ignore_eos);
  out->set_min_tokens(p.min_tokens);
  if (p.prompt_logprobs >= 0) {
    out->set_prompt_logprobs(p.prompt_logprobs);
  } else {
    out->clear_prompt_logprobs();
  }
}

SamplingParams from_proto(const v1::SamplingParams& p) {
  SamplingParams s;
  s.max_tokens = p.max_tokens();
  s.temperature = p.temperature();
  s.top_p = p.top_p();
  s.top_k = p.top_k();
  s.min_p = p.min_p();
  s.seed = p.seed();
  s.stop.assign(p.stop().begin(), p.stop().end());
  s.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  s.presence_penalty = p.presence_penalty();
  s.frequency_penalty = p.frequency_penalty();
  s.repetition_penalty = p.repetition_penalty();
  s.logprobs = p.logprobs();
  s.ignore_eos = p.ignore_eos();
  s.min_tokens = p.min_tokens();
  s.prompt_logprobs = p.has_prompt_logprobs() ? p.prompt_logprobs() : -1;
  return s;
}

void to_proto(const KvLayout& l, v1::KvLayoutInfo* out) {
  out->set_version(l.version);
  out->set_dtype(std::string(dtype_name(l.dtype)));
  out->set_block_size(l.block_size);
  out->set_n_layers(l.n_layers);
  out->set_n_kv_heads(l.n_kv_heads);
  out->set_head_dim(l.head_dim);
  out->set_num_blocks(l.num_blocks);
}

KvLayout layout_numbers_from_proto(const v1::KvLayoutInfo& l) {
  KvLayout out;
  out.version = l.version();
  out.block_size = l.block_size();
  out.n_layers = l.n_layers();
  out.n_kv_heads = l.n_kv_heads();
  out.head_dim = l.head_dim();
  out.num_blocks = l.num_blocks();
  return out;
}

Result<KvLayout> from_proto(const v1::KvLayoutInfo& l) {
  const std::optional<DType> dtype = parse_dtype(l.dtype());
  if (!dtype) return InvalidArgument(fmt::format("KV layout: unknown dtype '{}'", l.dtype()));
  KvLayout out = layout_numbers_from_proto(l);
  out.dtype = *dtype;
  if (std::string why = out.validate(); !why.empty()) {
    return InvalidArgument("KV layout: " + why);
  }
  return out;
}

grpc::Status to_grpc(const Status& s) {
  grpc::StatusCode code = grpc::StatusCode::UNKNOWN;
  switch (s.code()) {
    case StatusCode::kOk: return grpc::Status::OK;
    case StatusCode::kCancelled: code = grpc::StatusCode::CANCELLED; break;
    case StatusCode::kInvalidArgument: code = grpc::StatusCode::INVALID_ARGUMENT; break;
    case StatusCode::kDeadlineExceeded: code = grpc::StatusCode::DEADLINE_EXCEEDED; break;
    case StatusCode::kNotFound: code = grpc::StatusCode::NOT_FOUND; break;
    case StatusCode::kAlreadyExists: code = grpc::StatusCode::ALREADY_EXISTS; break;
    case StatusCode::kPermissionDenied: code = grpc::StatusCode::PERMISSION_DENIED; break;
    case StatusCode::kResourceExhausted: code = grpc::StatusCode::RESOURCE_EXHAUSTED; break;
    case StatusCode::kFailedPrecondition: code = grpc::StatusCode::FAILED_PRECONDITION; break;
    case StatusCode::kAborted: code = grpc::StatusCode::ABORTED; break;
    case StatusCode::kOutOfRange: code = grpc::StatusCode::OUT_OF_RANGE; break;
    case StatusCode::kUnimplemented: code = grpc::StatusCode::UNIMPLEMENTED; break;
    case StatusCode::kInternal: code = grpc::StatusCode::INTERNAL; break;
    case StatusCode::kUnavailable: code = grpc::StatusCode::UNAVAILABLE; break;
    case StatusCode::kDataLoss: code = grpc::StatusCode::DATA_LOSS; break;
    case StatusCode::kUnauthenticated: code = grpc::StatusCode::UNAUTHENTICATED; break;
  }
  return grpc::Status(code, s.message());
}

std::string_view grpc_code_name(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

Status from_grpc(const grpc::Status& s) {
  StatusCode code = StatusCode::kInternal;
  switch (s.error_code()) {
    case grpc::StatusCode::OK: return Status::Ok();
    case grpc::StatusCode::CANCELLED: code = StatusCode::kCancelled; break;
    case grpc::StatusCode::INVALID_ARGUMENT: code = StatusCode::kInvalidArgument; break;
    case grpc::StatusCode::DEADLINE_EXCEEDED: code = StatusCode::kDeadlineExceeded; break;
    case grpc::StatusCode::NOT_FOUND: code = StatusCode::kNotFound; break;
    case grpc::StatusCode::ALREADY_EXISTS: code = StatusCode::kAlreadyExists; break;
    case grpc::StatusCode::PERMISSION_DENIED: code = StatusCode::kPermissionDenied; break;
    case grpc::StatusCode::RESOURCE_EXHAUSTED: code = StatusCode::kResourceExhausted; break;
    case grpc::StatusCode::FAILED_PRECONDITION: code = StatusCode::kFailedPrecondition; break;
    case grpc::StatusCode::ABORTED: code = StatusCode::kAborted; break;
    case grpc::StatusCode::OUT_OF_RANGE: code = StatusCode::kOutOfRange; break;
    case grpc::StatusCode::UNIMPLEMENTED: code = StatusCode::kUnimplemented; break;
    case grpc::StatusCode::INTERNAL: code = StatusCode::kInternal; break;
    case grpc::StatusCode::UNAVAILABLE: code = StatusCode::kUnavailable; break;
    case grpc::StatusCode::DATA_LOSS: code = StatusCode::kDataLoss; break;
    case grpc::StatusCode::UNAUTHENTICATED: code = StatusCode::kUnauthenticated; break;
    case grpc::StatusCode::UNKNOWN:
    default:
      return Internal(s.error_message().empty() ? "unknown gRPC error"
                                                : "unknown gRPC error: " + s.error_message());
  }
  return Status(code, s.error_message());
}

}  // namespace cleave
