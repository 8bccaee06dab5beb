#include "cleave/common/status.h"

#include <gtest/gtest.h>

namespace cleave {
namespace {

Result<int> half(int x) {
  if (x % 2) return InvalidArgument("odd: " + std::to_string(x));
  return x / 2;
}

Result<int> quarter(int x) {
  CLEAVE_ASSIGN_OR_RETURN(int h, half(x));
  CLEAVE_ASSIGN_OR_RETURN(int q, half(h));
  return q;
}

Status check_even(int x) {
  CLEAVE_RETURN_IF_ERROR(half(x).status());
  return Status::Ok();
}

TEST(StatusTest, OkAndErrors) {
  EXPECT_TRUE(Status::Ok().ok());
  Status s = DataLoss("truncated");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.to_string(), "DATA_LOSS: truncated");
  EXPECT_EQ(s.with_context("model.gguf").message(), "model.gguf: truncated");
}

TEST(StatusTest, ResultPropagation) {
  EXPECT_EQ(*quarter(8), 2);
  auto r = quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "odd: 3");
  EXPECT_TRUE(check_even(4).ok());
  EXPECT_EQ(check_even(5).code(), StatusCode::kInvalidArgument);
}

TEST(StatusTest, ResultFromAnOkStatusIsAnInternalError) {
  Result<int> r(Status::Ok());
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
  EXPECT_NE(r.status().message().find("OK status"), std::string::npos) << r.status().to_string();
}

}  // namespace
}  // namespace cleave
