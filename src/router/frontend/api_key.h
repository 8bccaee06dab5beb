// The API key check both frontends (HTTP and gRPC) apply to every /v1 request.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/router/openai_error.h"

namespace cleave::router {

// 401 unless `api_keys` is empty or `authorization` is "Bearer <one of them>" (the scheme in
// any case; the comparison takes a time that does not depend on where a key differs).
std::optional<openai::ApiError> check_api_key(const std::vector<std::string>& api_keys,
                                              std::string_view authorization);

}  // namespace cleave::router
