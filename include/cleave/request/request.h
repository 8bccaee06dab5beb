// The vocabulary of one inference request shared by the router, the control-plane client and
// the workers: its id and how it finished (its wire name, finish_reason_name, is written by the
// engine: engine/generator.h). Sampling parameters: sampling_params.h.
#pragma once

#include <cstdint>

namespace cleave {

// Names a request on the workers it runs on; unique among the requests in flight there (the
// router assigns it).
using RequestId = uint64_t;

enum class FinishReason : uint8_t {
  kStop,       // end-of-generation token, stop token id or stop string
  kLength,     // max_tokens reached, or the context is full
  kCancelled,  // the token callback returned false
};

}  // namespace cleave
