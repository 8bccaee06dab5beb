// Conversions between the control plane's messages (proto/cleave/v1/worker.proto) and the
// worker's own types (KvDestination, EngineEvent). Those of the request vocabulary and
// Status <-> grpc::Status: control/proto_convert.h (included).
#pragma once

#include "cleave/control/proto_convert.h"
#include "cleave/v1/worker.pb.h"
#include "cleave/worker/engine_loop.h"
#include "cleave/worker/kv_export.h"

namespace cleave {

void to_proto(const KvDestination& d, v1::KvDestination* out);
// InvalidArgument for a bad layout or region descriptor.
Result<KvDestination> from_proto(const v1::KvDestination& d);

// Token, text, logprobs, finish reason and usage (on the finished event). An event with a
// non-OK error is not a TokenEvent: the RPC ends with to_grpc(error) instead.
void to_proto(const EngineEvent& ev, v1::TokenEvent* out);

}  // namespace cleave
