// Not named *_test.cpp: tests/CMakeLists.txt globs those under integration/ with other libs;
// tests/transfer.cmake registers this one.
// Two real processes on 127.0.0.1: this test (initiator) writes into a transfer_test_peer
// (target) over tcp;ofi_rxm and shm, and the target checks every byte when the notice arrives.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <numeric>
#include <random>
#include <thread>

#include "cleave/transfer/transfer_engine.h"
#include "fmt/format.h"
#include "peer_process.h"

namespace cleave::transfer {
namespace {

using testing::checksum;
using testing::PeerProcess;
using namespace std::chrono_literals;

struct Target {
  std::unique_ptr<PeerProcess> proc;
  uint64_t peer = 0;
  RemoteDescriptor desc;
};

class TwoProcessTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    TransferSettings s;
    s.provider = GetParam();
    s.node = "127.0.0.1";
    s.rails = 2;
    s.completion_timeout_ms = 1500;
    auto e = TransferEngine::create(s, true);
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    engine_ = std::move(e).value();
  }

  Target start_target(uint64_t region_bytes, uint64_t parts, int rails = 2,
                      const std::string& region_file = "") {
    Target t;
    std::vector<std::string> argv{TRANSFER_TEST_PEER, GetParam(), std::to_string(rails),
                                  std::to_string(region_bytes), std::to_string(parts)};
    if (!region_file.empty()) argv.push_back(region_file);
    t.proc = std::make_unique<PeerProcess>(argv);
    EXPECT_TRUE(t.proc->started());
    auto addr = t.proc->wait_line("ADDR", 10s);
    auto desc = t.proc->wait_line("DESC", 10s);
    if (!addr || !desc) {
      ADD_FAILURE() << "the target process did not print its address";
      return t;
    }
    auto peer = engine_->connect(testing::from_hex(*addr));
    EXPECT_TRUE(peer.ok()) << peer.status().to_string();
    if (peer.ok()) t.peer = *peer;
    auto d = RemoteDescriptor::decode(testing::from_hex(*desc));
    EXPECT_TRUE(d.ok()) << d.status().to_string();
    if (d.ok()) t.desc = *d;
    return t;
  }

  // Waits for the target's report of `tag` and returns its hash.
  static std::optional<uint64_t> reported_hash(Target& t, uint64_t tag) {
    auto line = t.proc->wait_line("NOTICE " + std::to_string(tag), 20s);
    if (!line) return std::nullopt;
    return std::stoull(*line);
  }

  std::unique_ptr<TransferEngine> engine_;
};

TEST_P(TwoProcessTest, SizesFromOneByteTo64MiBArriveIntact) {
  const uint64_t region = (64ull << 20) + 64;
  Target t = start_target(region, 1);
  ASSERT_NE(t.peer, 0u);
  std::vector<char> src(region), mirror(region, 0);
  std::mt19937_64 rng(42);
  for (auto& c : src) c = static_cast<char>(rng());
  auto mr = engine_->register_memory(src.data(), src.size(), MemoryKind::host());
  ASSERT_TRUE(mr.ok()) << mr.status().to_string();
  const std::vector<std::pair<uint64_t, uint64_t>> cases = {  // {len, offset}
      {1, 0}, {7, 13}, {4096, 4096}, {65539, 1}, {(1 << 20) + 1, 3}, {8 << 20, 0}, {64ull << 20, 64}};
  uint64_t tag = 0;
  for (auto [len, off] : cases) {
    SCOPED_TRACE(::testing::Message() << "len " << len << " offset " << off);
    const uint64_t src_off = (len * 7 + 5) % (region - len + 1);
    Batch b{t.peer, {{mr->id, src_off, t.desc, off, len}}, ++tag};
    std::memcpy(mirror.data() + off, src.data() + src_off, len);
    auto h = engine_->submit(b);
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    ASSERT_TRUE(h->wait(30s).ok()) << h->wait(0ms).to_string();
    auto got = reported_hash(t, tag);
    ASSERT_TRUE(got.has_value()) << "no report for notice " << tag;
    EXPECT_EQ(*got, checksum(mirror.data(), region)) << "target data differs after the notice";
  }
  auto m = engine_->metrics();
  EXPECT_EQ(m.provider, engine_->provider());
  uint64_t total = std::accumulate(m.rail_bytes.begin(), m.rail_bytes.end(), 0ull);
  uint64_t expected = 0;
  for (auto [len, off] : cases) expected += len;
  EXPECT_EQ(total, expected);
  EXPECT_GT(m.rail_writes[1], 0u) << "slices were not spread over the second rail";
  EXPECT_EQ(m.notices_sent, cases.size());
}

// A handle completes only once its data is in the target's memory (FI_DELIVERY_COMPLETE, the
// engine's default): the target's region is a file both processes map, so the test reads the
// target's bytes the moment wait() returns, with no notice in between.
TEST_P(TwoProcessTest, ACompletedWriteIsAlreadyInTheTargetsMemory) {
  const uint64_t region = 8ull << 20;
  char path[] = "/tmp/cleave_region_XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(region)), 0);
  void* p = mmap(nullptr, region, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  ASSERT_NE(p, MAP_FAILED);
  const auto* target_mem = static_cast<const volatile unsigned char*>(p);
  Target t = start_target(region, 1, 2, path);
  unlink(path);  // both processes have it mapped by now
  ASSERT_NE(t.peer, 0u);
  std::vector<unsigned char> src(region);
  auto mr = engine_->register_memory(src.data(), src.size(), MemoryKind::host());
  ASSERT_TRUE(mr.ok()) << mr.status().to_string();
  int round = 0;
  for (uint64_t len : {uint64_t{4096}, uint64_t{65536}, uint64_t{1} << 20, region}) {
    for (int i = 0; i < 10; ++i, ++round) {
      const auto pattern = static_cast<unsigned char>(1 + round % 255);
      std::memset(src.data(), pattern, len);
      auto h = engine_->submit(Batch{t.peer, {{mr->id, 0, t.desc, 0, len}}, std::nullopt});
      ASSERT_TRUE(h.ok()) << h.status().to_string();
      ASSERT_TRUE(h->wait(30s).ok()) << h->wait(0ms).to_string();
      uint64_t missing = 0;
      for (uint64_t k = 0; k < len; ++k) missing += target_mem[k] != pattern;
      ASSERT_EQ(missing, 0u) << len << "-byte write " << i << ": the handle completed before "
                             << missing << " of its bytes were in the target's memory";
    }
  }
  munmap(p, region);
}

TEST_P(TwoProcessTest, ThousandsOfScatteredBlocksInOneBatch) {
  const uint64_t block = 4096, blocks = 4096, region = block * blocks;
  Target t = start_target(region, 1);
  ASSERT_NE(t.peer, 0u);
  std::vector<char> src(region), mirror(region, 0);
  std::mt19937_64 rng(7);
  for (auto& c : src) c = static_cast<char>(rng());
  auto mr = engine_->register_memory(src.data(), src.size(), MemoryKind::host());
  ASSERT_TRUE(mr.ok());
  // Destinations are pairs of blocks in shuffled order; every odd pair also gets its second
  // block from the next local block, adjacent on both sides (the coalescing path). No two
  // writes overlap, so their order does not matter.
  std::vector<uint64_t> pairs(blocks / 2);
  std::iota(pairs.begin(), pairs.end(), 0);
  std::shuffle(pairs.begin(), pairs.end(), rng);
  Batch b{t.peer, {}, 99};
  auto add = [&](uint64_t from, uint64_t dst) {
    b.writes.push_back({mr->id, from * block, t.desc, dst * block, block});
    std::memcpy(mirror.data() + dst * block, src.data() + from * block, block);
  };
  for (uint64_t k = 0; k < pairs.size(); ++k) {
    add(2 * k, 2 * pairs[k]);
    if (k % 2 == 1) add(2 * k + 1, 2 * pairs[k] + 1);
  }
  ASSERT_GT(b.writes.size(), 3000u);
  auto h = engine_->submit(b);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_TRUE(h->wait(30s).ok());
  auto got = reported_hash(t, 99);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(*got, checksum(mirror.data(), region));
}

TEST_P(TwoProcessTest, SeveralThreadsSubmitAtOnce) {
  const int threads = 4;
  const uint64_t part = 4 << 20, region = part * threads;
  Target t = start_target(region, threads);
  ASSERT_NE(t.peer, 0u);
  std::atomic<int> failures{0};
  std::vector<std::thread> pool;
  for (int th = 0; th < threads; ++th) {
    pool.emplace_back([&, th] {
      std::vector<char> src(part), mirror(part, 0);
      std::mt19937_64 rng(100 + th);
      for (auto& c : src) c = static_cast<char>(rng());
      auto mr = engine_->register_memory(src.data(), src.size(), MemoryKind::host());
      if (!mr.ok()) { ++failures; return; }
      for (uint64_t seq = 1; seq <= 5; ++seq) {
        uint64_t tag = (static_cast<uint64_t>(th) << 32) | seq;
        Batch b{t.peer, {}, tag};
        // 200 writes into disjoint slots of this thread's part, in random order and lengths.
        const uint64_t slot = part / 200;
        std::vector<uint64_t> order(200);
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng);
        for (int i = 0; i < 200; ++i) {
          uint64_t len = 1 + rng() % slot;
          uint64_t dst = order[i] * slot + rng() % (slot - len + 1), from = rng() % (part - len);
          b.writes.push_back({mr->id, from, t.desc, th * part + dst, len});
          std::memcpy(mirror.data() + dst, src.data() + from, len);
        }
        auto h = engine_->submit(b);
        if (!h.ok() || !h->wait(30s).ok()) {
          ADD_FAILURE() << "thread " << th << " batch " << seq << ": "
                        << (h.ok() ? h->wait(0ms).to_string() : h.status().to_string());
          ++failures;
          return;
        }
        auto got = reported_hash(t, tag);
        if (!got || *got != checksum(mirror.data(), part)) {
          ADD_FAILURE() << "thread " << th << " batch " << seq << ": target data differs";
          ++failures;
          return;
        }
      }
    });
  }
  for (auto& p : pool) p.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST_P(TwoProcessTest, KilledPeerFailsWithinTheBoundAndOthersStillWork) {
  const uint64_t region = 32 << 20;
  Target a = start_target(region, 1);
  Target b = start_target(1 << 20, 1);
  ASSERT_NE(a.peer, 0u);
  ASSERT_NE(b.peer, 0u);
  std::vector<char> src(region, 'x');
  auto mr = engine_->register_memory(src.data(), src.size(), MemoryKind::host());
  ASSERT_TRUE(mr.ok());
  Batch big{a.peer, {}, 1};
  for (int i = 0; i < 64; ++i) big.writes.push_back({mr->id, 0, a.desc, 0, region});  // 2 GiB
  auto h = engine_->submit(big);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  std::this_thread::sleep_for(5ms);
  if (auto early = h->poll()) {
    FAIL() << "the batch finished before the peer could be killed: " << early->to_string();
  }
  a.proc->kill_now();
  auto killed_at = std::chrono::steady_clock::now();
  Status st = h->wait(20s);
  auto elapsed = std::chrono::steady_clock::now() - killed_at;
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.message().find("still in flight"), std::string::npos)
      << "wait() itself timed out: " << st.to_string();
  EXPECT_LT(elapsed, 1500ms + 2s) << "error took too long: " << st.to_string();
  std::cerr << "killed peer -> " << st.to_string() << " after "
            << std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count() << " ms\n";

  // The other peer still works.
  std::vector<char> mirror(1 << 20, 0);
  std::memset(mirror.data() + 100, 'x', 5000);
  auto h2 = engine_->submit(Batch{b.peer, {{mr->id, 0, b.desc, 100, 5000}}, 5});
  ASSERT_TRUE(h2.ok()) << h2.status().to_string();
  Status st2 = h2->wait(10s);
  EXPECT_EQ(st2.message().find("still in flight"), std::string::npos) << "hang: " << st2.to_string();
  ASSERT_TRUE(st2.ok()) << st2.to_string();
  auto got = reported_hash(b, 5);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(*got, checksum(mirror.data(), mirror.size()));
  auto m = engine_->metrics();
  if (GetParam() == "shm") {
    // libfabric 1.17's shm never completes writes to a dead peer (and may leave a rail thread
    // spinning on the dead peer's lock): the engine reopens or replaces the rails that had
    // writes to it in flight, and the live peer keeps working meanwhile and on the new
    // endpoints. The killed batch itself may fail before that (its unposted slices are refused
    // at once), so the reopen is waited for, within the completion bound and a margin.
    const auto until = std::chrono::steady_clock::now() + 1500ms + 3s;
    auto reopens = [&] {
      m = engine_->metrics();
      return std::accumulate(m.rail_reopens.begin(), m.rail_reopens.end(), 0ull);
    };
    while (reopens() == 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_GT(reopens(), 0u);
  }
  // Many more writes than the TX depth to the live peer: credits of the abandoned writes did
  // not leak.
  Batch many{b.peer, {}, 6};
  for (int i = 0; i < 3000; ++i) many.writes.push_back({mr->id, 0, b.desc, static_cast<uint64_t>(100 + (i % 2) * 8), 8});
  auto h4 = engine_->submit(many);
  ASSERT_TRUE(h4.ok()) << h4.status().to_string();
  ASSERT_TRUE(h4->wait(10s).ok()) << h4->wait(0ms).to_string();
  ASSERT_TRUE(reported_hash(b, 6).has_value());
  EXPECT_GT(m.errors[static_cast<size_t>(TransferErrorKind::kTimeout)] +
                m.errors[static_cast<size_t>(TransferErrorKind::kCompletionError)] +
                m.errors[static_cast<size_t>(TransferErrorKind::kPeerUnavailable)] +
                m.errors[static_cast<size_t>(TransferErrorKind::kPostError)],
            0u);
  // Later submits to the dead peer fail fast.
  auto h3 = engine_->submit(Batch{a.peer, {{mr->id, 0, a.desc, 0, 10}}, std::nullopt});
  EXPECT_TRUE(!h3.ok() || !h3->wait(5s).ok());
}

// Batch::post_by: slices still queued when it passes are not posted, the batch fails as past
// its deadline and its notice is not sent; a batch whose deadline has passed is refused.
TEST_P(TwoProcessTest, NothingOfABatchIsPostedAfterItsDeadline) {
  const uint64_t region = 32 << 20;
  Target t = start_target(region, 1);
  ASSERT_NE(t.peer, 0u);
  std::vector<char> src(region, 'z');
  auto mr = engine_->register_memory(src.data(), src.size(), MemoryKind::host());
  ASSERT_TRUE(mr.ok());
  auto late = engine_->submit(Batch{t.peer, {{mr->id, 0, t.desc, 0, 16}}, 1,
                                    std::chrono::steady_clock::now()});
  EXPECT_EQ(late.status().code(), StatusCode::kDeadlineExceeded) << late.status().to_string();
  auto late_notice = engine_->notify(t.peer, 2, 0, std::chrono::steady_clock::now());
  EXPECT_EQ(late_notice.status().code(), StatusCode::kDeadlineExceeded);

  // 400000 writes of 4 KiB that do not coalesce: far more than the TX depths, and more than
  // both providers move in the window before the deadline. The window starts at 200 ms and
  // doubles only while nothing at all was posted in it: on a loaded 2-core host, submitting and
  // slicing the batch and the first post have taken more than 200 ms (2026-12-03, 2026-12-04),
  // and the point here is that a deadline stops a batch midway, whatever the host's speed.
  const uint64_t slots = region / 8192, writes = 400000;
  uint64_t written = 0, tag = 3;
  TransferMetricsSnapshot after;
  for (auto window = 200ms; written == 0 && window <= 3200ms; window *= 2, ++tag) {
    Batch big{t.peer, {}, tag};
    for (uint64_t i = 0; i < writes; ++i) {
      big.writes.push_back({mr->id, (i % slots) * 8192, t.desc, ((i * 7) % slots) * 8192, 4096});
    }
    const auto before = engine_->metrics();
    const uint64_t base = std::accumulate(before.rail_bytes.begin(), before.rail_bytes.end(), 0ull);
    big.post_by = std::chrono::steady_clock::now() + window;
    auto h = engine_->submit(big);
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    Status st = h->wait(30s);
    EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.to_string();
    EXPECT_NE(st.message().find("not posted: the transfer's deadline passed"), std::string::npos)
        << st.message();
    // What was posted before the deadline completes; then nothing more moves.
    after = engine_->metrics();
    for (int i = 0; i < 100; ++i) {
      std::this_thread::sleep_for(300ms);
      auto now = engine_->metrics();
      if (now.rail_bytes == after.rail_bytes) break;
      after = now;
    }
    written = std::accumulate(after.rail_bytes.begin(), after.rail_bytes.end(), 0ull) - base;
    EXPECT_LT(written, writes * 4096) << "every slice was posted";
    EXPECT_FALSE(t.proc->wait_line(fmt::format("NOTICE {}", tag), 300ms).has_value())
        << "the notice went out";
  }
  EXPECT_GT(written, 0u) << "nothing was posted before the deadline, even in 3.2 s";
  std::printf("%llu of %llu bytes were posted before the deadline\n",
              static_cast<unsigned long long>(written), static_cast<unsigned long long>(writes * 4096));
  EXPECT_GE(after.errors[static_cast<size_t>(TransferErrorKind::kPastDeadline)], 1u);
  // The peer still takes batches without a deadline.
  auto ok = engine_->submit(Batch{t.peer, {{mr->id, 0, t.desc, 0, 4096}}, 100});
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_TRUE(ok->wait(10s).ok());
  EXPECT_TRUE(t.proc->wait_line("NOTICE 100", 10s).has_value());
}

TEST_P(TwoProcessTest, BadDescriptorsAreRefusedBeforePosting) {
  Target a = start_target(1 << 20, 1);
  Target b = start_target(1 << 20, 1);
  ASSERT_NE(a.peer, 0u);
  std::vector<char> src(1 << 20, 'y');
  auto mr = engine_->register_memory(src.data(), src.size(), MemoryKind::host());
  ASSERT_TRUE(mr.ok());
  auto before = engine_->metrics();
  auto out_of_range = engine_->submit(Batch{a.peer, {{mr->id, 0, a.desc, (1 << 20) - 10, 11}}, 1});
  EXPECT_EQ(out_of_range.status().code(), StatusCode::kOutOfRange);
  auto overflow = engine_->submit(Batch{a.peer, {{mr->id, 0, a.desc, ~0ull - 4, 10}}, 1});
  EXPECT_EQ(overflow.status().code(), StatusCode::kOutOfRange);
  auto local_range = engine_->submit(Batch{a.peer, {{mr->id, (1 << 20) - 1, a.desc, 0, 2}}, 1});
  EXPECT_EQ(local_range.status().code(), StatusCode::kOutOfRange);
  auto unknown = engine_->submit(Batch{a.peer, {{12345, 0, a.desc, 0, 2}}, 1});
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  // b's descriptor sent to a: a foreign key. A good write first proves nothing partial is sent.
  auto foreign = engine_->submit(
      Batch{a.peer, {{mr->id, 0, a.desc, 0, 16}, {mr->id, 0, b.desc, 0, 16}}, 1});
  EXPECT_EQ(foreign.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(foreign.status().message().find("foreign key"), std::string::npos)
      << foreign.status().message();
  auto after = engine_->metrics();
  EXPECT_EQ(after.rail_writes, before.rail_writes) << "a refused batch posted writes";
  EXPECT_EQ(after.errors[static_cast<size_t>(TransferErrorKind::kInvalidDescriptor)] -
                before.errors[static_cast<size_t>(TransferErrorKind::kInvalidDescriptor)],
            5u);
}

INSTANTIATE_TEST_SUITE_P(Providers, TwoProcessTest, ::testing::Values("tcp;ofi_rxm", "shm"),
                         [](const auto& info) {
                           return info.param == "shm" ? std::string("shm") : std::string("tcp_rxm");
                         });

}  // namespace
}  // namespace cleave::transfer
