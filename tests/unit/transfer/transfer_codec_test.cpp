#include <gtest/gtest.h>

#include "cleave/transfer/transfer_engine.h"
#include "transfer/transfer_codec.h"

namespace cleave::transfer {
namespace {

TEST(RemoteDescriptorTest, RoundTripsAndRefusesDamagedBytes) {
  RemoteDescriptor d{0x1122334455667788ull, 7, 0xdeadbeef000ull, 1 << 20, true, {42, 43}};
  auto back = RemoteDescriptor::decode(d.encode());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, d);
  std::string bytes = d.encode();
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    EXPECT_EQ(RemoteDescriptor::decode(bytes.substr(0, cut)).status().code(), StatusCode::kDataLoss)
        << "cut at " << cut;
  }
  EXPECT_EQ(RemoteDescriptor::decode(bytes + "x").status().code(), StatusCode::kDataLoss);
  bytes[0] ^= 1;
  EXPECT_EQ(RemoteDescriptor::decode(bytes).status().code(), StatusCode::kDataLoss);
}

TEST(EngineAddressTest, CarriesHostIdAndPidAndRefusesDamagedBytes) {
  EngineAddress a{0xabcdef, "shm", {"rail0-name", std::string("\0bin\xff", 5)}, local_host_id(),
                  4242};
  auto back = EngineAddress::decode(a.encode());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->engine_id, a.engine_id);
  EXPECT_EQ(back->provider, "shm");
  EXPECT_EQ(back->rail_names, a.rail_names);
  EXPECT_EQ(back->host_id, a.host_id);
  EXPECT_EQ(back->pid, 4242u);
  EXPECT_FALSE(local_host_id().empty()) << "boot id / pid namespace unreadable";
  std::string bytes = a.encode();
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    EXPECT_EQ(EngineAddress::decode(bytes.substr(0, cut)).status().code(), StatusCode::kDataLoss)
        << "cut at " << cut;
  }
  EXPECT_EQ(EngineAddress::decode(bytes + "x").status().code(), StatusCode::kDataLoss);
}

WriteOp op(uint64_t lo, uint64_t ro, uint64_t len, uint64_t region = 1) {
  WriteOp w;
  w.local_region = 1;
  w.local_offset = lo;
  w.remote.engine_id = 9;
  w.remote.region_id = region;
  w.remote_offset = ro;
  w.len = len;
  return w;
}

TEST(PlanSlicesTest, CoalescesAdjacentRangesAndSlicesLargeOnes) {
  // Three adjacent 4 KiB writes merge; the fourth is not adjacent remotely; the fifth goes to
  // another remote region.
  std::vector<WriteOp> w = {op(0, 100, 4096), op(4096, 4196, 4096), op(8192, 8292, 4096),
                            op(12288, 0, 4096), op(16384, 4096, 4096, 2)};
  auto s = plan_slices(w, 1 << 20);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].len, 3u * 4096);
  EXPECT_EQ(s[0].remote_offset, 100u);
  EXPECT_EQ(s[1].remote_offset, 0u);
  EXPECT_EQ(s[2].remote_index, 4u);

  auto big = plan_slices({op(0, 0, (3u << 20) + 5)}, 1 << 20);
  ASSERT_EQ(big.size(), 4u);
  EXPECT_EQ(big[3].len, 5u);
  EXPECT_EQ(big[2].local_offset, 2u << 20);
  EXPECT_EQ(big[2].remote_offset, 2u << 20);
}

// Which providers revoke a key by deregistering it (worker.kv_fence auto picks by this): those
// where the key is ours (tcp, shm), not efa and verbs, whose registration cache hands every
// registration of the same memory one key.
TEST(TransferEngineTest, OnlyTcpAndShmRevokeKeysByDeregistering) {
  for (const char* p : {"tcp;ofi_rxm", "tcp", "shm", "sockets"}) {
    EXPECT_TRUE(TransferEngine::provider_revokes_keys(p)) << p;
  }
  for (const char* p : {"efa", "verbs;ofi_rxm", "verbs", "psm3", "cxi", ""}) {
    EXPECT_FALSE(TransferEngine::provider_revokes_keys(p)) << p;
  }
}

TEST(TransferEngineTest, InProcessPairOverTcpWritesAndNotifies) {
  TransferSettings s;
  s.provider = "tcp;ofi_rxm";
  s.node = "127.0.0.1";
  auto a = TransferEngine::create(s);
  auto b = TransferEngine::create(s);
  if (!a.ok()) GTEST_SKIP() << "tcp;ofi_rxm unavailable: " << a.status().to_string();
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*a)->provider(), "tcp;ofi_rxm");
  std::vector<char> src(100000, 'q'), dst(100000, 0);
  auto ms = (*a)->register_memory(src.data(), src.size(), MemoryKind::host());
  auto md = (*b)->register_memory(dst.data(), dst.size(), MemoryKind::host());
  ASSERT_TRUE(ms.ok() && md.ok());
  EXPECT_EQ((*a)->register_memory(src.data(), 4, MemoryKind::cuda(0)).status().code(),
            StatusCode::kFailedPrecondition);
  auto peer = (*a)->connect((*b)->address());
  ASSERT_TRUE(peer.ok()) << peer.status().to_string();
  auto h = (*a)->submit(Batch{*peer, {{ms->id, 10, md->remote, 20, 50000}}, 77});
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(h->wait(std::chrono::seconds(10)).ok());
  auto n = (*b)->wait_notice(std::chrono::seconds(10));
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(n->tag, 77u);
  EXPECT_EQ(n->from_engine, (*a)->engine_id());
  EXPECT_EQ(dst[19], 0);
  EXPECT_EQ(dst[20], 'q');
  EXPECT_EQ(dst[20 + 49999], 'q');
  EXPECT_EQ(dst[20 + 50000], 0);
  // notify() after the batch, ordered after it.
  auto h2 = (*a)->notify(*peer, 78);
  ASSERT_TRUE(h2.ok());
  EXPECT_TRUE(h2->wait(std::chrono::seconds(10)).ok());
  auto n2 = (*b)->wait_notice(std::chrono::seconds(10));
  ASSERT_TRUE(n2.ok());
  EXPECT_EQ(n2->tag, 78u);
  EXPECT_EQ(n2->value, 0u);
  // A notice carries a word beside its tag (the prefill's first token).
  auto h3 = (*a)->notify(*peer, 79, 0xfeedbeefcafe1234ull);
  ASSERT_TRUE(h3.ok());
  EXPECT_TRUE(h3->wait(std::chrono::seconds(10)).ok());
  auto n3 = (*b)->wait_notice(std::chrono::seconds(10));
  ASSERT_TRUE(n3.ok());
  EXPECT_EQ(n3->tag, 79u);
  EXPECT_EQ(n3->value, 0xfeedbeefcafe1234ull);
  EXPECT_EQ((*a)->metrics().peers.at((*b)->engine_id()).transfers, 3u);
  EXPECT_EQ((*a)->connect("garbage").status().code(), StatusCode::kDataLoss);
}

}  // namespace
}  // namespace cleave::transfer
