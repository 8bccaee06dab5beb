// The gRPC API's requests in the HTTP API's terms (inference.proto): a GenerateTextRequest becomes
// the OpenAI request body it stands for, so that both APIs share one validation, one chat
// template path and one tokenization (RouterFrontend::prepare_*); an ApiError becomes the gRPC
// status that answers the call.
//
// Thread-safety: pure functions.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "cleave/router/openai_error.h"
#include "cleave/router/router_frontend.h"
#include "cleave/v1/inference.pb.h"

namespace cleave::router {

// The OpenAI JSON body of `request` and the endpoint it goes to: completions for prompts, chat
// for messages. 400 when it names both or neither, or when top_logprobs is set without
// logprobs on prompts.
openai::ApiResult<std::string> openai_body_of(const v1::GenerateTextRequest& request,
                                              openai::Endpoint* endpoint);

// The dispatches of `request` (validated as the HTTP API validates the same body); an Exchange
// on the gRPC wire streams them.
openai::ApiResult<PreparedRequest> prepare_generate(const RouterFrontend& frontend,
                                                    const v1::GenerateTextRequest& request);

// The status code of an ApiError: 400/413/422 INVALID_ARGUMENT, 401 UNAUTHENTICATED,
// 403 PERMISSION_DENIED, 404 NOT_FOUND, 429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE,
// 504 DEADLINE_EXCEEDED, else INTERNAL.
grpc::StatusCode grpc_code_of(const openai::ApiError& error);

// The status answering `error`, with its type, param and code added to `context`'s trailing
// metadata (cleave-error-type, cleave-error-param, cleave-error-code).
grpc::Status grpc_status_of(const openai::ApiError& error, grpc::ServerContextBase* context);

}  // namespace cleave::router
