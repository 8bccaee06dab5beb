// Not named *_test.cpp: tests/transfer.cmake registers this one.
// A revoked registration fences late writes: two engines in this process over tcp;ofi_rxm and
// shm on 127.0.0.1. The target registers a region and gives its descriptor away, then revokes
// it (deregister). A write carrying the revoked key fails at the initiator with an error and
// the target's bytes stay as they were; a fresh registration of the same memory (what the
// next owner of reused KV blocks gets) takes writes again.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cleave/transfer/transfer_engine.h"
#include "fmt/format.h"

namespace cleave::transfer {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kBytes = 64 << 10;

class RevokedKeyTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    TransferSettings s;
    s.provider = GetParam();
    s.node = "127.0.0.1";
    s.rails = 1;
    s.completion_timeout_ms = 1500;
    auto t = TransferEngine::create(s, true);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    target_ = std::move(t).value();
    auto i = TransferEngine::create(s, true);
    ASSERT_TRUE(i.ok()) << i.status().to_string();
    initiator_ = std::move(i).value();
    auto peer = initiator_->connect(target_->address());
    ASSERT_TRUE(peer.ok()) << peer.status().to_string();
    peer_ = *peer;
    auto src = initiator_->register_memory(src_.data(), src_.size(), MemoryKind::host());
    ASSERT_TRUE(src.ok()) << src.status().to_string();
    src_region_ = src->id;
  }

  // Writes kBytes of `fill` from the initiator into `remote` and waits for the outcome.
  Status write(char fill, const RemoteDescriptor& remote) {
    std::memset(src_.data(), fill, src_.size());
    Batch b;
    b.peer = peer_;
    b.writes.push_back(WriteOp{src_region_, 0, remote, 0, kBytes});
    const auto t0 = std::chrono::steady_clock::now();
    auto h = initiator_->submit(b);
    Status s = h.ok() ? h->wait(20s) : h.status();
    note(fmt::format("write '{}': {}", fill, s.ok() ? std::string("ok") : s.to_string()), t0);
    return s;
  }

  // Each step's outcome and time, printed when the test fails (a load flake's diagnosis).
  void note(const std::string& what, std::chrono::steady_clock::time_point t0) {
    const auto now = std::chrono::steady_clock::now();
    steps_ += fmt::format("  +{} ms: {} ({} ms)\n",
                          std::chrono::duration_cast<std::chrono::milliseconds>(now - start_).count(),
                          what,
                          std::chrono::duration_cast<std::chrono::milliseconds>(now - t0).count());
  }

  void TearDown() override {
    if (HasFailure()) std::fprintf(stderr, "steps:\n%s", steps_.c_str());
  }

  // The refused write broke the connection (tcp: the target drops it) or timed out (shm: no
  // completion); either way the peer is marked unreachable, and a new request connects again,
  // as the prefill worker does (WorkerCore::peer_for).
  void reconnect() {
    EXPECT_FALSE(initiator_->reachable(peer_)) << "a refused write left the peer reachable";
    // A rail that the watchdog declared stuck (a stalled host) is replaced and refuses this
    // connect as Unavailable; the worker's next request connects again, and so does this.
    Result<uint64_t> peer = Unavailable("not tried");
    for (int attempt = 0; attempt < 3 && peer.status().code() == StatusCode::kUnavailable;
         ++attempt) {
      const auto t0 = std::chrono::steady_clock::now();
      peer = initiator_->connect(target_->address());
      note(fmt::format("connect: {}", peer.ok() ? std::string("ok") : peer.status().to_string()),
           t0);
    }
    ASSERT_TRUE(peer.ok()) << peer.status().to_string();
    peer_ = *peer;
    EXPECT_TRUE(initiator_->reachable(peer_));
  }

  bool dst_is(char fill) const {
    for (char c : dst_) {
      if (c != fill) return false;
    }
    return true;
  }

  std::unique_ptr<TransferEngine> target_;
  std::unique_ptr<TransferEngine> initiator_;
  uint64_t peer_ = 0;
  uint64_t src_region_ = 0;
  std::vector<char> src_ = std::vector<char>(kBytes);
  std::vector<char> dst_ = std::vector<char>(kBytes, 0);
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::string steps_;
};

TEST_P(RevokedKeyTest, WriteWithARevokedKeyFailsAndLeavesTheTargetUnchanged) {
  auto first = target_->register_memory(dst_.data(), dst_.size(), MemoryKind::host());
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  Status s = write('a', first->remote);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_TRUE(dst_is('a'));
  EXPECT_TRUE(initiator_->reachable(peer_));

  ASSERT_TRUE(target_->deregister(first->id).ok());
  s = write('b', first->remote);
  EXPECT_FALSE(s.ok()) << "a write with a revoked key completed";
  EXPECT_TRUE(dst_is('a')) << "a write with a revoked key changed the target's memory";
  reconnect();

  // The same memory registered again: its new key works.
  auto second = target_->register_memory(dst_.data(), dst_.size(), MemoryKind::host());
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  EXPECT_NE(second->remote.keys, first->remote.keys);
  s = write('c', second->remote);
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_TRUE(dst_is('c'));
  // The revoked descriptor stays revoked after the new registration.
  s = write('d', first->remote);
  EXPECT_FALSE(s.ok()) << "a write with a revoked key completed";
  EXPECT_TRUE(dst_is('c')) << "a write with a revoked key changed the target's memory";
  // And the connection still serves the live registration.
  reconnect();
  s = write('e', second->remote);
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_TRUE(dst_is('e'));
}

INSTANTIATE_TEST_SUITE_P(Providers, RevokedKeyTest,
                         ::testing::Values(std::string("tcp;ofi_rxm"), std::string("shm")),
                         [](const auto& info) {
                           return info.param == "shm" ? std::string("shm") : std::string("tcp");
                         });

}  // namespace
}  // namespace cleave::transfer
