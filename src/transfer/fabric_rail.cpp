// FabricRail's life cycle: buffers and endpoint, reopen after a peer stopped answering, the
// endpoints left open on purpose, peers in the AV, the progress thread and the watchdog's hooks.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "cleave/common/log.h"
#include "fabric_rail.h"
#include "fmt/format.h"

namespace cleave::transfer {

namespace {

// How long after a waiter's last progress pass the rail's own thread keeps backing off, and
// its first nap meanwhile. Each nap after which a waiter is still driving is twice as long, up
// to kDriverNapMax: on a machine with few cores every wake-up of this thread preempts the
// waiter (4 KiB writes over shm: 0.86 GB/s with 100 us naps, 1.1 GB/s with 1 ms). Work that
// nobody waits for therefore waits at most kDriverNapMax for this thread once the waiter left.
constexpr std::chrono::microseconds kDriverGrace{100};
constexpr std::chrono::microseconds kDriverNapMax{1000};

// Endpoints left open on purpose, with the storage they may still write into or hand back as
// contexts. Reachable from a global for the rest of the process, so that nothing they point
// at is ever freed (and a leak checker sees it all as reachable).
struct KeptForever {
  std::mutex mu;
  std::vector<std::unique_ptr<RailEndpoint>> endpoints;
  std::vector<std::unique_ptr<RailStorage>> storage;
  std::vector<std::shared_ptr<FabricRail>> rails;
};
KeptForever* const kept_forever = new KeptForever;

void keep_forever(std::vector<std::unique_ptr<RailEndpoint>>&& endpoints,
                  std::unique_ptr<RailStorage> storage) {
  std::lock_guard<std::mutex> lock(kept_forever->mu);
  for (auto& ep : endpoints) kept_forever->endpoints.push_back(std::move(ep));
  kept_forever->storage.push_back(std::move(storage));
}

}  // namespace

void keep_rail_forever(std::shared_ptr<FabricRail> rail) {
  std::lock_guard<std::mutex> lock(kept_forever->mu);
  kept_forever->rails.push_back(std::move(rail));
}

bool PeerRecord::alive() const {
  if (!same_host || pid <= 0) return true;
  if (gone_.load(std::memory_order_relaxed)) return false;
  alive_checked_ns_.store(steady_ns(Clock::now()), std::memory_order_relaxed);
  if (::kill(pid, 0) == 0 || errno != ESRCH) return true;
  gone_.store(true, std::memory_order_relaxed);
  return false;
}

bool PeerRecord::probably_alive(int64_t now_ns) const {
  if (!same_host || pid <= 0) return true;
  if (gone_.load(std::memory_order_relaxed)) return false;
  if (now_ns - alive_checked_ns_.load(std::memory_order_relaxed) <
      kAliveRecheckNs) {
    return true;
  }
  return alive();
}

FabricRail::FabricRail(int index, std::unique_ptr<RailPort> port,
                       const TransferSettings& settings, MetricsCounters* metrics,
                       bool delivery_complete, std::function<void(const Notice&)> on_notice)
    : index_(index), port_(std::move(port)), provider_name_(port_->provider_name()),
      max_msg_size_(port_->max_msg_size()), settings_(settings), metrics_(metrics),
      delivery_complete_(delivery_complete),
      leak_on_reopen_(std::strncmp(provider_name_, "shm", 3) == 0),
      on_notice_(std::move(on_notice)) {}

FabricRail::~FabricRail() {
  (void)stop();
  bool dead_peer = false;
  for (auto& [key, slot] : peers_) {
    auto peer = slot.peer.lock();
    if (peer && slot.addr != FI_ADDR_NOTAVAIL && (peer->unreachable.load() || !peer->alive())) {
      dead_peer = true;
    }
  }
  if (leak_on_reopen_ && dead_peer) {
    leak_endpoint();
  } else {
    close_endpoint();
  }
  if (!leaked_.empty()) {
    log::warn("transfer rail {} ({}): {} endpoint(s) left open on purpose (their AV held a peer "
              "that died)", index_, provider_name(), leaked_.size());
    keep_forever(std::move(leaked_), std::move(storage_));
  }
}

Status FabricRail::open(uint64_t engine_id, uint64_t (*next_key)(void*), void* key_ctx) {
  engine_id_ = engine_id;
  depth_ = port_->tx_depth() ? port_->tx_depth() : 128;
  if (settings_.max_inflight_per_rail > 0) {
    depth_ = std::min<size_t>(depth_, static_cast<size_t>(settings_.max_inflight_per_rail));
  }
  // Notices need send credits too; keep a few TX entries for them.
  if (depth_ > 16) depth_ -= 8;

  RailStorage& st = *storage_;
  st.recv_buf.assign(static_cast<size_t>(RailStorage::kRecvSlots) * RailStorage::kNoticeBytes, 0);
  st.send_buf.assign(static_cast<size_t>(RailStorage::kSendSlots) * RailStorage::kNoticeBytes, 0);
  auto recv_mr = port_->register_buffer(st.recv_buf.data(), st.recv_buf.size(), FI_RECV,
                                        next_key(key_ctx));
  if (!recv_mr.ok()) return Internal(fmt::format("rail {}: {}", index_, recv_mr.status().message()));
  st.recv_mr = std::move(recv_mr).value();
  auto send_mr = port_->register_buffer(st.send_buf.data(), st.send_buf.size(), FI_SEND,
                                        next_key(key_ctx));
  if (!send_mr.ok()) return Internal(fmt::format("rail {}: {}", index_, send_mr.status().message()));
  st.send_mr = std::move(send_mr).value();
  for (int i = 0; i < RailStorage::kRecvSlots; ++i) {
    auto op = std::make_unique<OpContext>();
    op->kind = OpContext::Kind::kRecv;
    op->slot = i;
    st.recv_ops.push_back(std::move(op));
  }
  std::lock_guard<std::timed_mutex> lock(progress_mu_);
  return open_endpoint();
}

// A fresh endpoint with every receive posted. Called with progress_mu_ held (or before start()).
Status FabricRail::open_endpoint() {
  cq_waitable_ = false;
  auto ep = port_->open_endpoint(index_);
  if (!ep.ok()) return ep.status();
  ep_ = std::move(ep).value();
  cq_waitable_ = ep_->waitable();
  wake_peers_ = !ep_->counts_remote_writes();
  const std::string_view prov = port_->provider_name();
  connects_ = prov.find("ofi_rxm") != std::string_view::npos || prov == "efa";
  {
    std::lock_guard<std::mutex> nlock(name_mu_);
    name_ = ep_->name();
  }
  free_send_slots_.clear();
  for (int i = RailStorage::kSendSlots - 1; i >= 0; --i) free_send_slots_.push_back(i);
  for (int i = 0; i < RailStorage::kRecvSlots; ++i) CLEAVE_RETURN_IF_ERROR(post_recv(i));
  return Status::Ok();
}

void FabricRail::leak_endpoint() {
  if (ep_) leaked_.push_back(std::move(ep_));
}

void FabricRail::close_endpoint() { ep_.reset(); }

bool FabricRail::av_holds_gone_peer() const {
  for (const auto& [key, slot] : peers_) {
    if (slot.addr == FI_ADDR_NOTAVAIL) continue;
    auto peer = slot.peer.lock();
    if (!peer) return true;  // nothing left to ask: assume the worst
    if (peer->same_host ? !peer->alive() : peer->unreachable.load()) return true;
    // A peer engine in this very process reads our region through the same address space:
    // unmapping it under that engine crashes it (seen with two engines in one test process).
    if (peer->same_host && peer->pid == ::getpid()) return true;
  }
  return false;
}

bool NoticeDedup::first_time(uint64_t engine, uint64_t id) {
  if (id == 0) return true;
  if (!seen_.insert(Key{engine, id}).second) return false;
  order_.push_back(Key{engine, id});
  if (order_.size() > kWindow) {
    seen_.erase(order_.front());
    order_.pop_front();
  }
  return true;
}

// A peer stopped completing operations (or, on tcp, broke its connection); some providers
// (shm in libfabric 1.17) then never complete them and may stall the endpoint for every peer,
// and ofi_rxm keeps the broken connection for good. Replace the endpoint: the abandoned
// operations die with it (their TX credits come back), and only the faulty peers' work fails.
// Writes in flight to the others are posted again on the new endpoint (RMA writes are
// idempotent), their notices in flight are sent again with the same id (the receiver drops
// the copy when the first one did arrive), and live peers are inserted into the new AV.
void FabricRail::reopen() {
  reopens_.fetch_add(1, std::memory_order_relaxed);
  // shm (1.17): closing the old AV unmaps every peer from it, which spins on the lock of a peer
  // that died holding it: keep such an endpoint open for the process. With every peer alive
  // (a write refused with a revoked key ends as a timeout of a live peer) it is closed, so that
  // faults do not pile up endpoints and their shared-memory regions.
  const bool leak = leak_on_reopen_ && av_holds_gone_peer();
  log::warn("transfer rail {} ({}): reopening the endpoint ({} operation(s) to unresponsive "
            "peers abandoned, {} operation(s) to others posted again; the old endpoint is {})",
            index_, provider_name(), abandoned_.size(), inflight_.size(),
            leak ? "kept open for the process (a peer in its AV has exited or runs in this "
                   "process)"
                 : "closed");
  if (leak) {
    leak_endpoint();
  } else {
    close_endpoint();
  }
  for (OpContext* op : abandoned_) free_op(op);
  abandoned_.clear();
  std::vector<RailWork> again;
  std::vector<std::shared_ptr<TransferState>> notices_again;
  for (OpContext* op : inflight_) {
    if (op->kind == OpContext::Kind::kWrite) {
      again.push_back(std::move(op->work));
    } else if (!op->work.transfer->is_done()) {
      // A notice to the faulty peer fails in send_notice_now (the peer is unreachable).
      notices_again.push_back(op->work.transfer);
    }
    free_op(op);
  }
  inflight_.clear();
  for (OpContext* op : wakes_inflight_) free_op(op);
  wakes_inflight_.clear();
  hellos_due_.clear();
  writes_inflight_ = 0;
  peer_inflight_.clear();
  eagain_since_.clear();
  last_completion_.clear();
  Status s = open_endpoint();
  if (!s.ok()) {
    log::error("transfer rail {}: reopen failed, the rail is out of service: {}", index_,
               s.message());
    close_endpoint();
  }
  std::erase_if(peers_, [](const auto& kv) { return kv.second.peer.expired(); });
  for (auto& [key, slot] : peers_) {
    auto peer = slot.peer.lock();
    fi_addr_t addr = FI_ADDR_NOTAVAIL;
    if (ep_ && peer && !peer->unreachable.load() && peer->alive()) {
      if (ep_->av_insert(slot.name, &addr) != 1) addr = FI_ADDR_NOTAVAIL;
    }
    slot.addr = addr;
    // The new endpoint has no connections: the live peers' are made again at once.
    if (connects_ && addr != FI_ADDR_NOTAVAIL) hellos_due_.emplace_back(key, pass_now_);
  }
  for (auto it = again.rbegin(); it != again.rend(); ++it) push_ready(std::move(*it), true);
  // Their batches' writes had all completed: they go out with the next pass, ahead of notices
  // that were waiting for a send slot.
  for (auto it = notices_again.rbegin(); it != notices_again.rend(); ++it) {
    pending_notices_.push_front(std::move(*it));
  }
  // Notices that completed lately may still have been buffered in the closed endpoint: send
  // copies (same id; the receiver drops a second one). Nobody waits for a copy, and it counts
  // in no metric.
  size_t copies = 0;
  for (const SentNotice& n : sent_recently_) {
    auto peer = n.peer.lock();
    if (!peer || peer->unreachable.load() || !peer->alive()) continue;
    auto copy = std::make_shared<TransferState>();
    copy->peer = std::move(peer);
    copy->notify_tag = n.tag;
    copy->notice_id = n.id;
    pending_notices_.push_back(std::move(copy));
    ++copies;
  }
  sent_recently_.clear();
  if (copies > 0) {
    log::info("transfer rail {}: {} notice(s) that completed lately sent again on the new "
              "endpoint", index_, copies);
  }
}

std::string FabricRail::name() const {
  std::lock_guard<std::mutex> lock(name_mu_);
  return name_;
}

fi_addr_t FabricRail::addr_of(PeerRecord* peer) const {
  auto it = peers_.find(peer);
  return it == peers_.end() ? FI_ADDR_NOTAVAIL : it->second.addr;
}

bool FabricRail::lock_from_outside(std::unique_lock<std::timed_mutex>& lock) {
  const auto deadline = Clock::now() + stuck_bound(settings_) * kStuckWallFactor +
                        std::chrono::milliseconds(settings_.completion_timeout_ms);
  for (;;) {
    if (stuck_.load()) return false;
    const auto now = Clock::now();
    driven_at_ns_.store(steady_ns(now), std::memory_order_relaxed);
    if (lock.try_lock_for(kDriverGrace / 2)) return !stuck_.load();
    if (now >= deadline) return false;
  }
}

Status FabricRail::insert_peer(const std::shared_ptr<PeerRecord>& peer, const std::string& name) {
  std::unique_lock<std::timed_mutex> lock(progress_mu_, std::defer_lock);
  if (!lock_from_outside(lock)) {
    return Unavailable(fmt::format("rail {} ({}) is stuck inside the provider; it is being "
                                   "replaced, connect again", index_, provider_name()));
  }
  Held held(this);
  // A connection error asked for a fresh endpoint (tcp;ofi_rxm): make it before the caller's
  // next batch, which would otherwise go out on the broken connection.
  if (reopen_wanted_ && !leak_on_reopen_) {
    reopen_wanted_ = false;
    reopen();
  }
  PeerSlot& slot = peers_[peer.get()];
  if (slot.peer.expired() || slot.name != name) {
    slot.peer = peer;
    slot.name = name;  // the AV keeps a stale entry; it is never used again
    slot.addr = FI_ADDR_NOTAVAIL;
  }
  if (slot.addr != FI_ADDR_NOTAVAIL) return Status::Ok();
  if (!ep_) return Unavailable(fmt::format("rail {} is out of service (its reopen failed)", index_));
  fi_addr_t addr = FI_ADDR_NOTAVAIL;
  int got = ep_->av_insert(name, &addr);
  if (got != 1) {
    return Unavailable(fmt::format("rail {}: fi_av_insert of the address of peer {:016x} ({} "
                                   "bytes) failed ({})", index_, peer->engine_id, name.size(),
                                   got < 0 ? fi_strerror(-got) : "0 inserted"));
  }
  slot.addr = addr;
  if (connects_) {
    hellos_due_.emplace_back(peer.get(), pass_now_);
    send_hellos();
  }
  return Status::Ok();
}

void FabricRail::start() {
  thread_ = std::thread([this] {
    std::string tname = fmt::format("xfer-rail{}", index_);
    pthread_setname_np(pthread_self(), tname.c_str());
    run();
  });
}

bool FabricRail::stop() {
  if (!thread_.joinable()) return true;
  stop_.store(true);
  {
    std::lock_guard<std::mutex> lock(sleep_mu_);
    wake_pending_ = true;
  }
  sleep_cv_.notify_one();
  std::unique_lock<std::timed_mutex> lock(progress_mu_, std::defer_lock);
  if (lock.try_lock()) {
    if (cq_waitable_ && ep_) ep_->signal();
    lock.unlock();
  }
  for (int i = 0; i < 200 && !exited_.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!exited_.load()) {
    log::error("transfer rail {} ({}): the progress thread is stuck inside the provider (a "
               "peer died holding a shared lock?); leaving it and its endpoint behind",
               index_, provider_name());
    thread_.detach();
    return false;
  }
  thread_.join();
  return true;
}

void FabricRail::wake() {
  {
    std::lock_guard<std::mutex> lock(sleep_mu_);
    wake_pending_ = true;
  }
  sleep_cv_.notify_one();
  // Never block here: a holder of the lock makes progress anyway (or is stuck).
  std::unique_lock<std::timed_mutex> lock(progress_mu_, std::try_to_lock);
  if (lock.owns_lock() && cq_waitable_ && ep_) ep_->signal();
}

Clock::duration FabricRail::busy_for(Clock::time_point now) const {
  int64_t since = held_since_ns_.load(std::memory_order_relaxed);
  if (since == 0) return Clock::duration::zero();
  return std::chrono::nanoseconds(std::max<int64_t>(0, steady_ns(now) - since));
}

int64_t FabricRail::holder_cpu_ns() const {
  if (held_since_ns_.load(std::memory_order_relaxed) == 0) return -1;
  const int64_t clock = holder_clock_.load(std::memory_order_relaxed);
  timespec ts{};
  // A holder that has let go meanwhile, even one whose thread has exited: EINVAL, or some
  // thread's time, read once as a new holding's start.
  if (clock == kNoCpuClock || clock_gettime(static_cast<clockid_t>(clock), &ts) != 0) return -1;
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

std::shared_ptr<PeerRecord> FabricRail::posting_to() const {
  std::lock_guard<std::mutex> lock(posting_mu_);
  return posting_to_;
}

std::vector<RailWork> FabricRail::declare_stuck(const std::string& why) {
  std::vector<std::weak_ptr<TransferState>> victims;
  std::vector<RailWork> untouched;
  {
    std::lock_guard<std::mutex> ilock(incoming_mu_);
    std::lock_guard<std::mutex> lock(tracked_mu_);
    stuck_.store(true);
    victims.swap(tracked_);
    for (auto& w : incoming_) untouched.push_back(std::move(w));
    incoming_.clear();
  }
  stop_.store(true);
  if (auto peer = posting_to()) peer->unreachable.store(true);
  for (auto& w : victims) {
    if (auto t = w.lock()) t->finish(Unavailable(why), TransferErrorKind::kTimeout);
  }
  std::erase_if(untouched, [](const RailWork& w) { return w.transfer->is_done(); });
  return untouched;
}

bool FabricRail::has_work() const {
  return !inflight_.empty() || !ready_.empty() || !deferred_notices_.empty() ||
         !pending_notices_.empty() || !abandoned_.empty() || !hellos_due_.empty();
}

bool FabricRail::driven_recently(Clock::time_point now) const {
  return steady_ns(now) - driven_at_ns_.load(std::memory_order_relaxed) <
         std::chrono::nanoseconds(kDriverGrace).count();
}

void FabricRail::nap_while_driven() {
  std::unique_lock<std::mutex> lock(sleep_mu_);
  sleep_cv_.wait_for(lock, driven_nap_, [&] { return wake_pending_ || stop_.load(); });
  wake_pending_ = false;
  driven_nap_ = std::min<std::chrono::microseconds>(2 * driven_nap_, kDriverNapMax);
}

void FabricRail::run() {
  int idle_passes = 0;
  const auto hot_window = std::chrono::microseconds(std::max<int64_t>(0, settings_.idle_poll_us));
  while (!stop_.load(std::memory_order_relaxed)) {
    int n;
    bool busy;
    Clock::time_point last_activity;
    uint64_t epoch = work_epoch_.load();
    {
      // While a waiter drives the rail, only look in when the lock is free: blocking on it
      // would make every unlock of the waiter's pass a futex wake-up of this thread.
      std::unique_lock<std::timed_mutex> lock(progress_mu_, std::defer_lock);
      if (driven_recently(Clock::now())) {
        if (!lock.try_lock()) {
          nap_while_driven();
          continue;
        }
      } else {
        lock.lock();
        driven_nap_ = kDriverGrace;
      }
      Held held(this);
      if (reopen_wanted_) {
        reopen_wanted_ = false;
        reopen();
      }
      n = progress_once();
      busy = has_work();
      if (ep_) {
        uint64_t seen = ep_->remote_writes();
        if (seen != remote_writes_seen_) {
          remote_writes_seen_ = seen;
          last_activity_ = Clock::now();
        }
      }
      if (n > 0) last_activity_ = Clock::now();
      last_activity = last_activity_;
    }
    auto now = Clock::now();
    if (n > 0) idle_passes = 0;
    // A waiter drives this rail (TransferHandle::wait): leave the polling to it and only look in
    // now and then (for reopens and for the moment it stops). On a machine with few cores a
    // second poller would take CPU time from the data movement itself.
    if (driven_recently(now)) {
      nap_while_driven();
      continue;
    }
    if (n > 0) continue;
    // Poll hot for a while after the last activity (posted or completed operation, received
    // notice or wake-up, writes into this process where the provider counts them): providers
    // with manual progress (tcp, shm) move data only while somebody polls, a peer's next write
    // usually follows soon, and a target asleep in fi_cq_sread costs every sender's segment a
    // wake-up.
    if (now - last_activity < hot_window) {
      std::this_thread::yield();
      continue;
    }
    if (busy && ++idle_passes < 64) {
      std::this_thread::yield();
      continue;
    }
    idle_passes = 0;
    sleeping_.store(true);
    if (work_epoch_.load() != epoch) {
      sleeping_.store(false);
      continue;
    }
    if (cq_waitable_ && ep_) {
      // The provider progresses inside the wait; the endpoint outlives this call because only
      // this thread reopens the rail. Completions are handled under the lock afterwards.
      fi_cq_data_entry entries[16];
      ssize_t got = ep_->wait(entries, 16, busy ? 1 : 20);
      sleeping_.store(false);
      if (got > 0) {
        std::lock_guard<std::timed_mutex> lock(progress_mu_);
        Held held(this);
        const auto now = Clock::now();
        for (ssize_t i = 0; i < got; ++i) {
          handle_completion(reinterpret_cast<OpContext*>(entries[i].op_context), false, {}, 0,
                            now);
        }
      }
    } else {
      // No fd to sleep on: nap briefly (a target must keep progressing for incoming writes on
      // providers with manual progress). Submitters and waiters drive progress themselves.
      std::unique_lock<std::mutex> lock(sleep_mu_);
      sleep_cv_.wait_for(lock, std::chrono::microseconds(busy ? 20 : 100),
                         [&] { return wake_pending_ || stop_.load(); });
      wake_pending_ = false;
      sleeping_.store(false);
    }
  }
  if (!stuck_.load()) {
    std::lock_guard<std::timed_mutex> lock(progress_mu_);
    for (OpContext* op : abandoned_) free_op(op);
    abandoned_.clear();
  }
  exited_.store(true);
}

}  // namespace cleave::transfer
