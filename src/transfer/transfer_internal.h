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

// Counters behind TransferMetricsSnapshot; lock-free on the data path (a peer's counters are
// made once, when it is connected, and only snapshot() takes the lock to list them).
class MetricsCounters {
 public:
  struct PeerAtomics {
    std::atomic<uint64_t> bytes{0}, transfers{0}, failures{0};
  };
  void init(std::string provider, int rails);
  void add_rail_write(int rail, uint64_t bytes);
  // The counters of the peer with this engine id (made on first use; the pointer stays valid
  // for the life of this object).
  PeerAtomics* peer_counters(uint64_t peer_engine);
  void add_transfer(PeerAtomics* peer, uint64_t bytes, Clock::duration latency, bool ok);
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
  mutable std::mutex peers_mu_;  // guards the map, not the counters
  std::map<uint64_t, std::unique_ptr<PeerAtomics>> peers_;
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
  MetricsCounters::PeerAtomics* stats = nullptr;  // this peer's counters in the engine's metrics
  std::atomic<bool> unreachable{false};
  // Bumped by every connect() of a known peer, which clears `unreachable`: a failure of work
  // submitted before that connect (a late error completion) does not mark the peer again.
  std::atomic<uint64_t> connects{0};
  std::mutex mu;  // guards `recent` and `recent_prune_at`
  std::vector<std::weak_ptr<TransferState>> recent;  // unfinished batches, for notify()
  size_t recent_prune_at = 64;  // finished entries are dropped when `recent` reaches this size

  // False only when the peer is known to be gone (same host and kill(pid, 0) says ESRCH).
  bool alive() const;
  // alive(), but asks the kernel at most once per kAliveRecheckNs (100 us; the posting path
  // calls it on every pass, which was a kill() per 4 KiB write). A peer that dies between two
  // checks is caught by the completion timeout and the watchdog, as one that dies after the
  // post is; the window is kept short because a post to a dead shm peer can get its rail stuck.
  // `now_ns`: the caller's steady clock (a progress pass reads it once).
  bool probably_alive(int64_t now_ns) const;
  static constexpr int64_t kAliveRecheckNs = 100'000;

 private:
  mutable std::atomic<int64_t> alive_checked_ns_{0};
  mutable std::atomic<bool> gone_{false};
};

// Lets a thread that waits for a transfer drive the rails' progress itself instead of sleeping
// until a progress thread hands the completion over (implemented by the engine).
class ProgressDriver {
 public:
  struct Pass {
    int events = 0;  // completions handled
    int rails = 0;   // rails whose progress lock was free (the others are driven by somebody)
  };
  virtual ~ProgressDriver() = default;
  // One pass over every rail whose progress lock is free.
  virtual Pass drive_progress() = 0;
};

}  // namespace cleave::transfer

namespace cleave::transfer {

// Shared completion state of one batch (or notice).
struct TransferState {
  MetricsCounters* metrics = nullptr;
  ProgressDriver* driver = nullptr;  // the engine, which outlives every handle's use
  // How long a waiter keeps polling without a completion (transfer.idle_poll_us, as the rails).
  Clock::duration hot = std::chrono::milliseconds(2);
  std::shared_ptr<PeerRecord> peer;
  uint64_t peer_connects = 0;  // peer->connects when the transfer was submitted
  uint64_t bytes = 0;
  Clock::time_point start = Clock::now();
  std::optional<uint64_t> notify_tag;
  uint64_t notify_value = 0;  // what the notice carries beside its tag
  // Batch::post_by: no slice or notice of this transfer is posted at or after it.
  Clock::time_point post_by = Clock::time_point::max();
  std::vector<std::shared_ptr<TransferState>> predecessors;  // notify(): wait for these
  // The notice's id on the wire (0 until it is first posted; a re-send after a reopen of its
  // rail keeps it, so that the receiver drops a second copy). Guarded by the rail's progress
  // lock.
  uint64_t notice_id = 0;
  std::atomic<int64_t> writes_left{0};

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
  Clock::time_point end;  // when it finished (valid once done)
  std::atomic<bool> finished{false};
  std::vector<std::function<void()>> on_done;  // TransferHandle::on_done, until done

  // First call wins; returns whether this call finished the transfer (and ran on_done).
  bool finish(Status s, std::optional<TransferErrorKind> kind = std::nullopt);
  bool is_done() const { return finished.load(std::memory_order_acquire); }
  // Marks the peer unreachable unless it was connected again since this transfer's submit.
  void mark_peer_unreachable() {
    if (peer->connects.load() == peer_connects) peer->unreachable.store(true);
  }
  // Fails the transfer when `now` is at or past post_by (true then): the caller does not post.
  // `what`: the operation that was about to go out, for the message.
  bool fail_if_past_deadline(Clock::time_point now, std::string_view what);
};

// Drops finished (or freed) transfers from `list` once it has reached `*sweep_at`, and puts the
// next sweep at twice what is left (at least `floor`): amortised O(1) per entry added, however
// many transfers are in flight.
inline void sweep_finished(std::vector<std::weak_ptr<TransferState>>& list, size_t* sweep_at,
                           size_t floor) {
  if (list.size() < *sweep_at) return;
  std::erase_if(list, [](const std::weak_ptr<TransferState>& w) {
    auto t = w.lock();
    return !t || t->is_done();
  });
  *sweep_at = std::max(floor, 2 * list.size());
}

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
  enum class Kind : uint8_t { kWrite, kNotice, kRecv, kWake } kind;
  RailWork work;
  Clock::time_point posted;
  int slot = -1;  // notice / receive buffer slot
  bool abandoned = false;
  static constexpr size_t kNotInFlight = ~size_t{0};
  size_t inflight_at = kNotInFlight;  // index in its rail's list of operations in flight
};

}  // namespace cleave::transfer
