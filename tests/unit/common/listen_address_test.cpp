#include "cleave/common/listen_address.h"

#include <gtest/gtest.h>

namespace cleave {
namespace {

TEST(ListenAddressTest, HostAndPortSplitAndBadOnesAreRefused) {
  auto a = parse_listen_address("127.0.0.1:0");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 0);
  a = parse_listen_address("[::1]:50051");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "[::1]");
  EXPECT_EQ(a->port, 50051);
  for (const char* bad : {"127.0.0.1", "127.0.0.1:x", ":80", "1.2.3.4:70000", "::1:80", ""}) {
    auto r = parse_listen_address(bad);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find(bad), std::string::npos) << bad;
  }
}

}  // namespace
}  // namespace cleave
