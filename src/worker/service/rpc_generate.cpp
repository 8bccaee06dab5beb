// Unified workers' Generate (token_stream.cpp streams it).
#include "token_stream.h"
#include "worker_core.h"

namespace cleave::worker_service {

grpc::ServerWriteReactor<v1::TokenEvent>* WorkerRpcs::Generate(grpc::CallbackServerContext* /*ctx*/,
                                                               const v1::GenerateRequest* req) {
  return start_generate(pump_, req);
}

}  // namespace cleave::worker_service
