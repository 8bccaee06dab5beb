// Conversions between the control plane's messages (proto/cleave/v1/worker.proto) and the
// library types, and the one place where Status maps to and from grpc::Status.
#pragma once

#include <string>

#include "cleave/common/status.h"
#include "cleave/engine/sampler.h"
#include "cleave/kvcache/kv_layout.h"
#include "cleave/v1/worker.pb.h"
#include "cleave/worker/engine_loop.h"
#include "cleave/worker/kv_export.h"
#include "grpcpp/support/status.h"

namespace cleave {

// Every field is written, so the receiver never sees a proto3 default standing in for a value.
void to_proto(const SamplingParams& p, v1::SamplingParams* out);
// Field by field; validation is the engine's (SamplingParams::validate).
SamplingParams from_proto(const v1::SamplingParams& p);

void to_proto(const KvLayout& l, v1::KvLayoutInfo* out);
// InvalidArgument for an unknown dtype name or a layout that does not validate().
Result<KvLayout> from_proto(const v1::KvLayoutInfo& l);

void to_proto(const KvDestination& d, v1::KvDestination* out);
// InvalidArgument for a bad layout or region descriptor.
Result<KvDestination> from_proto(const v1::KvDestination& d);

// Token, text, logprobs, finish reason and usage (on the finished event). An event with a
// non-OK error is not a TokenEvent: the RPC ends with to_grpc(error) instead.
void to_proto(const EngineEvent& ev, v1::TokenEvent* out);

// StatusCode -> grpc::StatusCode of the same meaning, message kept.
grpc::Status to_grpc(const Status& s);
Status from_grpc(const grpc::Status& s);

// Short status name for metrics labels ("OK", "UNAVAILABLE", ...).
std::string_view grpc_code_name(grpc::StatusCode code);

}  // namespace cleave
