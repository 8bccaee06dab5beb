// Conversions between the control plane's messages (proto/cleave/v1/worker.proto) and the
// request vocabulary both sides use (sampling parameters, KV layout), and the one place where
// Status maps to and from grpc::Status. The conversions of worker-only types (KvDestination,
// EngineEvent) are the worker's (worker/proto_convert.h).
#pragma once

#include <string_view>

#include "cleave/common/status.h"
#include "cleave/kvcache/kv_layout.h"
#include "cleave/request/sampling_params.h"
#include "cleave/v1/worker.pb.h"
#include "grpcpp/support/status.h"

namespace cleave {

// Every field is written, so the receiver never sees a proto3 default standing in for a value.
void to_proto(const SamplingParams& p, v1::SamplingParams* out);
// Field by field; validation is the receiver's (SamplingParams::validate).
SamplingParams from_proto(const v1::SamplingParams& p);

void to_proto(const KvLayout& l, v1::KvLayoutInfo* out);
// InvalidArgument for an unknown dtype name or a layout that does not validate().
Result<KvLayout> from_proto(const v1::KvLayoutInfo& l);
// The numeric fields only, copied as sent: no dtype (the message names it; kv_layout.h's
// pairing_mismatch takes that name) and no validation.
KvLayout layout_numbers_from_proto(const v1::KvLayoutInfo& l);

// StatusCode -> grpc::StatusCode of the same meaning, message kept.
grpc::Status to_grpc(const Status& s);
Status from_grpc(const grpc::Status& s);

// Short status name for metrics labels ("OK", "UNAVAILABLE", ...).
std::string_view grpc_code_name(grpc::StatusCode code);

}  // namespace cleave
