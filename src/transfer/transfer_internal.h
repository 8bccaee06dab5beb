// Internal pieces of the transfer engine shared by its .cpp files. Not a public header.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_eq.h>
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
#include <sys/types.h>
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
  // The peer's endpoint name for our rail i (guarded by the engine's peers mutex; each rail
  // keeps its own copy with the fi_addr_t of its AV).
  std::vector<std::string> rail_names;
  // Set when the peer runs on this host in this pid namespace (same host id in its address):
  // then alive() asks the kernel whether its process still exists.
  pid_t pid = 0;
  bool same_host = false;
  std::atomic<bool> unreachable{false};
  std::mutex mu;  // guards `recent`
  std::vector<std::weak_ptr<TransferState>> recent;  // unfinished batches, for notify()

  // False only when the peer is known to be gone (same host and kill(pid, 0) says ESRCH).
  bool alive() const;
};

// Lets a thread that waits for a transfer drive the rails' progress itself instead of sleeping
// until a progress thread hands the completion over (implemented by the engine).
class ProgressDriver {
 public:
  virtual ~ProgressDriver() = default;
  // One pass over every rail whose progress lock is free; returns the events handled.
  virtual int drive_progress() = 0;
};

}  // namespace cleave::transfer

namespace cleave::transfer {

// Shared completion state of one batch (or notice).
struct TransferState {
  MetricsCounters* metrics = nullptr;
  ProgressDriver* driver = nullptr;  // the engine, which outlives every handle's use
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
  Clock::time_point end;  // when it finished (valid once done)
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
//
// Locking: every piece of endpoint state (the fids, the queues, in-flight operations, the peer
// addresses) is guarded by `progress_mu_`. Whoever holds it makes progress: the rail's own
// thread, a submitter posting its slices inline, or a thread waiting for a transfer. Nobody
// sleeps while holding it (the progress thread sleeps in fi_cq_sread or on a condition variable
// without it), and nobody blocks on it without a time limit: a thread can get stuck inside the
// provider while holding it (libfabric 1.17's shm spins forever on the region lock of a peer
// that was killed while holding it). The engine's watchdog sees that through busy_for() and
// replaces the rail (declare_stuck() fails its transfers; the rail object is then leaked).
class FabricRail {
 public:
  FabricRail(int index, fid_fabric* fabric, fid_domain* domain, fi_info* info,
             const TransferSettings& settings, MetricsCounters* metrics, bool delivery_complete,
             std::function<void(const Notice&)> on_notice);
  ~FabricRail();
  Status open(uint64_t engine_id, uint64_t (*next_key)(void*), void* key_ctx);
  void start();
  // Stops the progress thread; false when it did not stop within 2 s (stuck inside the
  // provider): the thread is then detached and the caller must leak this rail.
  bool stop();

  // This rail's current endpoint name (it changes when the rail is reopened).
  std::string name() const;
  // Inserts `peer` under endpoint name `name` into this rail's AV; a no-op when it is there
  // under that name already (re-inserts after a reopen of this rail, or when the peer's
  // endpoint was renamed by its own reopen). Unavailable when the rail is stuck.
  Status insert_peer(const std::shared_ptr<PeerRecord>& peer, const std::string& name);
  // Queues work and posts what it can right away when the progress lock is free (thread-safe,
  // never blocks on a rail whose progress is stuck inside the provider). Work given to a rail
  // already declared stuck fails at once.
  void enqueue(std::vector<RailWork>&& work);
  // One progress pass if the progress lock is free; returns the events handled (0 if busy).
  int try_progress();
  uint64_t max_msg_size() const { return info_->ep_attr->max_msg_size; }
  int index() const { return index_; }
  const char* provider_name() const { return info_->fabric_attr->prov_name; }
  uint64_t reopens() const { return reopens_.load(std::memory_order_relaxed); }

  // How long the progress lock has been held by one holder without a break (zero when free).
  Clock::duration busy_for(Clock::time_point now) const;
  // Watchdog only: the rail is stuck inside the provider. Fails with `why` every unfinished
  // transfer with work that reached the lock holder's state, marks the peer being posted to
  // (if known) unreachable, makes later enqueue() calls fail, asks the thread to exit if it
  // ever comes back, and returns the work still queued untouched (for the replacement rail).
  std::vector<RailWork> declare_stuck(const std::string& why);
  bool is_stuck() const { return stuck_.load(); }
  // The peer the lock holder is posting to right now (nullptr when none), for diagnostics.
  std::shared_ptr<PeerRecord> posting_to() const;

 private:
  // progress_mu_ held, stamped for busy_for(); used by every path that calls into libfabric.
  class Held;
  struct PeerSlot {
    std::weak_ptr<PeerRecord> peer;
    std::string name;
    fi_addr_t addr = FI_ADDR_NOTAVAIL;
  };

  Status open_endpoint();
  void close_endpoint();
  void leak_endpoint();
  void reopen();
  void run();
  int progress_once();  // holds progress_mu_
  bool has_work() const;
  fi_addr_t addr_of(PeerRecord* peer) const;
  int post(RailWork& w, fi_addr_t dest);
  void post_ready();
  void post_deferred_notices();
  int read_completions();
  void handle_completion(OpContext* op, bool error, const std::string& error_text, int err);
  void check_timeouts();
  void abandon(OpContext* op, Status why, TransferErrorKind kind);
  void finish_write(OpContext* op);
  void send_notice_now(const std::shared_ptr<TransferState>& t);
  Status post_recv(int slot);
  OpContext* new_op();
  void free_op(OpContext* op);
  void wake();
  void track(const std::vector<RailWork>& work);

  int index_;
  fid_fabric* fabric_;
  fid_domain* domain_;
  fi_info* info_;
  TransferSettings settings_;
  MetricsCounters* metrics_;
  bool delivery_complete_;
  // shm: closing an endpoint whose AV holds a dead peer may spin on that peer's lock or
  // corrupt a live peer's view of us, so replaced endpoints are leaked instead of closed.
  bool leak_on_reopen_ = false;
  std::function<void(const Notice&)> on_notice_;
  uint64_t engine_id_ = 0;

  mutable std::timed_mutex progress_mu_;
  std::atomic<int64_t> held_since_ns_{0};  // steady clock of the current holder's start; 0: free
  fid_ep* ep_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_cntr* remote_writes_ = nullptr;  // FI_RMA_EVENT: writes by peers into our memory
  uint64_t remote_writes_seen_ = 0;
  bool cq_waitable_ = false;
  mutable std::mutex name_mu_;  // guards name_ (readable while the rail is stuck)
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
  std::vector<std::unique_ptr<OpContext>> op_store_;  // every write/notice context ever made
  std::vector<OpContext*> free_ops_;
  struct LeakedEndpoint { fid_ep* ep; fid_av* av; fid_cq* cq; };
  std::vector<LeakedEndpoint> leaked_;

  std::mutex sleep_mu_;  // the progress thread's nap when the CQ has no wait object
  std::condition_variable sleep_cv_;
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> stop_{false};
  std::atomic<bool> exited_{false};
  std::atomic<bool> stuck_{false};
  std::mutex incoming_mu_;  // guards incoming_: work queued while the progress lock was busy
  std::deque<RailWork> incoming_;
  std::atomic<uint64_t> reopens_{0};
  std::thread thread_;
  // Transfers with work in the lock holder's state, for declare_stuck() (which cannot take
  // progress_mu_). Lock order: incoming_mu_, then tracked_mu_.
  std::mutex tracked_mu_;
  std::vector<std::weak_ptr<TransferState>> tracked_;
  mutable std::mutex posting_mu_;
  std::shared_ptr<PeerRecord> posting_to_;  // set around fi_writemsg / fi_send

  std::deque<RailWork> ready_;
  std::deque<std::shared_ptr<TransferState>> deferred_notices_;
  std::deque<std::shared_ptr<TransferState>> pending_notices_;  // waiting for a send slot
  std::unordered_set<OpContext*> inflight_;
  std::vector<OpContext*> abandoned_;  // timed out, never completed by the provider
  std::unordered_map<PeerRecord*, Clock::time_point> last_completion_;
  size_t writes_inflight_ = 0;
  Clock::time_point last_timeout_check_ = Clock::now();
  Clock::time_point last_activity_ = Clock::now();  // last posted or completed operation
  std::unordered_map<PeerRecord*, Clock::time_point> eagain_since_;
  std::unordered_map<PeerRecord*, size_t> peer_inflight_;  // posted writes per peer
  std::unordered_map<PeerRecord*, PeerSlot> peers_;  // inserted into this rail's AV
  bool reopen_wanted_ = false;  // set on a timeout; only the rail thread reopens
  std::atomic<uint64_t> work_epoch_{0};  // bumped by enqueue(), read before the thread sleeps
  bool wake_pending_ = false;            // guarded by sleep_mu_
};

}  // namespace cleave::transfer
