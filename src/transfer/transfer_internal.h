// Internal pieces of the transfer engine shared by its .cpp files. Not a public header.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <functional>
#include <map>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cleave/transfer/transfer_engine.h"

namespace cleave::transfer {

using Clock = std::chrono::steady_clock;

// "what failed: fi_strerror (-code)".
std::string fabric_error(std::string_view what, int rc);

// Counters behind TransferMetricsSnapshot; lock-free on the data path except per-peer counters.
class MetricsCounters {
 public:
  void init(std::string provider, int rails);
  void add_rail_write(int rail, uint64_t bytes);
  void add_transfer(uint64_t peer_engine, uint64_t bytes, Clock::duration latency, bool ok);
  void add_error(TransferErrorKind kind);
  void add_notice_sent() { notices_sent_.fetch_add(1, std::memory_order_relaxed); }
  void add_notice_received() { notices_received_.fetch_add(1, std::memory_order_relaxed); }
  TransferMetricsSnapshot snapshot() const;

 private:
  std::string provider_;
  std::unique_ptr<std::atomic<uint64_t>[]> rail_bytes_, rail_writes_;
  int rails_ = 0;
  std::array<std::atomic<uint64_t>, TransferMetricsSnapshot::kLatencyBuckets> latency_{};
  std::array<std::atomic<uint64_t>, static_cast<size_t>(TransferErrorKind::kCount)> errors_{};
  std::atomic<uint64_t> notices_sent_{0}, notices_received_{0};
  mutable std::mutex peers_mu_;
  std::map<uint64_t, TransferMetricsSnapshot::PeerCounters> peers_;
};

struct PeerRecord {
  uint64_t id = 0;
  uint64_t engine_id = 0;
  std::vector<fi_addr_t> rail_addr;  // our rail i -> the peer's endpoint in rail i's AV
  std::atomic<bool> unreachable{false};
  std::mutex mu;  // guards `recent`
  std::vector<std::weak_ptr<TransferState>> recent;  // unfinished batches, for notify()
};

}  // namespace cleave::transfer

namespace cleave::transfer {

// Shared completion state of one batch (or notice).
struct TransferState {
  MetricsCounters* metrics = nullptr;
  std::shared_ptr<PeerRecord> peer;
  uint64_t bytes = 0;
  Clock::time_point start = Clock::now();
  std::optional<uint64_t> notify_tag;
  std::vector<std::shared_ptr<TransferState>> predecessors;  // notify(): wait for these
  std::atomic<int64_t> writes_left{0};

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
  std::atomic<bool> finished{false};

  // First call wins; returns whether this call finished the transfer.
  bool finish(Status s, std::optional<TransferErrorKind> kind = std::nullopt);
  bool is_done() const { return finished.load(std::memory_order_acquire); }
};

// One unit of work for a rail: a write slice or a notice.
struct RailWork {
  enum class Kind : uint8_t { kWrite, kNotice } kind = Kind::kWrite;
  std::shared_ptr<TransferState> transfer;
  void* local = nullptr;
  void* local_desc = nullptr;
  uint64_t len = 0;
  uint64_t remote_addr = 0;
  uint64_t key = 0;
};

// Context of an operation handed to libfabric; `ctx` must stay first.
struct OpContext {
  fi_context2 ctx;
  enum class Kind : uint8_t { kWrite, kNotice, kRecv } kind;
  RailWork work;
  Clock::time_point posted;
  int slot = -1;  // notice / receive buffer slot
  bool abandoned = false;
};

struct FabricShared;  // fabric + domains, owned by the engine

// One endpoint with its CQ, AV, notice buffers and progress thread.
class FabricRail {
 public:
  FabricRail(int index, fid_domain* domain, fi_info* info, const TransferSettings& settings,
             MetricsCounters* metrics, bool delivery_complete,
             std::function<void(const Notice&)> on_notice);
  ~FabricRail();
  Status open(uint64_t engine_id, uint64_t (*next_key)(void*), void* key_ctx);
  void start();
  void stop();

  std::string name() const { return name_; }
  Result<fi_addr_t> insert_peer(const std::string& name);
  void enqueue(std::vector<RailWork> work);  // thread-safe
  uint64_t max_msg_size() const { return info_->ep_attr->max_msg_size; }
  int index() const { return index_; }
  const char* provider_name() const { return info_->fabric_attr->prov_name; }

 private:
  void run();
  int post(RailWork& w, fi_addr_t dest);
  void post_ready();
  void post_deferred_notices();
  int read_completions();
  void handle_completion(OpContext* op, bool error, const std::string& error_text, int err);
  void check_timeouts();
  void finish_write(OpContext* op);
  void send_notice_now(const std::shared_ptr<TransferState>& t);
  Status post_recv(int slot);
  void wake();

  int index_;
  fid_domain* domain_;
  fi_info* info_;
  TransferSettings settings_;
  MetricsCounters* metrics_;
  bool delivery_complete_;
  std::function<void(const Notice&)> on_notice_;
  uint64_t engine_id_ = 0;

  fid_ep* ep_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  bool cq_waitable_ = false;
  std::string name_;
  size_t depth_ = 0;

  static constexpr int kNoticeBytes = 64;
  static constexpr int kRecvSlots = 64;
  static constexpr int kSendSlots = 128;
  std::vector<char> recv_buf_, send_buf_;
  fid_mr* recv_mr_ = nullptr;
  fid_mr* send_mr_ = nullptr;
  std::vector<int> free_send_slots_;
  std::vector<OpContext*> recv_ops_;  // one per receive slot, reused

  std::mutex mu_;  // guards incoming_, stop_ wakeups
  std::condition_variable cv_;
  std::deque<RailWork> incoming_;
  std::atomic<bool> stop_{false};
  std::thread thread_;

  // Owned by the rail thread.
  std::deque<RailWork> ready_;
  std::deque<std::shared_ptr<TransferState>> deferred_notices_;
  std::deque<std::shared_ptr<TransferState>> pending_notices_;  // waiting for a send slot
  std::unordered_set<OpContext*> inflight_;
  std::vector<OpContext*> abandoned_;
  std::unordered_map<PeerRecord*, Clock::time_point> last_completion_;
  size_t writes_inflight_ = 0;
  Clock::time_point last_timeout_check_ = Clock::now();
  std::optional<Clock::time_point> eagain_since_;
  std::unordered_map<PeerRecord*, size_t> peer_inflight_;  // posted writes per peer
};

}  // namespace cleave::transfer
