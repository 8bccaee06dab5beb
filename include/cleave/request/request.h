// The vocabulary of one inference request shared by the router, the control-plane client and
// the workers: its id and how it finished. Sampling parameters: sampling_params.h.
#pragma once

#include <cstdint>
#include <string_view>

namespace cleave {

// Names a request on the workers it runs on; unique among the requests in flight there (the
// router assigns it).
using RequestId = uint64_t;

enum class FinishReason : uint8_t {
  kStop,       // end-of-generation token, stop token id or stop string
  kLength,     // max_tokens reached, or the context is full
  kCancelled,  // the token callback returned false
};

// The wire name (OpenAI's finish_reason): "stop", "length", "cancelled".
std::string_view finish_reason_name(FinishReason r);

}  // namespace cleave
