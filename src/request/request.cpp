// The request vocabulary's wire names (request/request.h).
#include "cleave/request/request.h"

namespace cleave {

std::string_view finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "unknown";
}

}  // namespace cleave
