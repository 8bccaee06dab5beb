// `cleave bench transfer`'s helpers (bench/transfer/transfer_bench.cpp).
#include <gtest/gtest.h>

#include "cleave/bench/transfer_bench.h"

namespace cleave::transfer {
namespace {

TEST(ParseSizesTest, ReadsUnitsAndNamesBadItems) {
  auto s = parse_sizes("4KiB,64KiB,1MiB,4MiB,17");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, (std::vector<uint64_t>{4096, 65536, 1 << 20, 4 << 20, 17}));
  auto bad = parse_sizes("4KiB,lots");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("lots"), std::string::npos);
}

}  // namespace
}  // namespace cleave::transfer
