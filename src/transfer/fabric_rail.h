// FabricRail: one endpoint of the transfer engine with its notice buffers and progress thread.
// Internal header. The rail's code is split by concept:
//   fabric_rail.cpp        life cycle: open, reopen, leak, peers, the progress thread, watchdog
//                          hooks
//   rail_posting.cpp       queueing, posting writes paced by the TX depth, sending notices
//   rail_completions.cpp   completions, completion errors, timeouts, one progress pass
// Every fabric call goes through a RailPort / RailEndpoint (rail_port.h).
#pragma once

#include <pthread.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "rail_port.h"
#include "transfer_internal.h"

namespace cleave::transfer {

// Nanoseconds of the steady clock, for time points kept in atomics.
// The calling thread's CPU-time clock (a clockid_t), or kNoCpuClock.
inline constexpr int64_t kNoCpuClock = INT64_MIN;
inline int64_t this_thread_cpu_clock() {
  thread_local const int64_t clock = [] {
    clockid_t c;
    return pthread_getcpuclockid(pthread_self(), &c) == 0 ? static_cast<int64_t>(c) : kNoCpuClock;
  }();
  return clock;
}

inline int64_t steady_ns(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// The bytes of a notice on the wire. `id` is unique per sending engine (0: none, as sent
// before ids existed; such a notice is never dropped as a copy).
struct NoticeWire {
  uint64_t magic;
  uint64_t from_engine;
  uint64_t tag;
  uint64_t id = 0;
  uint64_t value = 0;  // notify()'s value (the first token of an early Decode)
};

// The notices a rail received most recently, by (sender engine, notice id): a notice re-sent
// after its sender's rail was reopened (see FabricRail::reopen) may also have arrived the first
// time, and is handed over once. Copies arrive within the sender's reopen (milliseconds), far
// inside the window. Not thread-safe (the rail's progress lock guards it).
class NoticeDedup {
 public:
  // Larger than the notices a rail re-sends after a reopen (FabricRail::kResendMax) plus what
  // other senders send meanwhile.
  static constexpr size_t kWindow = 8192;
  // False when (engine, id) was seen within the last kWindow notices; id 0 is always new.
  bool first_time(uint64_t engine, uint64_t id);

 private:
  struct Key {
    uint64_t engine, id;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const { return std::hash<uint64_t>()(k.engine * 31 ^ k.id); }
  };
  std::unordered_set<Key, KeyHash> seen_;
  std::deque<Key> order_;
};
inline constexpr uint64_t kNoticeMagic = 0x31454349544f4e43ull;  // "CNOTICE1"
// A wake-up: "writes follow", so that a target whose provider reports no incoming writes
// (no FI_RMA_EVENT: tcp, verbs) polls hot for transfer.idle_poll_us instead of sleeping in
// fi_cq_sread, where every segment that arrives costs the sender a wake-up of the target.
inline constexpr uint64_t kWakeMagic = 0x3150554b41574343ull;  // "CCWAKUP1"

// Memory that posted operations point at: the notice buffers with their registrations and every
// operation context. It lives as long as any endpoint that may still use it, which is the whole
// process once an endpoint was left open on purpose.
struct RailStorage {
  static constexpr int kNoticeBytes = 64;
  static_assert(sizeof(NoticeWire) <= kNoticeBytes, "a notice fits its slot");
  static constexpr int kRecvSlots = 64;
  static constexpr int kSendSlots = 128;
  std::vector<char> recv_buf, send_buf;
  std::unique_ptr<RailMemory> recv_mr, send_mr;
  std::vector<std::unique_ptr<OpContext>> recv_ops;  // one per receive slot, reused
  std::vector<std::unique_ptr<OpContext>> op_store;  // every write/notice context ever made

  char* recv_slot(int slot) { return recv_buf.data() + static_cast<size_t>(slot) * kNoticeBytes; }
  char* send_slot(int slot) { return send_buf.data() + static_cast<size_t>(slot) * kNoticeBytes; }
};

// One endpoint with its CQ, AV, notice buffers and progress thread.
//
// Locking: every piece of endpoint state (the endpoint, the queues, in-flight operations, the
// peer addresses) is guarded by `progress_mu_`. Whoever holds it makes progress: the rail's own
// thread, a submitter posting its slices inline, or a thread waiting for a transfer. Nobody
// sleeps while holding it (the progress thread sleeps in RailEndpoint::wait or on a condition
// variable without it), and nobody blocks on it without a time limit: a thread can get stuck
// inside the provider while holding it (libfabric 1.17's shm spins forever on the region lock
// of a peer that was killed while holding it). The engine's watchdog sees that through
// busy_for() and replaces the rail (declare_stuck() fails its transfers; the rail object is
// then leaked).
//
// Pacing: at most the TX depth (the provider's, capped by transfer.max_inflight_per_rail, less
// 8 entries kept for notices when above 16) writes are in flight, and one peer holds at most
// three quarters of them. A post refused with -FI_EAGAIN is retried after progress; a peer
// whose posts stay refused, or whose operations see no completion, for completion_timeout_ms
// fails its transfers and is marked unreachable. A batch's notice is posted only after every
// one of its writes completed.
//
// Polling: one thread polls at a time. A waiter (TransferHandle::wait) drives the rail through
// try_progress() while its transfer runs, and the rail's own thread steps aside meanwhile;
// otherwise the rail's thread polls hot for transfer.idle_poll_us after its last activity and
// then sleeps. Where the endpoint counts no incoming writes (no FI_RMA_EVENT: tcp, verbs), a
// small wake-up message goes to a peer ahead of our writes (at most one per half hot window),
// so that the peer polls hot instead of sleeping in fi_cq_sread while the data arrives.
//
// Faults: a peer that stops answering (timeout, exited process, a connection error on tcp)
// gets the endpoint replaced (reopen()), and only that peer's operations fail: the writes and
// notices other peers had in flight are posted again on the new endpoint (writes are
// idempotent; a notice keeps its id and the receiving rail drops a second copy). The old
// endpoint is closed, except on shm when a peer in its AV has exited (closing it could spin on
// that peer's lock) or runs in this process (it would read the unmapped region): then it is
// kept open for the process.
class FabricRail {
 public:
  // `port` is this rail's view of its domain (make_libfabric_port, or a fake in tests);
  // `metrics` must outlive the rail; `on_notice` runs on whichever thread makes progress.
  FabricRail(int index, std::unique_ptr<RailPort> port, const TransferSettings& settings,
             MetricsCounters* metrics, bool delivery_complete,
             std::function<void(const Notice&)> on_notice);
  // Stops the thread and closes the endpoint, or keeps it (and everything it may point at)
  // open for the rest of the process when closing it is unsafe (shm with a dead peer).
  ~FabricRail();
  FabricRail(const FabricRail&) = delete;
  FabricRail& operator=(const FabricRail&) = delete;

  // Registers the notice buffers (keys from next_key(key_ctx)) and opens the endpoint.
  Status open(uint64_t engine_id, uint64_t (*next_key)(void*), void* key_ctx);
  void start();
  // Stops the progress thread; false when it did not stop within 2 s (stuck inside the
  // provider): the thread is then detached and the caller must leak this rail.
  bool stop();

  // This rail's current endpoint name (it changes when the rail is reopened).
  std::string name() const;
  // Inserts `peer` under endpoint name `name` into this rail's AV; a no-op when it is there
  // under that name already (re-inserts after a reopen of this rail, or when the peer's
  // endpoint was renamed by its own reopen). A reopen asked for by a connection error happens
  // here first (see reopen_wanted_). Waits for the progress lock as long as the watchdog
  // would (lock_from_outside); Unavailable when the rail is declared stuck meanwhile.
  Status insert_peer(const std::shared_ptr<PeerRecord>& peer, const std::string& name);
  // Queues work and posts what it can right away when the progress lock is free (thread-safe,
  // never blocks on a rail whose progress is stuck inside the provider). Work given to a rail
  // already declared stuck fails at once.
  void enqueue(std::vector<RailWork>&& work);
  // Like enqueue(), but a rail declared stuck refuses the work (returns false, `work` left as
  // it was) so that the caller can hand it to the rail's replacement.
  bool try_enqueue(std::vector<RailWork>& work);
  // One progress pass if the progress lock is free; returns the events handled (-1 if busy).
  // Called by threads that wait for a transfer: while one does, the rail's own thread backs off
  // (naps instead of polling), so that two pollers do not share the CPU the data movement needs.
  int try_progress();
  uint64_t max_msg_size() const { return max_msg_size_; }
  int index() const { return index_; }
  const char* provider_name() const { return provider_name_; }
  uint64_t reopens() const { return reopens_.load(std::memory_order_relaxed); }

  // How long the progress lock has been held by one holder without a break (zero when free).
  Clock::duration busy_for(Clock::time_point now) const;
  // When the current holder took the lock (steady clock, ns; 0 when free): names one holding.
  int64_t held_since_ns() const { return held_since_ns_.load(std::memory_order_relaxed); }
  // The CPU time the current holder's thread has used since it started (ns), or -1 when the
  // lock is free or that clock cannot be read. The watchdog tells a holder spinning inside the
  // provider from one an overloaded host does not schedule by it.
  int64_t holder_cpu_ns() const;
  // Watchdog only: the rail is stuck inside the provider. Fails with `why` every unfinished
  // transfer with work that reached the lock holder's state, marks the peer being posted to
  // (if known) unreachable, makes later enqueue() calls fail, asks the thread to exit if it
  // ever comes back, and returns the work still queued untouched (for the replacement rail).
  std::vector<RailWork> declare_stuck(const std::string& why);
  bool is_stuck() const { return stuck_.load(); }
  // The peer the lock holder is posting to right now (nullptr when none), for diagnostics.
  std::shared_ptr<PeerRecord> posting_to() const;

 private:
  // progress_mu_ held, stamped for busy_for(); used by every path that calls into the fabric.
  class Held;
  struct PeerSlot {
    std::weak_ptr<PeerRecord> peer;
    std::string name;
    fi_addr_t addr = FI_ADDR_NOTAVAIL;
    Clock::time_point woken;  // when the last wake-up went to this peer
  };

  // fabric_rail.cpp
  Status open_endpoint();
  void close_endpoint();
  void leak_endpoint();
  // shm: whether closing the endpoint could block or hurt a peer, because a peer in its AV has
  // exited (or, where its process cannot be checked, is marked unreachable), or lives in this
  // process (it would read our unmapped region).
  bool av_holds_gone_peer() const;
  void reopen();
  void run();
  // A waiter drove this rail within the last kDriverGrace: the thread steps aside.
  bool driven_recently(Clock::time_point now) const;
  void nap_while_driven();
  // Takes `lock` (on progress_mu_) for a caller outside the rail's passes (insert_peer). The
  // rail's own thread steps aside meanwhile, as it does for a waiter: a thread that blocked on
  // the lock would otherwise lose it, unlock after unlock, to the rail's polling loop on a
  // loaded host. A holder that keeps the lock is waited for as long as the watchdog would wait
  // before it declares the rail stuck. False when the rail is (or is then) declared stuck, or
  // when even that wait ran out.
  bool lock_from_outside(std::unique_lock<std::timed_mutex>& lock);
  void wake();
  // Called with tracked_mu_ held: remembers the transfers of `work` (a container of RailWork).
  template <class Work>
  void track(const Work& work) {
    sweep_finished(tracked_, &tracked_prune_at_, 4096);
    const TransferState* last = nullptr;
    for (const RailWork& w : work) {
      if (w.transfer.get() == last) continue;
      last = w.transfer.get();
      tracked_.push_back(w.transfer);
    }
  }
  bool has_work() const;
  fi_addr_t addr_of(PeerRecord* peer) const;
  // rail_posting.cpp
  int post(RailWork& w, fi_addr_t dest);
  void push_ready(RailWork&& w, bool front = false);  // keeps ready_peer_ true
  void post_ready();
  void post_deferred_notices();
  void send_notice_now(const std::shared_ptr<TransferState>& t);
  // Sends `slot` a wake-up unless one went out within half the hot window (or no send slot
  // is free: a wake-up is only a hint).
  void maybe_wake(PeerSlot& slot);
  // Sends `slot` a wake-up now: the operation (tracked in wakes_inflight_, slot.woken stamped),
  // or null with the fi_send result in `*rc` (send_wire).
  OpContext* send_wake(PeerSlot& slot, ssize_t* rc);
  // Connection-based providers: sends each peer in hellos_due_ a wake-up, which makes the
  // provider start the connection now instead of at the first write (see connects_).
  void send_hellos();
  // Posts `wire` from a free send slot as an operation of `kind` to `dest`: the operation, or
  // null with the fi_send result in `*rc` (-FI_EAGAIN also when no slot is free).
  OpContext* send_wire(OpContext::Kind kind, const NoticeWire& wire, fi_addr_t dest,
                       ssize_t* rc);
  Status post_recv(int slot);
  OpContext* new_op();
  void free_op(OpContext* op);
  void add_inflight(OpContext* op);
  // False when `op` is not in flight on this rail (released by a reopen).
  bool remove_inflight(OpContext* op);
  void set_posting_to(const std::shared_ptr<PeerRecord>& peer);
  // rail_completions.cpp
  int progress_once();  // holds progress_mu_
  int read_completions();
  // `now`: when the completion was read (one clock read per batch of completions).
  void handle_completion(OpContext* op, bool error, const std::string& error_text, int err,
                         Clock::time_point now);
  void check_timeouts();
  // Keeps a notice that completed on this endpoint for a re-send should the endpoint be
  // replaced soon (see sent_recently_).
  void remember_sent_notice(const std::shared_ptr<TransferState>& t, Clock::time_point now);
  // shm: whether an operation to another peer, posted by `since`, is still unanswered.
  bool held_back_by_other(PeerRecord* peer, Clock::time_point since) const;
  void abandon(OpContext* op, Status why, TransferErrorKind kind);
  void finish_write(OpContext* op);

  int index_;
  std::unique_ptr<RailPort> port_;
  const char* provider_name_;
  uint64_t max_msg_size_;
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
  std::atomic<int64_t> holder_clock_{kNoCpuClock};  // the current holder's CPU-time clock
  // The same instant as a time point, for the pass's own needs (posted-at stamps, liveness
  // cache, timeouts): one clock read per pass instead of one per write. Set by Held, and read
  // only under progress_mu_ (every post happens inside a Held pass).
  Clock::time_point pass_now_ = Clock::now();
  std::atomic<int64_t> driven_at_ns_{0};   // steady clock of the last try_progress() pass
  std::unique_ptr<RailEndpoint> ep_;        // null while out of service
  uint64_t remote_writes_seen_ = 0;
  int64_t last_read_ns_ = 0;  // steady clock of the last read_completions() pass
  // A submitter that posts inline also reads completions when nobody did for this long.
  static constexpr int64_t kSubmitterReadAfterNs = 20'000;
  bool cq_waitable_ = false;
  bool wake_peers_ = false;  // the endpoint does not count incoming writes: peers need wake-ups
  // The provider connects to a peer on the first message (ofi_rxm over tcp or verbs, efa's
  // handshake): the connection is started when the peer is inserted (a hello), so that it is
  // made while the first request queues and computes, not inside its first write's bound.
  bool connects_ = false;
  mutable std::mutex name_mu_;  // guards name_ (readable while the rail is stuck)
  std::string name_;
  size_t depth_ = 0;

  std::unique_ptr<RailStorage> storage_ = std::make_unique<RailStorage>();
  std::vector<int> free_send_slots_;
  std::vector<OpContext*> free_ops_;
  std::vector<std::unique_ptr<RailEndpoint>> leaked_;  // replaced, left open on purpose

  std::mutex sleep_mu_;  // the progress thread's nap when the CQ has no wait object
  std::condition_variable sleep_cv_;
  std::atomic<bool> sleeping_{false};
  std::chrono::microseconds driven_nap_{100};  // this thread's next nap while a waiter drives
  std::atomic<bool> stop_{false};
  std::atomic<bool> exited_{false};
  std::atomic<bool> stuck_{false};
  std::mutex incoming_mu_;  // guards incoming_: work queued while the progress lock was busy
  std::deque<RailWork> incoming_;
  // Set with incoming_mu_ held when work is queued (a pass takes that lock only then). Seen by
  // the rail's thread before it sleeps: the queuer bumps work_epoch_ after setting it.
  std::atomic<bool> incoming_queued_{false};
  std::atomic<uint64_t> reopens_{0};
  std::thread thread_;
  // Transfers with work in the lock holder's state, for declare_stuck() (which cannot take
  // progress_mu_). Lock order: incoming_mu_, then tracked_mu_.
  std::mutex tracked_mu_;
  std::vector<std::weak_ptr<TransferState>> tracked_;
  size_t tracked_prune_at_ = 4096;
  mutable std::mutex posting_mu_;
  std::shared_ptr<PeerRecord> posting_to_;  // set around each write / send post

  std::deque<RailWork> ready_;  // filled through push_ready()
  // The peer every item of ready_ is for, or nullptr when they are for several peers: a
  // refusal for that peer ends post_ready() at once instead of walking the whole queue.
  PeerRecord* ready_peer_ = nullptr;
  std::deque<std::shared_ptr<TransferState>> deferred_notices_;
  std::deque<std::shared_ptr<TransferState>> pending_notices_;  // waiting for a send slot
  // Writes and notices in flight, each at its OpContext::inflight_at (no allocation per post).
  std::vector<OpContext*> inflight_;
  std::unordered_set<OpContext*> wakes_inflight_;  // wake-ups (no transfer behind them)
  // Peers that get a wake-up as soon as a send slot and the provider take it, and since when
  // (a hello is dropped after completion_timeout_ms: the writes that follow will tell).
  std::vector<std::pair<PeerRecord*, Clock::time_point>> hellos_due_;
  std::vector<OpContext*> abandoned_;  // timed out, never completed by the provider
  std::unordered_map<PeerRecord*, Clock::time_point> last_completion_;
  size_t writes_inflight_ = 0;
  Clock::time_point last_timeout_check_ = Clock::now();
  Clock::time_point last_activity_ = Clock::now();  // last posted or completed operation
  // Peers whose last write the provider refused with -FI_EAGAIN: since when (a peer refused
  // for completion_timeout_ms fails), and how many of its writes were in flight then. While
  // none of those has completed, posting to it again would only be refused again (shm: 3
  // refusals per 4 KiB write, each behind the provider's lock), so post_ready() waits for one.
  struct Refusal {
    Clock::time_point since;
    size_t inflight = 0;
  };
  std::unordered_map<PeerRecord*, Refusal> eagain_since_;
  std::unordered_map<PeerRecord*, size_t> peer_inflight_;  // posted writes per peer
  std::unordered_map<PeerRecord*, PeerSlot> peers_;  // inserted into this rail's AV
  // Set on a timeout or (not shm) a connection error; the rail thread reopens, or
  // insert_peer() first where the rail is not shm.
  bool reopen_wanted_ = false;
  uint64_t notices_posted_ = 0;  // numbers this rail's notice ids
  NoticeDedup received_;         // notices handed over lately, to drop re-sent copies
  // Notices that completed on this endpoint within min(completion_timeout_ms, 1 s) (at most
  // kResendMax): a completed send is not always at the peer (tcp;ofi_rxm completes a small
  // message once it is buffered, and closing the endpoint resets its connections, which drops
  // what is still buffered at either end), so reopen() sends them again to the live peers.
  struct SentNotice {
    std::weak_ptr<PeerRecord> peer;
    uint64_t tag = 0, id = 0;
    Clock::time_point at;
  };
  static constexpr int64_t kResendWindowMs = 1000;
  static constexpr size_t kResendMax = 1024;
  std::deque<SentNotice> sent_recently_;
  std::atomic<uint64_t> work_epoch_{0};  // bumped by enqueue(), read before the thread sleeps
  bool wake_pending_ = false;            // guarded by sleep_mu_
};

// The watchdog's verdict on one holding of a rail's progress lock, held for `busy`, whose
// holder used `cpu_used_ns` of CPU since the watchdog first saw it busy (-1: unknown): stuck
// inside the provider once held past `bound` while spinning (half of the bound on the CPU) or
// with the CPU time unknown, and once held kStuckWallFactor times the bound however little CPU
// it used (blocked in the kernel). A holder that an overloaded host merely does not schedule
// uses no CPU: it is waited for that long, not declared stuck.
inline constexpr int kStuckWallFactor = 10;
inline bool holding_looks_stuck(Clock::duration busy, int64_t cpu_used_ns,
                                std::chrono::milliseconds bound) {
  if (busy <= bound) return false;
  if (cpu_used_ns < 0 || busy > bound * kStuckWallFactor) return true;
  return std::chrono::nanoseconds(cpu_used_ns) * 2 >= bound;
}

// The bound of holding_looks_stuck() under `settings` (the engine's watchdog uses it).
inline std::chrono::milliseconds stuck_bound(const TransferSettings& settings) {
  return std::chrono::milliseconds(
      std::max<int64_t>(50, std::min<int64_t>(settings.completion_timeout_ms, 1000)));
}

// Keeps `rail` (a rail whose thread is, or may be, stuck inside the provider) for the rest of the
// process, reachable from a global so that nothing it points at is freed and a leak checker
// sees it as reachable rather than lost.
void keep_rail_forever(std::shared_ptr<FabricRail> rail);

// Stamps the progress lock's holder for busy_for(); constructed right after taking the lock.
class FabricRail::Held {
 public:
  explicit Held(FabricRail* rail) : Held(rail, steady_ns(Clock::now())) {}
  Held(FabricRail* rail, int64_t now_ns) : rail_(rail) {
    rail_->holder_clock_.store(this_thread_cpu_clock(), std::memory_order_relaxed);
    rail_->held_since_ns_.store(now_ns, std::memory_order_relaxed);
    rail_->pass_now_ = Clock::time_point(std::chrono::nanoseconds(now_ns));
  }
  ~Held() { rail_->held_since_ns_.store(0, std::memory_order_relaxed); }
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;

 private:
  FabricRail* rail_;
};

}  // namespace cleave::transfer
