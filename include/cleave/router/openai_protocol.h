// The OpenAI-compatible protocol layer of the router, without sockets: request parsing and
// validation (openai_request.h), error objects (openai_error.h), response bodies
// (openai_response.h), SSE chunks (openai_stream.h) and the JSON text they share
// (json_writer.h). The HTTP frontend calls these; nothing here does I/O or holds a lock.
//
// A request's path through them:
//   body -> parse_chat_completion_request / parse_completion_request (400 ApiError or request)
//        -> template + tokenize (elsewhere) -> resolve_sampling_params per prompt
//           (400 context_length_exceeded, default max_tokens, seed)
//        -> non-streaming: completion_response_json / chat_completion_response_json
//           streaming: StreamEncoder::append_chunk per token, append_usage, kSseDone
//   any failure before the stream opens: ApiError::to_json() with ApiError::http_status.
#pragma once

#include "cleave/router/json_writer.h"
#include "cleave/router/openai_error.h"
#include "cleave/router/openai_request.h"
#include "cleave/router/openai_response.h"
#include "cleave/router/openai_stream.h"
