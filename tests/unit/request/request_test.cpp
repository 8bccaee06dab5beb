// The request vocabulary's wire names (request/request.h).
#include "cleave/request/request.h"

#include <gtest/gtest.h>

namespace cleave {
namespace {

TEST(FinishReasonName, NamesEachReasonAsTheOpenAiApiDoes) {
  EXPECT_EQ(finish_reason_name(FinishReason::kStop), "stop");
  EXPECT_EQ(finish_reason_name(FinishReason::kLength), "length");
  EXPECT_EQ(finish_reason_name(FinishReason::kCancelled), "cancelled");
  EXPECT_EQ(finish_reason_name(static_cast<FinishReason>(200)), "unknown");
}

}  // namespace
}  // namespace cleave
