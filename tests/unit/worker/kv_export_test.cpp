// The KV handoff's sending side (the pairing check is tested with KvLayout): the write plan (exact offsets, coalescing) and KvSender over
// real transfer engines (two in this process, tcp;ofi_rxm and shm on 127.0.0.1).
#include "cleave/worker/kv_export.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <future>
#include <numeric>
#include <random>
#include <thread>

#include "cleave/kvcache/kv_block_pool.h"

extern char** environ;

namespace cleave {
namespace {

using namespace std::chrono_literals;
using transfer::WriteOp;
using Clock = std::chrono::steady_clock;

KvLayout layout(int64_t num_blocks, int64_t block_size, int64_t n_layers = 4, int64_t n_kv_heads = 2,
                int64_t head_dim = 8) {
  KvLayout l;
  l.block_size = block_size;
  l.n_layers = n_layers;
  l.n_kv_heads = n_kv_heads;
  l.head_dim = head_dim;
  l.num_blocks = num_blocks;
  return l;
}

transfer::RemoteDescriptor fake_remote(uint64_t len) {
  transfer::RemoteDescriptor d;
  d.engine_id = 77;
  d.region_id = 5;
  d.len = len;
  d.keys = {1};
  return d;
}

// ---- write plan ----
// Layout of these tests: block_size 4, kv_dim 6 (f32): a row is 24 bytes, a (layer, block) unit
// 2 * 4 * 24 = 192 bytes (K rows at +0, V rows at +96). Local 10 blocks, remote 20.

class PlanTest : public ::testing::Test {
 protected:
  KvLayout local_ = layout(10, 4, 3, 2, 3);
  KvLayout remote_ = layout(20, 4, 3, 2, 3);
  transfer::RemoteDescriptor rd_ = fake_remote(remote_.total_bytes());

  std::vector<WriteOp> plan(std::vector<BlockId> lb, std::vector<BlockId> rb, int64_t layer,
                            int64_t begin, int64_t end) {
    std::vector<WriteOp> out;
    plan_kv_writes(local_, 9, lb, remote_, rd_, rb, layer, begin, end, out);
    return out;
  }
  static void expect_write(const WriteOp& w, uint64_t lo, uint64_t ro, uint64_t len) {
    EXPECT_EQ(w.local_region, 9u);
    EXPECT_EQ(w.local_offset, lo);
    EXPECT_EQ(w.remote_offset, ro);
    EXPECT_EQ(w.len, len);
    EXPECT_EQ(w.remote.engine_id, 77u);
  }
};

TEST_F(PlanTest, WholeBlocksFromZeroAreOneWriteEachAndCoalesce) {
  ASSERT_EQ(local_.block_bytes(), 192u);
  auto w = plan({3, 4, 5}, {7, 8, 9}, 1, 0, 12);
  ASSERT_EQ(w.size(), 3u);
  // Local (layer 1, block b) at (10 + b) * 192; remote (1, b) at (20 + b) * 192.
  expect_write(w[0], 13 * 192, 27 * 192, 192);
  expect_write(w[1], 14 * 192, 28 * 192, 192);
  expect_write(w[2], 15 * 192, 29 * 192, 192);
  auto slices = transfer::plan_slices(w, 1 << 20);
  ASSERT_EQ(slices.size(), 1u);
  EXPECT_EQ(slices[0].local_offset, 13u * 192);
  EXPECT_EQ(slices[0].remote_offset, 27u * 192);
  EXPECT_EQ(slices[0].len, 3u * 192);
}

TEST_F(PlanTest, ManyBlocksWithScatteredIdsCoalesceByRuns) {
  std::vector<BlockId> lb = {0, 1, 2, 3, 4, 5, 6, 7}, rb = {10, 11, 12, 2, 3, 15, 16, 17};
  auto w = plan(lb, rb, 2, 0, 32);
  ASSERT_EQ(w.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    expect_write(w[i], (20 + lb[i]) * 192u, (40 + rb[i]) * 192u, 192);
  }
  auto slices = transfer::plan_slices(w, 1 << 20);
  ASSERT_EQ(slices.size(), 3u);  // {10,11,12}, {2,3}, {15,16,17}
  EXPECT_EQ(slices[0].len, 3u * 192);
  EXPECT_EQ(slices[1].remote_offset, (40 + 2) * 192u);
  EXPECT_EQ(slices[1].len, 2u * 192);
  EXPECT_EQ(slices[2].len, 3u * 192);
}

TEST_F(PlanTest, CutBlocksBecomeKAndVRowWrites) {
  // [2, 10): block 0 positions 2-3, block 1 whole, block 2 positions 8-9.
  auto w = plan({3, 4, 5}, {7, 8, 9}, 0, 2, 10);
  ASSERT_EQ(w.size(), 5u);
  expect_write(w[0], 3 * 192 + 48, 7 * 192 + 48, 48);            // K rows 2, 3
  expect_write(w[1], 3 * 192 + 96 + 48, 7 * 192 + 96 + 48, 48);  // V rows 2, 3
  expect_write(w[2], 4 * 192, 8 * 192, 192);                      // whole block
  expect_write(w[3], 5 * 192, 9 * 192, 48);                       // K rows 0, 1
  expect_write(w[4], 5 * 192 + 96, 9 * 192 + 96, 48);             // V rows 0, 1
  // The V rows that end block 0, block 1 and the K rows that start block 2 are adjacent.
  auto slices = transfer::plan_slices(w, 1 << 20);
  ASSERT_EQ(slices.size(), 3u);
  EXPECT_EQ(slices[1].local_offset, 3u * 192 + 96 + 48);
  EXPECT_EQ(slices[1].len, 48u + 192 + 48);
}

TEST_F(PlanTest, RangeInsideOneBlockAndEmptyRange) {
  auto w = plan({6}, {19}, 2, 1, 3);
  ASSERT_EQ(w.size(), 2u);
  expect_write(w[0], (20 + 6) * 192 + 24, (40 + 19) * 192 + 24, 48);
  expect_write(w[1], (20 + 6) * 192 + 96 + 24, (40 + 19) * 192 + 96 + 24, 48);
  // A range in the second block uses that block's ids only.
  auto w2 = plan({6, 1}, {19, 0}, 0, 5, 6);
  ASSERT_EQ(w2.size(), 2u);
  expect_write(w2[0], 1 * 192 + 24, 0 * 192 + 24, 24);
  expect_write(w2[1], 1 * 192 + 96 + 24, 0 * 192 + 96 + 24, 24);
  // Empty: nothing appended to what `out` already holds.
  std::vector<WriteOp> out(2);
  plan_kv_writes(local_, 9, std::vector<BlockId>{6}, remote_, rd_, std::vector<BlockId>{19}, 0, 3, 3, out);
  EXPECT_EQ(out.size(), 2u);
}

TEST_F(PlanTest, F16RowsAreHalfAsLong) {
  // engine.kv_dtype f16: a row is 12 bytes, a unit 96 (K rows at +0, V rows at +48).
  local_.dtype = remote_.dtype = DType::kF16;
  ASSERT_EQ(local_.block_bytes(), 96u);
  auto w = plan({3, 4}, {7, 8}, 1, 2, 8);
  ASSERT_EQ(w.size(), 3u);
  expect_write(w[0], (10 + 3) * 96 + 24, (20 + 7) * 96 + 24, 24);            // K rows 2, 3
  expect_write(w[1], (10 + 3) * 96 + 48 + 24, (20 + 7) * 96 + 48 + 24, 24);  // V rows 2, 3
  expect_write(w[2], (10 + 4) * 96, (20 + 8) * 96, 96);                      // whole block
}

TEST_F(PlanTest, AnyChunkingCoversEveryByteOfThePositionsExactlyOnce) {
  std::mt19937 rng(3);
  const int64_t n = 37;  // 10 blocks, the last one partial
  std::vector<BlockId> lb(10), rb(10);
  std::iota(lb.begin(), lb.end(), 0);
  std::iota(rb.begin(), rb.end(), 0);
  std::shuffle(rb.begin(), rb.end(), rng);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int> local_hits(local_.total_bytes()), remote_hits(remote_.total_bytes());
    int64_t at = 0;
    while (at < n) {
      int64_t end = std::min<int64_t>(n, at + 1 + static_cast<int64_t>(rng() % 9));
      for (const WriteOp& w : plan(lb, rb, 1, at, end)) {
        for (uint64_t i = 0; i < w.len; ++i) {
          ++local_hits[w.local_offset + i];
          ++remote_hits[w.remote_offset + i];
        }
        // Local and remote byte ranges map position to position.
        EXPECT_EQ((w.local_offset % 192), (w.remote_offset % 192));
      }
      at = end;
    }
    for (int64_t p = 0; p < 40; ++p) {
      for (int kv = 0; kv < 2; ++kv) {
        const uint64_t lrow = local_.offset(1, lb[p / 4]) + kv * 96 + (p % 4) * 24;
        const uint64_t rrow = remote_.offset(1, rb[p / 4]) + kv * 96 + (p % 4) * 24;
        const int want = p < n ? 1 : 0;
        for (uint64_t i = 0; i < 24; ++i) {
          ASSERT_EQ(local_hits[lrow + i], want) << "position " << p << " kv " << kv;
          ASSERT_EQ(remote_hits[rrow + i], want) << "position " << p << " kv " << kv;
        }
        for (uint64_t i = 0; i < 24; ++i) local_hits[lrow + i] = remote_hits[rrow + i] = 0;
      }
    }
    EXPECT_EQ(std::accumulate(local_hits.begin(), local_hits.end(), 0), 0) << "bytes outside";
    EXPECT_EQ(std::accumulate(remote_hits.begin(), remote_hits.end(), 0), 0) << "bytes outside";
  }
}

// ---- a decode side in another process ----
// This test binary re-executed with kPeerEnv=<provider> is a decode worker's transfer side: it
// registers a pool of kPeerBlocks blocks, prints "ADDR <hex>" and "DESC <hex>" and waits to be
// killed (or for its parent to die).

constexpr const char* kPeerEnv = "CLEAVE_KV_EXPORT_TEST_PEER";
constexpr int64_t kPeerBlocks = 40;

std::string to_hex(std::string_view b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (unsigned char c : b) {
    s.push_back(d[c >> 4]);
    s.push_back(d[c & 15]);
  }
  return s;
}

std::string from_hex(std::string_view h) {
  auto v = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  std::string s;
  for (size_t i = 0; i + 1 < h.size(); i += 2) s.push_back(static_cast<char>(v(h[i]) * 16 + v(h[i + 1])));
  return s;
}

// Runs before any test when the binary is the peer; never returns then.
class PeerRole : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* provider = std::getenv(kPeerEnv);
    if (!provider) return;
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    transfer::TransferSettings t;
    t.provider = provider;
    t.node = "127.0.0.1";
    t.rails = 2;
    auto e = transfer::TransferEngine::create(t, true);
    if (!e.ok()) {
      std::fprintf(stderr, "peer: %s\n", e.status().to_string().c_str());
      _exit(1);
    }
    KvLayout l;
    l.block_size = 16;
    l.n_layers = 4;
    l.n_kv_heads = 2;
    l.head_dim = 8;
    l.num_blocks = kPeerBlocks;
    auto pool = KvBlockPool::create(l);
    if (!pool.ok()) _exit(1);
    auto mr = (*e)->register_memory((*pool)->data(), (*pool)->size_bytes(), transfer::MemoryKind::host());
    if (!mr.ok()) _exit(1);
    std::printf("ADDR %s\nDESC %s\n", to_hex((*e)->address()).c_str(), to_hex(mr->remote.encode()).c_str());
    std::fflush(stdout);
    for (;;) pause();
  }
};
[[maybe_unused]] ::testing::Environment* const peer_role =
    ::testing::AddGlobalTestEnvironment(new PeerRole);

struct PeerProcess {
  pid_t pid = -1;
  std::string address;
  transfer::RemoteDescriptor region;

  // SIGKILL, reaped; the shm provider's files of the dead process ("/dev/shm/<pid>:...") are
  // removed, since a later process reusing the pid could not open its endpoint otherwise.
  void kill_now() {
    if (pid <= 0) return;
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    std::error_code ec;
    const std::string prefix = std::to_string(pid) + ":";
    for (const auto& f : std::filesystem::directory_iterator("/dev/shm", ec)) {
      if (f.path().filename().string().rfind(prefix, 0) == 0) std::filesystem::remove(f.path(), ec);
    }
    pid = -1;
  }
  ~PeerProcess() { kill_now(); }
};

// One attempt: starts the peer and reads its two lines (10 s at most). On failure the child is
// gone and `why` says what it printed.
bool try_start_peer(const std::string& provider, PeerProcess& p, std::string& why) {
  int out[2];
  if (pipe(out) != 0) {
    why = "pipe failed";
    return false;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  posix_spawn_file_actions_addclose(&fa, out[0]);
  std::vector<std::string> env_store = {std::string(kPeerEnv) + "=" + provider};
  for (char** e = environ; *e; ++e) {
    if (std::strncmp(*e, kPeerEnv, std::strlen(kPeerEnv)) != 0) env_store.emplace_back(*e);
  }
  std::vector<char*> env;
  for (auto& e : env_store) env.push_back(e.data());
  env.push_back(nullptr);
  std::string self = "/proc/self/exe";
  char* argv[] = {self.data(), nullptr};
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, argv, env.data());
  posix_spawn_file_actions_destroy(&fa);
  close(out[1]);
  if (rc != 0) {
    close(out[0]);
    why = std::string("posix_spawn: ") + std::strerror(rc);
    return false;
  }
  p.pid = pid;
  std::string text;
  const auto deadline = Clock::now() + 10s;
  auto complete = [&] {
    const size_t d = text.find("DESC ");
    return text.find("ADDR ") != std::string::npos && d != std::string::npos &&
           text.find('\n', d) != std::string::npos;
  };
  while (!complete() && Clock::now() < deadline) {
    pollfd pfd{out[0], POLLIN, 0};
    if (poll(&pfd, 1, 100) <= 0) continue;
    char buf[4096];
    const ssize_t n = read(out[0], buf, sizeof(buf));
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  close(out[0]);
  if (!complete()) {
    p.kill_now();
    why = "the peer printed: " + text;
    return false;
  }
  const size_t a = text.find("ADDR "), d = text.find("DESC ");
  p.address = from_hex(text.substr(a + 5, text.find('\n', a) - a - 5));
  auto desc = transfer::RemoteDescriptor::decode(from_hex(text.substr(d + 5, text.find('\n', d) - d - 5)));
  if (!desc.ok()) {
    p.kill_now();
    why = desc.status().to_string();
    return false;
  }
  p.region = *desc;
  return true;
}

// The peer, in up to three attempts: stale shm files of killed processes (of any test on this
// machine) make an endpoint open fail with EBUSY when a new process gets a recycled pid.
void start_peer(const std::string& provider, PeerProcess& p) {
  std::string why;
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (try_start_peer(provider, p, why)) return;
  }
  FAIL() << "the peer process did not start: " << why;
}

// ---- KvSender over real engines ----

struct Side {
  std::unique_ptr<transfer::TransferEngine> engine;
  std::unique_ptr<KvBlockPool> pool;
  transfer::MemoryRegion region;
};

class KvSenderTest : public ::testing::TestWithParam<std::string> {
 protected:
  static constexpr int64_t kBlock = 16;
  static constexpr int64_t kPrompt = 100;
  static constexpr uint64_t kTag = 0xC1EA5E0001ull;
  static constexpr const char* kFingerprint = "stories-f32-abcdef";

  Side make_side(int64_t num_blocks, int64_t timeout_ms = 5000) {
    Side s;
    transfer::TransferSettings t;
    t.provider = GetParam();
    t.node = "127.0.0.1";
    t.rails = 2;
    t.completion_timeout_ms = timeout_ms;
    auto e = transfer::TransferEngine::create(t, true);
    EXPECT_TRUE(e.ok()) << e.status().to_string();
    if (!e.ok()) return s;
    s.engine = std::move(e).value();
    auto p = KvBlockPool::create(layout(num_blocks, kBlock));
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    if (!p.ok()) return s;
    s.pool = std::move(p).value();
    auto r = s.engine->register_memory(s.pool->data(), s.pool->size_bytes(),
                                       transfer::MemoryKind::host());
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (r.ok()) s.region = *r;
    return s;
  }

  static KvDestination destination(const Side& d, std::vector<BlockId> blocks) {
    KvDestination dest;
    dest.request_id = 42;
    dest.worker_id = "decode-0";
    dest.transfer_address = d.engine->address();
    dest.region = d.region.remote;
    dest.layout = d.pool->layout();
    dest.model_fingerprint = kFingerprint;
    dest.blocks = std::move(blocks);
    dest.notice_tag = kTag;
    dest.lease = 5000ms;
    return dest;
  }

  static KvDestination remote_destination(const PeerProcess& p, std::vector<BlockId> blocks) {
    KvDestination dest;
    dest.request_id = 43;
    dest.worker_id = "decode-killed";
    dest.transfer_address = p.address;
    dest.region = p.region;
    dest.layout = layout(kPeerBlocks, kBlock);
    dest.model_fingerprint = kFingerprint;
    dest.blocks = std::move(blocks);
    dest.notice_tag = kTag + 1;
    return dest;
  }

  static void fill(KvBlockPool& pool, float base) {
    float* f = reinterpret_cast<float*>(pool.data());
    const size_t n = pool.size_bytes() / sizeof(float);
    for (size_t i = 0; i < n; ++i) f[i] = base + static_cast<float>(i);
  }

  // `before` with K and V of positions [0, n) copied from `src` (blocks sb) into blocks db.
  static std::vector<std::byte> expected(const std::vector<std::byte>& before, const KvBlockPool& src,
                                         const std::vector<BlockId>& sb, const KvBlockPool& dst,
                                         const std::vector<BlockId>& db, int64_t n) {
    std::vector<std::byte> out = before;
    const KvLayout& l = src.layout();
    const size_t row = static_cast<size_t>(l.kv_dim()) * sizeof(float);
    for (int64_t layer = 0; layer < l.n_layers; ++layer) {
      for (int64_t p = 0; p < n; ++p) {
        const size_t i = static_cast<size_t>(p / kBlock), r = static_cast<size_t>(p % kBlock);
        const std::byte* from = src.data() + l.offset(layer, sb[i]);
        std::byte* to = out.data() + dst.layout().offset(layer, db[i]);
        std::memcpy(to + r * row, from + r * row, row);
        std::memcpy(to + kBlock * row + r * row, from + kBlock * row + r * row, row);
      }
    }
    return out;
  }
};

TEST_P(KvSenderTest, ChunkedLayerWritesLandExactlyAndTheNoticeFollows) {
  Side src = make_side(12), dst = make_side(40);
  ASSERT_TRUE(src.engine && src.pool && dst.engine && dst.pool);
  fill(*src.pool, 0.5f);
  fill(*dst.pool, -1e6f);
  std::vector<std::byte> before(dst.pool->data(), dst.pool->data() + dst.pool->size_bytes());
  // 7 blocks for 100 positions; runs and scattered ids on both sides.
  const std::vector<BlockId> sb = {2, 3, 4, 9, 10, 0, 1};
  const std::vector<BlockId> db = {5, 6, 7, 20, 31, 32, 33};
  auto peer = src.engine->connect(dst.engine->address());
  ASSERT_TRUE(peer.ok()) << peer.status().to_string();
  auto sender = KvSender::create(*src.engine, *peer, src.region, src.pool->layout(), kFingerprint,
                                 destination(dst, db), kPrompt);
  ASSERT_TRUE(sender.ok()) << sender.status().to_string();
  KvSender& s = **sender;
  // The first call covers a 32-token prefix-cache hit plus the first chunk, which ends inside
  // block 2; then two chunks, the last one completing the prompt.
  const std::vector<std::pair<int64_t, int64_t>> chunks = {{0, 45}, {45, 77}, {77, kPrompt}};
  const int64_t layers = src.pool->layout().n_layers;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const bool last = c + 1 == chunks.size();
    for (int64_t layer = 0; layer < layers; ++layer) {
      ASSERT_TRUE(s.on_layer_ready(layer, chunks[c].first, chunks[c].second, sb, last))
          << "chunk " << c << " layer " << layer;
    }
  }
  Status st = s.finish(5s);
  ASSERT_TRUE(st.ok()) << st.to_string();
  auto notice = dst.engine->wait_notice(5s);
  ASSERT_TRUE(notice.ok()) << notice.status().to_string();
  EXPECT_EQ(notice->tag, kTag);
  EXPECT_EQ(notice->from_engine, src.engine->engine_id());

  auto want = expected(before, *src.pool, sb, *dst.pool, db, kPrompt);
  ASSERT_EQ(std::memcmp(want.data(), dst.pool->data(), want.size()), 0)
      << "the destination pool differs from the source's K/V of [0, " << kPrompt << ")";
  // Every byte of the prompt's K/V went exactly once.
  const uint64_t row = static_cast<uint64_t>(src.pool->layout().kv_dim()) * sizeof(float);
  EXPECT_EQ(s.bytes(), static_cast<uint64_t>(layers) * 2 * kPrompt * row);
  EXPECT_GT(s.tail_seconds(), 0.0);
  EXPECT_LE(s.tail_seconds(), s.transfer_seconds());
  EXPECT_LT(s.transfer_seconds(), 5.0);
  EXPECT_TRUE(s.drain(1s));
  // After finish, the sender takes no more layers.
  EXPECT_FALSE(s.on_layer_ready(0, 0, 16, sb, false));
}

TEST_P(KvSenderTest, AFinishBeforeEveryLayerWasSentIsRefusedWithoutANotice) {
  Side src = make_side(12), dst = make_side(40);
  ASSERT_TRUE(src.engine && dst.engine);
  auto peer = src.engine->connect(dst.engine->address());
  ASSERT_TRUE(peer.ok());
  const std::vector<BlockId> sb = {0, 1, 2, 3, 4, 5, 6}, db = {10, 11, 12, 13, 14, 15, 16};
  auto sender = KvSender::create(*src.engine, *peer, src.region, src.pool->layout(), kFingerprint,
                                 destination(dst, db), kPrompt);
  ASSERT_TRUE(sender.ok());
  for (int64_t layer = 0; layer < 4; ++layer) {
    ASSERT_TRUE((*sender)->on_layer_ready(layer, 0, layer == 3 ? 60 : kPrompt, sb, true));
  }
  Status st = (*sender)->finish(2s);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
  EXPECT_NE(st.message().find("layer 3 was sent for positions [0, 60) only"), std::string::npos)
      << st.message();
  EXPECT_FALSE(dst.engine->wait_notice(300ms).ok()) << "a notice went out for incomplete KV";
  EXPECT_TRUE((*sender)->drain(2s));
}

// finish_async and when_drained (the Prefill reactor's) call back exactly once, with finish()'s
// result: the KV in place and the notice sent, or the short layer refused without a notice.
TEST_P(KvSenderTest, FinishAsyncAndWhenDrainedCallBackOnceWithFinishsResult) {
  Side src = make_side(12), dst = make_side(40);
  ASSERT_TRUE(src.engine && src.pool && dst.engine && dst.pool);
  fill(*src.pool, 0.25f);
  fill(*dst.pool, -1e6f);
  std::vector<std::byte> before(dst.pool->data(), dst.pool->data() + dst.pool->size_bytes());
  const std::vector<BlockId> sb = {0, 1, 2, 3, 4, 5, 6}, db = {10, 11, 12, 13, 14, 15, 16};
  auto peer = src.engine->connect(dst.engine->address());
  ASSERT_TRUE(peer.ok()) << peer.status().to_string();
  const int64_t layers = src.pool->layout().n_layers;
  struct Calls {
    std::atomic<int> n{0};
    std::promise<Status> result;
  };
  {  // Every layer sent: OK, the notice follows, the bytes land.
    auto sender = KvSender::create(*src.engine, *peer, src.region, src.pool->layout(),
                                   kFingerprint, destination(dst, db), kPrompt);
    ASSERT_TRUE(sender.ok()) << sender.status().to_string();
    for (int64_t layer = 0; layer < layers; ++layer) {
      ASSERT_TRUE((*sender)->on_layer_ready(layer, 0, kPrompt, sb, true));
    }
    auto calls = std::make_shared<Calls>();
    (*sender)->finish_async([calls](Status st) {
      if (calls->n.fetch_add(1) == 0) calls->result.set_value(std::move(st));
    });
    auto got = calls->result.get_future();
    ASSERT_EQ(got.wait_for(5s), std::future_status::ready) << "finish_async never called back";
    const Status st = got.get();
    ASSERT_TRUE(st.ok()) << st.to_string();
    auto notice = dst.engine->wait_notice(5s);
    ASSERT_TRUE(notice.ok()) << notice.status().to_string();
    EXPECT_EQ(notice->tag, kTag);
    auto want = expected(before, *src.pool, sb, *dst.pool, db, kPrompt);
    EXPECT_EQ(std::memcmp(want.data(), dst.pool->data(), want.size()), 0);
    EXPECT_GT((*sender)->tail_seconds(), 0.0);
    auto drained = std::make_shared<std::atomic<int>>(0);
    (*sender)->when_drained([drained] { drained->fetch_add(1); });
    EXPECT_EQ(drained->load(), 1) << "nothing in flight: when_drained calls back at once";
    std::this_thread::sleep_for(50ms);
    EXPECT_EQ(calls->n.load(), 1);
  }
  {  // A layer short: FailedPrecondition, no notice.
    auto sender = KvSender::create(*src.engine, *peer, src.region, src.pool->layout(),
                                   kFingerprint, destination(dst, db), kPrompt);
    ASSERT_TRUE(sender.ok());
    for (int64_t layer = 0; layer < layers; ++layer) {
      ASSERT_TRUE((*sender)->on_layer_ready(layer, 0, layer == 1 ? 30 : kPrompt, sb, true));
    }
    auto calls = std::make_shared<Calls>();
    (*sender)->finish_async([calls](Status st) {
      if (calls->n.fetch_add(1) == 0) calls->result.set_value(std::move(st));
    });
    auto got = calls->result.get_future();
    ASSERT_EQ(got.wait_for(5s), std::future_status::ready);
    const Status st = got.get();
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
    EXPECT_FALSE(dst.engine->wait_notice(300ms).ok()) << "a notice went out for incomplete KV";
    EXPECT_EQ(calls->n.load(), 1);
  }
}

// The decode worker's process is killed after the first chunk went out: the next chunks and
// the notice fail within the transfer engine's bound, never hang.
TEST_P(KvSenderTest, AKilledDestinationProcessFailsWithinTheCompletionTimeout) {
  PeerProcess peer_proc;
  start_peer(GetParam(), peer_proc);
  ASSERT_GT(peer_proc.pid, 0);
  Side src = make_side(12, 300);
  ASSERT_TRUE(src.engine);
  auto peer = src.engine->connect(peer_proc.address);
  ASSERT_TRUE(peer.ok()) << peer.status().to_string();
  KvDestination dest = remote_destination(peer_proc, {3, 4, 5, 6, 7, 8, 9});
  const std::vector<BlockId> sb = {0, 1, 2, 3, 4, 5, 6};
  auto sender = KvSender::create(*src.engine, *peer, src.region, src.pool->layout(), kFingerprint,
                                 dest, kPrompt);
  ASSERT_TRUE(sender.ok()) << sender.status().to_string();
  KvSender& s = **sender;
  for (int64_t layer = 0; layer < 4; ++layer) ASSERT_TRUE(s.on_layer_ready(layer, 0, 48, sb, false));
  EXPECT_TRUE(s.drain(5s));
  peer_proc.kill_now();
  for (int64_t layer = 0; layer < 4; ++layer) (void)s.on_layer_ready(layer, 48, kPrompt, sb, true);
  const auto t0 = Clock::now();
  Status st = s.finish(5s);
  const auto took = Clock::now() - t0;
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.message().find("still in flight"), std::string::npos)
      << "finish() ran into its own timeout: " << st.to_string();
  EXPECT_LT(took, 2s) << st.to_string();
  std::cerr << "killed destination -> " << st.to_string() << " after "
            << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms\n";
  EXPECT_FALSE(s.on_layer_ready(0, 0, kPrompt, sb, false)) << "the failure was seen";
  EXPECT_TRUE(s.drain(2s));
  EXPECT_EQ(s.tail_seconds(), 0.0);
}

TEST_P(KvSenderTest, OnLayerReadyReturnsFalseOnceAFailedBatchIsSeen) {
  PeerProcess peer_proc;
  start_peer(GetParam(), peer_proc);
  ASSERT_GT(peer_proc.pid, 0);
  Side src = make_side(12, 300);
  ASSERT_TRUE(src.engine);
  auto peer = src.engine->connect(peer_proc.address);
  ASSERT_TRUE(peer.ok());
  const std::vector<BlockId> sb = {0, 1, 2, 3, 4, 5, 6};
  auto sender = KvSender::create(*src.engine, *peer, src.region, src.pool->layout(), kFingerprint,
                                 remote_destination(peer_proc, {0, 1, 2, 3, 4, 5, 6}), kPrompt);
  ASSERT_TRUE(sender.ok());
  ASSERT_TRUE((*sender)->on_layer_ready(0, 0, 32, sb, false));
  peer_proc.kill_now();
  // The engine keeps computing (recomputed ranges are allowed); the sender must stop it, with
  // no finish() to look at the batches.
  const auto t0 = Clock::now();
  bool stopped = false;
  for (int step = 0; step < 400 && !stopped; ++step) {
    for (int64_t layer = 0; layer < 4 && !stopped; ++layer) {
      stopped = !(*sender)->on_layer_ready(layer, 0, 32, sb, false);
    }
    std::this_thread::sleep_for(5ms);
  }
  const auto took = Clock::now() - t0;
  EXPECT_TRUE(stopped) << "on_layer_ready never reported the failed transfer";
  EXPECT_LT(took, 2s);
  EXPECT_TRUE((*sender)->drain(3s));
  EXPECT_FALSE((*sender)->finish(1s).ok());
}

// In one process: the destination engine is destroyed after the connect. (tcp only: libfabric
// 1.17's shm crashes writing to an endpoint closed in the same process.)
TEST(KvSenderTcpTest, ADestroyedDestinationEngineFailsWithinTheCompletionTimeout) {
  transfer::TransferSettings t;
  t.provider = "tcp;ofi_rxm";
  t.node = "127.0.0.1";
  t.completion_timeout_ms = 300;
  auto src = transfer::TransferEngine::create(t, true);
  auto dst = transfer::TransferEngine::create(t, true);
  ASSERT_TRUE(src.ok() && dst.ok());
  auto src_pool = KvBlockPool::create(layout(8, 16));
  auto dst_pool = KvBlockPool::create(layout(8, 16));
  ASSERT_TRUE(src_pool.ok() && dst_pool.ok());
  auto src_mr = (*src)->register_memory((*src_pool)->data(), (*src_pool)->size_bytes(),
                                        transfer::MemoryKind::host());
  auto dst_mr = (*dst)->register_memory((*dst_pool)->data(), (*dst_pool)->size_bytes(),
                                        transfer::MemoryKind::host());
  ASSERT_TRUE(src_mr.ok() && dst_mr.ok());
  auto peer = (*src)->connect((*dst)->address());
  ASSERT_TRUE(peer.ok());
  KvDestination dest;
  dest.transfer_address = (*dst)->address();
  dest.region = dst_mr->remote;
  dest.layout = (*dst_pool)->layout();
  dest.blocks = {4, 5, 6};
  dest.notice_tag = 9;
  dst->reset();
  auto sender = KvSender::create(**src, *peer, *src_mr, (*src_pool)->layout(), "", dest, 40);
  ASSERT_TRUE(sender.ok()) << sender.status().to_string();
  const std::vector<BlockId> sb = {0, 1, 2};
  for (int64_t layer = 0; layer < 4; ++layer) (void)(*sender)->on_layer_ready(layer, 0, 40, sb, true);
  const auto t0 = Clock::now();
  Status st = (*sender)->finish(5s);
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.message().find("still in flight"), std::string::npos) << st.to_string();
  EXPECT_LT(Clock::now() - t0, 2s) << st.to_string();
  EXPECT_FALSE((*sender)->on_layer_ready(0, 0, 40, sb, true));
  EXPECT_TRUE((*sender)->drain(2s));
}

TEST_P(KvSenderTest, ADescriptorOfAnotherEngineIsRefusedAtOnce) {
  Side src = make_side(12, 300), dst = make_side(40, 300), other = make_side(40, 300);
  ASSERT_TRUE(src.engine && dst.engine && other.engine);
  auto peer = src.engine->connect(dst.engine->address());
  ASSERT_TRUE(peer.ok());
  KvDestination dest = destination(dst, {0, 1, 2, 3, 4, 5, 6});
  dest.region = other.region.remote;  // a key the peer does not own
  const std::vector<BlockId> sb = {0, 1, 2, 3, 4, 5, 6};
  auto sender = KvSender::create(*src.engine, *peer, src.region, src.pool->layout(), kFingerprint,
                                 dest, kPrompt);
  ASSERT_TRUE(sender.ok());
  EXPECT_FALSE((*sender)->on_layer_ready(0, 0, kPrompt, sb, true));
  const auto t0 = Clock::now();
  Status st = (*sender)->finish(5s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("foreign key"), std::string::npos) << st.message();
  EXPECT_LT(Clock::now() - t0, 500ms);
  EXPECT_TRUE((*sender)->drain(1s));
  EXPECT_FALSE(dst.engine->wait_notice(100ms).ok());
}

TEST_P(KvSenderTest, CreateRefusesMismatchesAndShortReservations) {
  Side src = make_side(12), dst = make_side(40);
  ASSERT_TRUE(src.engine && dst.engine);
  auto peer = src.engine->connect(dst.engine->address());
  ASSERT_TRUE(peer.ok());
  const std::vector<BlockId> db = {0, 1, 2, 3, 4, 5, 6};
  auto make = [&](KvDestination d, int64_t prompt = kPrompt) {
    return KvSender::create(*src.engine, *peer, src.region, src.pool->layout(), kFingerprint,
                            std::move(d), prompt);
  };
  {
    KvDestination d = destination(dst, db);
    d.model_fingerprint = "llama-70b-0000";
    auto r = make(d);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(r.status().message().find("model fingerprint differs (prefill " +
                                        std::string(kFingerprint) + ", decode llama-70b-0000)"),
              std::string::npos)
        << r.status().message();
  }
  {
    KvDestination d = destination(dst, db);
    d.layout.block_size = 32;
    auto r = make(d);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("block_size differs (prefill 16, decode 32)"),
              std::string::npos)
        << r.status().message();
  }
  {
    auto r = make(destination(dst, {0, 1, 2, 3, 4, 5}));  // 96 positions for 100 tokens
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("the prompt has 100 tokens"), std::string::npos)
        << r.status().message();
  }
  EXPECT_FALSE(make(destination(dst, {0, 1, 2, 3, 4, 5, 40})).ok()) << "block id past the pool";
  EXPECT_FALSE(make(destination(dst, {0, 1, 2, 3, 4, 5, 3})).ok()) << "a block twice";
  EXPECT_FALSE(make(destination(dst, db), 0).ok()) << "empty prompt";
  {
    KvDestination d = destination(dst, db);
    d.region.len = 1024;  // does not cover the decode pool
    EXPECT_FALSE(make(d).ok());
  }
  EXPECT_TRUE(make(destination(dst, db)).ok());
  EXPECT_TRUE(make(destination(dst, {0, 1, 2, 3, 4, 5, 6, 7, 8}), 97).ok()) << "spare blocks";
}

// The destination's lease runs out between two chunks: the sender posts nothing more (the
// decode worker would refuse it, or worse), fails naming the lease, and sends no notice.
TEST_P(KvSenderTest, NothingIsPostedAfterTheLeaseEndsAndNoNoticeGoesOut) {
  Side src = make_side(12), dst = make_side(40);
  ASSERT_TRUE(src.engine && dst.engine);
  fill(*src.pool, 0.5f);
  auto peer = src.engine->connect(dst.engine->address());
  ASSERT_TRUE(peer.ok());
  const std::vector<BlockId> sb = {0, 1, 2, 3, 4, 5, 6}, db = {10, 11, 12, 13, 14, 15, 16};
  KvDestination dest = destination(dst, db);
  // A lease long enough for the first chunks to go out however loaded the machine (the bound is
  // 900 ms after creation).
  dest.lease = 1000ms;
  EXPECT_EQ(KvSender::lease_margin(400ms), 40ms);
  EXPECT_EQ(KvSender::lease_margin(10s), 500ms);
  EXPECT_EQ(KvSender::lease_margin(0ms), 0ms);
  auto sender = KvSender::create(*src.engine, *peer, src.region, src.pool->layout(), kFingerprint,
                                 dest, kPrompt);
  ASSERT_TRUE(sender.ok()) << sender.status().to_string();
  KvSender& s = **sender;
  const auto created = Clock::now();
  for (int64_t layer = 0; layer < 4; ++layer) ASSERT_TRUE(s.on_layer_ready(layer, 0, 48, sb, false));
  ASSERT_TRUE(s.drain(5s));
  ASSERT_TRUE(s.failure().ok()) << s.failure().to_string();
  const uint64_t bytes_before = s.bytes();
  const auto writes_before = src.engine->metrics().rail_writes;
  std::vector<std::byte> landed(dst.pool->data(), dst.pool->data() + dst.pool->size_bytes());

  std::this_thread::sleep_until(created + dest.lease - KvSender::lease_margin(dest.lease) + 10ms);
  EXPECT_FALSE(s.on_layer_ready(0, 48, kPrompt, sb, true)) << "a chunk went out after the lease";
  Status st = s.finish(2s);
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.to_string();
  EXPECT_NE(st.message().find("the lease of 1000 ms on decode worker decode-0's blocks has ended"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(s.bytes(), bytes_before);
  EXPECT_EQ(src.engine->metrics().rail_writes, writes_before) << "writes were posted";
  EXPECT_FALSE(dst.engine->wait_notice(300ms).ok()) << "a notice went out after the lease";
  EXPECT_EQ(std::memcmp(landed.data(), dst.pool->data(), landed.size()), 0);
  EXPECT_TRUE(s.drain(1s));
}

// A renewed lease (RenewLease, after the decode worker renewed its reservation) moves the
// bound: the chunk after the first lease's end goes out and the handoff completes. A bound that
// has passed is not brought back, and without a lease there is nothing to renew.
TEST_P(KvSenderTest, ARenewedLeaseMovesTheWriteBound) {
  Side src = make_side(12), dst = make_side(40);
  ASSERT_TRUE(src.engine && dst.engine);
  fill(*src.pool, 0.5f);
  auto peer = src.engine->connect(dst.engine->address());
  ASSERT_TRUE(peer.ok());
  const std::vector<BlockId> sb = {0, 1, 2, 3, 4, 5, 6}, db = {10, 11, 12, 13, 14, 15, 16};
  KvDestination dest = destination(dst, db);
  // The first bound is 540 ms after creation, the renewed one 2.94 s after the renewal: wide
  // margins on both sides, so that a loaded machine's late wake-ups do not decide the test.
  dest.lease = 600ms;
  auto sender = KvSender::create(*src.engine, *peer, src.region, src.pool->layout(), kFingerprint,
                                 dest, kPrompt);
  ASSERT_TRUE(sender.ok()) << sender.status().to_string();
  KvSender& s = **sender;
  const auto created = Clock::now();
  for (int64_t layer = 0; layer < 4; ++layer) ASSERT_TRUE(s.on_layer_ready(layer, 0, 48, sb, false));
  std::this_thread::sleep_until(created + 100ms);
  ASSERT_TRUE(s.renew_lease(3000ms));
  ASSERT_TRUE(s.renew_lease(10ms)) << "a shorter renewal keeps the later bound";
  std::this_thread::sleep_until(created + 600ms);  // past the first lease's end
  for (int64_t layer = 0; layer < 4; ++layer) {
    ASSERT_TRUE(s.on_layer_ready(layer, 48, kPrompt, sb, true)) << "layer " << layer;
  }
  Status st = s.finish(5s);
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_TRUE(dst.engine->wait_notice(5s).ok());

  // Once the bound has passed, a renewal comes too late.
  dest.lease = 50ms;
  auto late = KvSender::create(*src.engine, *peer, src.region, src.pool->layout(), kFingerprint,
                               dest, kPrompt);
  ASSERT_TRUE(late.ok());
  std::this_thread::sleep_for(60ms);
  EXPECT_FALSE((*late)->renew_lease(300ms));
  EXPECT_FALSE((*late)->on_layer_ready(0, 0, 48, sb, false));
  EXPECT_TRUE((*late)->drain(1s));
  dest.lease = 0ms;
  auto none = KvSender::create(*src.engine, *peer, src.region, src.pool->layout(), kFingerprint,
                               dest, kPrompt);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE((*none)->renew_lease(300ms));
}

// No lease given (0): no bound, the handoff completes however long it takes.
TEST_P(KvSenderTest, WithoutALeaseTheSenderSetsNoBound) {
  Side src = make_side(12), dst = make_side(40);
  ASSERT_TRUE(src.engine && dst.engine);
  auto peer = src.engine->connect(dst.engine->address());
  ASSERT_TRUE(peer.ok());
  const std::vector<BlockId> sb = {0, 1, 2, 3, 4, 5, 6}, db = {10, 11, 12, 13, 14, 15, 16};
  KvDestination dest = destination(dst, db);
  dest.lease = 0ms;
  auto sender = KvSender::create(*src.engine, *peer, src.region, src.pool->layout(), kFingerprint,
                                 dest, kPrompt);
  ASSERT_TRUE(sender.ok());
  for (int64_t layer = 0; layer < 4; ++layer) ASSERT_TRUE((*sender)->on_layer_ready(layer, 0, 48, sb, false));
  std::this_thread::sleep_for(100ms);
  for (int64_t layer = 0; layer < 4; ++layer) {
    ASSERT_TRUE((*sender)->on_layer_ready(layer, 48, kPrompt, sb, true));
  }
  Status st = (*sender)->finish(5s);
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_TRUE(dst.engine->wait_notice(5s).ok());
}

INSTANTIATE_TEST_SUITE_P(Providers, KvSenderTest, ::testing::Values("tcp;ofi_rxm", "shm"),
                         [](const auto& info) {
                           return info.param == "shm" ? std::string("shm") : std::string("tcp_rxm");
                         });

}  // namespace
}  // namespace cleave
