// One rail: an RDM endpoint, its completion queue and address vector, the buffers for notices,
// and the progress thread. Progress is made by whoever holds the rail's progress lock.
#include <pthread.h>
#include <signal.h>

#include <cerrno>

#include <cstring>

#include "cleave/common/log.h"
#include "fmt/format.h"
#include "transfer_internal.h"

namespace cleave::transfer {

namespace {

struct NoticeWire {
  uint64_t magic;
  uint64_t from_engine;
  uint64_t tag;
};
constexpr uint64_t kNoticeMagic = 0x31454349544f4e43ull;  // "CNOTICE1"

bool is_connection_error(int err) {
  switch (err) {
    case FI_ECONNREFUSED: case FI_ECONNRESET: case FI_ECONNABORTED: case FI_ENOTCONN:
    case FI_EHOSTUNREACH: case FI_ENETUNREACH: case FI_EIO: case FI_ESHUTDOWN:
    case FI_ENOENT: case FI_ETIMEDOUT: case FI_EADDRNOTAVAIL:
      return true;
    default:
      return false;
  }
}

int64_t steady_ns(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

}  // namespace

// Stamps the progress lock's holder for busy_for(); constructed right after taking the lock.
class FabricRail::Held {
 public:
  explicit Held(FabricRail* rail) : rail_(rail) {
    rail_->held_since_ns_.store(steady_ns(Clock::now()), std::memory_order_relaxed);
  }
  ~Held() { rail_->held_since_ns_.store(0, std::memory_order_relaxed); }
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;

 private:
  FabricRail* rail_;
};

bool PeerRecord::alive() const {
  if (!same_host || pid <= 0) return true;
  return ::kill(pid, 0) == 0 || errno != ESRCH;
}

FabricRail::FabricRail(int index, fid_fabric* fabric, fid_domain* domain, fi_info* info,
                       const TransferSettings& settings, MetricsCounters* metrics,
                       bool delivery_complete, std::function<void(const Notice&)> on_notice)
    : index_(index), fabric_(fabric), domain_(domain), info_(info), settings_(settings),
      metrics_(metrics), delivery_complete_(delivery_complete),
      leak_on_reopen_(std::strncmp(info->fabric_attr->prov_name, "shm", 3) == 0),
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
    // The leaked endpoints still reference the notice buffers and contexts: keep them.
    log::warn("transfer rail {} ({}): {} endpoint(s) left open on purpose (their AV held a peer "
              "that died)", index_, provider_name(), leaked_.size());
    return;
  }
  for (OpContext* op : recv_ops_) delete op;
  if (recv_mr_) fi_close(&recv_mr_->fid);
  if (send_mr_) fi_close(&send_mr_->fid);
}

Status FabricRail::open(uint64_t engine_id, uint64_t (*next_key)(void*), void* key_ctx) {
  engine_id_ = engine_id;
  depth_ = info_->tx_attr->size ? info_->tx_attr->size : 128;
  if (settings_.max_inflight_per_rail > 0) {
    depth_ = std::min<size_t>(depth_, static_cast<size_t>(settings_.max_inflight_per_rail));
  }
  // Notices need send credits too; keep a few TX entries for them.
  if (depth_ > 16) depth_ -= 8;

  recv_buf_.assign(static_cast<size_t>(kRecvSlots) * kNoticeBytes, 0);
  send_buf_.assign(static_cast<size_t>(kSendSlots) * kNoticeBytes, 0);
  int rc = fi_mr_reg(domain_, recv_buf_.data(), recv_buf_.size(), FI_RECV, 0, next_key(key_ctx),
                     0, &recv_mr_, nullptr);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_mr_reg(notice recv)", index_), rc));
  rc = fi_mr_reg(domain_, send_buf_.data(), send_buf_.size(), FI_SEND, 0, next_key(key_ctx), 0,
                 &send_mr_, nullptr);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_mr_reg(notice send)", index_), rc));
  for (int i = 0; i < kRecvSlots; ++i) {
    auto* op = new OpContext{};
    op->kind = OpContext::Kind::kRecv;
    op->slot = i;
    recv_ops_.push_back(op);
  }
  std::lock_guard<std::timed_mutex> lock(progress_mu_);
  return open_endpoint();
}

// CQ, AV and endpoint; receives posted. Called with progress_mu_ held (or before start()).
Status FabricRail::open_endpoint() {
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.wait_obj = FI_WAIT_UNSPEC;
  cq_attr.size = 0;
  cq_waitable_ = false;
  int rc = fi_cq_open(domain_, &cq_attr, &cq_, nullptr);
  if (rc == 0) {
    // Only a wait object backed by a file descriptor sleeps until the provider has work (shm's
    // yield-based waits would neither sleep nor progress); otherwise poll the CQ.
    int fd = -1;
    cq_waitable_ = fi_control(&cq_->fid, FI_GETWAIT, &fd) == 0;
    if (!cq_waitable_) {
      fi_close(&cq_->fid);
      cq_ = nullptr;
    }
  }
  if (!cq_waitable_) {
    cq_attr.wait_obj = FI_WAIT_NONE;
    rc = fi_cq_open(domain_, &cq_attr, &cq_, nullptr);
    if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_cq_open", index_), rc));
  }
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  rc = fi_av_open(domain_, &av_attr, &av_, nullptr);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_av_open", index_), rc));
  rc = fi_endpoint(domain_, info_, &ep_, nullptr);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_endpoint", index_), rc));
  rc = fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_ep_bind(cq)", index_), rc));
  rc = fi_ep_bind(ep_, &av_->fid, 0);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_ep_bind(av)", index_), rc));
  if (info_->caps & FI_RMA_EVENT) {
    fi_cntr_attr cattr{};
    cattr.events = FI_CNTR_EVENTS_COMP;
    cattr.wait_obj = FI_WAIT_NONE;
    rc = fi_cntr_open(domain_, &cattr, &remote_writes_, nullptr);
    if (rc == 0) rc = fi_ep_bind(ep_, &remote_writes_->fid, FI_REMOTE_WRITE);
    if (rc) {
      log::warn("rail {}: no remote-write counter ({}); an idle target naps between polls",
                index_, fi_strerror(-rc));
      if (remote_writes_) fi_close(&remote_writes_->fid);
      remote_writes_ = nullptr;
    }
  }
  rc = fi_enable(ep_);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_enable", index_), rc));

  char name[512];
  size_t len = sizeof(name);
  rc = fi_getname(&ep_->fid, name, &len);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_getname", index_), rc));
  {
    std::lock_guard<std::mutex> nlock(name_mu_);
    name_.assign(name, len);
  }

  free_send_slots_.clear();
  for (int i = kSendSlots - 1; i >= 0; --i) free_send_slots_.push_back(i);
  for (int i = 0; i < kRecvSlots; ++i) CLEAVE_RETURN_IF_ERROR(post_recv(i));
  return Status::Ok();
}

void FabricRail::leak_endpoint() {
  if (ep_ || av_ || cq_) leaked_.push_back({ep_, av_, cq_});
  remote_writes_ = nullptr;  // bound to the leaked endpoint
  ep_ = nullptr;
  av_ = nullptr;
  cq_ = nullptr;
}

void FabricRail::close_endpoint() {
  if (ep_) fi_close(&ep_->fid);
  if (remote_writes_) fi_close(&remote_writes_->fid);
  remote_writes_ = nullptr;
  if (av_) fi_close(&av_->fid);
  if (cq_) fi_close(&cq_->fid);
  ep_ = nullptr;
  av_ = nullptr;
  cq_ = nullptr;
}

// A peer stopped completing operations; some providers (shm in libfabric 1.17) then never
// complete them and may stall the endpoint for every peer. Replace the endpoint: the abandoned
// operations die with it (their TX credits come back), live writes are posted again on the new
// endpoint (RMA writes are idempotent), notices in flight fail (they may or may not have
// arrived), and live peers are inserted into the new AV.
void FabricRail::reopen() {
  reopens_.fetch_add(1, std::memory_order_relaxed);
  log::warn("transfer rail {} ({}): reopening the endpoint ({} operation(s) to unresponsive "
            "peers abandoned, {} live operation(s) re-posted)",
            index_, provider_name(), abandoned_.size(), inflight_.size());
  // shm (1.17): closing the old AV unmaps every peer from it, which spins on the lock of a peer
  // that died holding it and can crash a live peer that still reads our old region: leak it.
  if (leak_on_reopen_) {
    leak_endpoint();
  } else {
    close_endpoint();
  }
  for (OpContext* op : abandoned_) free_op(op);
  abandoned_.clear();
  std::vector<RailWork> again;
  for (OpContext* op : inflight_) {
    if (op->kind == OpContext::Kind::kWrite) {
      again.push_back(std::move(op->work));
    } else {
      auto t = op->work.transfer;
      t->finish(Unavailable(fmt::format("notice to peer {:016x} was in flight when rail {} was "
                                        "reopened after another peer stopped answering; it may "
                                        "or may not have arrived", t->peer->engine_id, index_)),
                TransferErrorKind::kCompletionError);
    }
    free_op(op);
  }
  inflight_.clear();
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
    if (av_ && !peer->unreachable.load() && peer->alive()) {
      if (fi_av_insert(av_, slot.name.data(), 1, &addr, 0, nullptr) != 1) addr = FI_ADDR_NOTAVAIL;
    }
    slot.addr = addr;
  }
  for (auto it = again.rbegin(); it != again.rend(); ++it) ready_.push_front(std::move(*it));
}

Status FabricRail::post_recv(int slot) {
  OpContext* op = recv_ops_[static_cast<size_t>(slot)];
  void* buf = recv_buf_.data() + static_cast<size_t>(slot) * kNoticeBytes;
  for (;;) {
    ssize_t rc = fi_recv(ep_, buf, kNoticeBytes, fi_mr_desc(recv_mr_), FI_ADDR_UNSPEC, &op->ctx);
    if (rc == 0) return Status::Ok();
    if (rc != -FI_EAGAIN) {
      return Internal(fabric_error(fmt::format("rail {}: fi_recv", index_), static_cast<int>(rc)));
    }
    fi_cq_entry dummy;
    (void)fi_cq_read(cq_, &dummy, 0);
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

Status FabricRail::insert_peer(const std::shared_ptr<PeerRecord>& peer, const std::string& name) {
  std::unique_lock<std::timed_mutex> lock(progress_mu_, std::defer_lock);
  if (stuck_.load() ||
      !lock.try_lock_for(std::chrono::milliseconds(settings_.completion_timeout_ms))) {
    return Unavailable(fmt::format("rail {} ({}) is stuck inside the provider; it is being "
                                   "replaced, connect again", index_, provider_name()));
  }
  Held held(this);
  PeerSlot& slot = peers_[peer.get()];
  if (slot.peer.expired() || slot.name != name) {
    slot.peer = peer;
    slot.name = name;  // the AV keeps a stale entry; it is never used again
    slot.addr = FI_ADDR_NOTAVAIL;
  }
  if (slot.addr != FI_ADDR_NOTAVAIL) return Status::Ok();
  if (!av_) return Unavailable(fmt::format("rail {} is out of service (its reopen failed)", index_));
  fi_addr_t addr = FI_ADDR_NOTAVAIL;
  int got = fi_av_insert(av_, name.data(), 1, &addr, 0, nullptr);
  if (got != 1) {
    return Unavailable(fmt::format("rail {}: fi_av_insert of the address of peer {:016x} ({} "
                                   "bytes) failed ({})", index_, peer->engine_id, name.size(),
                                   got < 0 ? fi_strerror(-got) : "0 inserted"));
  }
  slot.addr = addr;
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
    if (cq_waitable_ && cq_) fi_cq_signal(cq_);
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
  if (lock.owns_lock() && cq_waitable_ && cq_) fi_cq_signal(cq_);
}

Clock::duration FabricRail::busy_for(Clock::time_point now) const {
  int64_t since = held_since_ns_.load(std::memory_order_relaxed);
  if (since == 0) return Clock::duration::zero();
  return std::chrono::nanoseconds(std::max<int64_t>(0, steady_ns(now) - since));
}

std::shared_ptr<PeerRecord> FabricRail::posting_to() const {
  std::lock_guard<std::mutex> lock(posting_mu_);
  return posting_to_;
}

void FabricRail::track(const std::vector<RailWork>& work) {
  // Called with tracked_mu_ held.
  if (tracked_.size() > 4096) {
    std::erase_if(tracked_, [](const std::weak_ptr<TransferState>& w) {
      auto t = w.lock();
      return !t || t->is_done();
    });
  }
  const TransferState* last = nullptr;
  for (const auto& w : work) {
    if (w.transfer.get() == last) continue;
    last = w.transfer.get();
    tracked_.push_back(w.transfer);
  }
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

void FabricRail::enqueue(std::vector<RailWork>&& work) {
  {
    std::lock_guard<std::mutex> tlock(tracked_mu_);
    if (stuck_.load()) {
      for (auto& w : work) {
        w.transfer->finish(Unavailable(fmt::format("rail {} ({}) is stuck inside the provider "
                                                   "and was replaced; submit again", index_,
                                                   provider_name())),
                           TransferErrorKind::kPostError);
      }
      return;
    }
  }
  std::unique_lock<std::timed_mutex> lock(progress_mu_, std::try_to_lock);
  if (lock.owns_lock()) {
    Held held(this);
    {
      std::lock_guard<std::mutex> tlock(tracked_mu_);
      track(work);
    }
    for (auto& w : work) ready_.push_back(std::move(w));
    post_ready();
    lock.unlock();
  } else {
    std::lock_guard<std::mutex> ilock(incoming_mu_);
    for (auto& w : work) incoming_.push_back(std::move(w));
  }
  work_epoch_.fetch_add(1);
  if (sleeping_.load()) wake();
}

int FabricRail::try_progress() {
  std::unique_lock<std::timed_mutex> lock(progress_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return 0;
  Held held(this);
  return progress_once();
}

bool FabricRail::has_work() const {
  return !inflight_.empty() || !ready_.empty() || !deferred_notices_.empty() ||
         !pending_notices_.empty() || !abandoned_.empty();
}

OpContext* FabricRail::new_op() {
  if (free_ops_.empty()) {
    op_store_.push_back(std::make_unique<OpContext>());
    return op_store_.back().get();
  }
  OpContext* op = free_ops_.back();
  free_ops_.pop_back();
  return op;
}

void FabricRail::free_op(OpContext* op) {
  op->work.transfer.reset();
  op->abandoned = false;
  op->slot = -1;
  free_ops_.push_back(op);
}

int FabricRail::post(RailWork& w, fi_addr_t dest) {
  if (!ep_) return -FI_ENODEV;
  if (dest == FI_ADDR_NOTAVAIL) return -FI_EADDRNOTAVAIL;
  OpContext* op = new_op();
  op->kind = OpContext::Kind::kWrite;
  iovec iov{w.local, w.len};
  void* desc = w.local_desc;
  fi_rma_iov rma{w.remote_addr, w.len, w.key};
  fi_msg_rma msg{};
  msg.msg_iov = &iov;
  msg.desc = &desc;
  msg.iov_count = 1;
  msg.addr = dest;
  msg.rma_iov = &rma;
  msg.rma_iov_count = 1;
  msg.context = &op->ctx;
  uint64_t flags = FI_COMPLETION | (delivery_complete_ ? FI_DELIVERY_COMPLETE : 0);
  {
    std::lock_guard<std::mutex> plock(posting_mu_);
    posting_to_ = w.transfer->peer;
  }
  ssize_t rc = fi_writemsg(ep_, &msg, flags);
  {
    std::lock_guard<std::mutex> plock(posting_mu_);
    posting_to_.reset();
  }
  if (rc != 0) {
    free_op(op);
    return static_cast<int>(rc);
  }
  op->work = std::move(w);
  op->posted = Clock::now();
  last_activity_ = op->posted;
  inflight_.insert(op);
  ++writes_inflight_;
  ++peer_inflight_[op->work.transfer->peer.get()];
  return 0;
}

void FabricRail::post_ready() {
  // Each peer may hold at most three quarters of the TX depth, so that a peer that stops
  // answering cannot take every credit before it is declared dead. Items of a capped (or
  // -FI_EAGAIN) peer are skipped, keeping each peer's own order.
  const size_t peer_cap = std::max<size_t>(1, depth_ * 3 / 4);
  PeerRecord* blocked_one = nullptr;  // the common case: one peer, no set needed
  std::unordered_set<PeerRecord*> blocked;
  // A peer on this host is checked for life once per pass before anything is posted to it:
  // posting to a dead shm peer can spin forever on a lock it died holding.
  PeerRecord* checked_one = nullptr;
  std::unordered_set<PeerRecord*> checked;
  size_t posted_since_check = 0;
  size_t skipped = 0;
  for (auto it = ready_.begin(); it != ready_.end() && writes_inflight_ < depth_;) {
    RailWork& w = *it;
    TransferState* t = w.transfer.get();
    if (t->is_done()) {  // failed earlier: drop the rest of its slices
      it = ready_.erase(it);
      continue;
    }
    PeerRecord* peer = t->peer.get();
    if (peer->same_host && (posted_since_check >= 64 ||
                            (peer != checked_one && !checked.count(peer)))) {
      posted_since_check = 0;
      if (!checked_one) checked_one = peer;
      else checked.insert(peer);
      if (!peer->alive()) peer->unreachable.store(true);
    }
    if (peer->unreachable.load(std::memory_order_relaxed)) {
      t->finish(Unavailable(fmt::format("peer {:016x} is unreachable (an earlier transfer to it "
                                        "failed, or its process (pid {}) has exited); reconnect "
                                        "before sending again", peer->engine_id, peer->pid)),
                TransferErrorKind::kPeerUnavailable);
      eagain_since_.erase(peer);
      it = ready_.erase(it);
      continue;
    }
    if (w.kind == RailWork::Kind::kNotice) {
      deferred_notices_.push_back(std::move(w.transfer));
      it = ready_.erase(it);
      continue;
    }
    if (peer == blocked_one || (!blocked.empty() && blocked.count(peer))) {
      ++it;
      if (++skipped > 256) break;
      continue;
    }
    int rc = peer_inflight_[peer] >= peer_cap
                 ? -FI_EAGAIN
                 : post(w, addr_of(peer));
    ++posted_since_check;
    if (rc == -FI_EAGAIN) {  // progress (completions) frees credits; others may go on
      if (peer_inflight_[peer] < peer_cap) eagain_since_.try_emplace(peer, Clock::now());
      if (!blocked_one) blocked_one = peer;
      else blocked.insert(peer);
      if (blocked.size() > 16) break;
      ++it;
      continue;
    }
    if (!eagain_since_.empty()) eagain_since_.erase(peer);
    if (rc != 0) {
      t->finish(Internal(fabric_error(fmt::format("rail {}: fi_writemsg of {} bytes", index_, w.len),
                                      rc)),
                TransferErrorKind::kPostError);
    }
    it = ready_.erase(it);
  }
}

void FabricRail::send_notice_now(const std::shared_ptr<TransferState>& t) {
  if (free_send_slots_.empty() || !ep_) {
    if (!ep_) {
      t->finish(Unavailable(fmt::format("rail {} is out of service", index_)),
                TransferErrorKind::kPostError);
      return;
    }
    pending_notices_.push_back(t);
    return;
  }
  if (t->peer->unreachable.load() || !t->peer->alive()) {
    t->peer->unreachable.store(true);
    t->finish(Unavailable(fmt::format("notice {} not sent: peer {:016x} is unreachable (pid {})",
                                      *t->notify_tag, t->peer->engine_id, t->peer->pid)),
              TransferErrorKind::kPeerUnavailable);
    return;
  }
  int slot = free_send_slots_.back();
  char* buf = send_buf_.data() + static_cast<size_t>(slot) * kNoticeBytes;
  NoticeWire wire{kNoticeMagic, engine_id_, *t->notify_tag};
  std::memcpy(buf, &wire, sizeof(wire));
  OpContext* op = new_op();
  op->kind = OpContext::Kind::kNotice;
  op->slot = slot;
  {
    std::lock_guard<std::mutex> plock(posting_mu_);
    posting_to_ = t->peer;
  }
  ssize_t rc = fi_send(ep_, buf, sizeof(wire), fi_mr_desc(send_mr_), addr_of(t->peer.get()),
                       &op->ctx);
  {
    std::lock_guard<std::mutex> plock(posting_mu_);
    posting_to_.reset();
  }
  if (rc == -FI_EAGAIN) {
    free_op(op);
    pending_notices_.push_back(t);
    return;
  }
  if (rc != 0) {
    free_op(op);
    t->finish(Internal(fabric_error(fmt::format("rail {}: fi_send of a notice", index_),
                                    static_cast<int>(rc))),
              TransferErrorKind::kPostError);
    return;
  }
  op->work.transfer = t;
  free_send_slots_.pop_back();
  op->posted = Clock::now();
  inflight_.insert(op);
}

void FabricRail::post_deferred_notices() {
  size_t n = pending_notices_.size();
  for (size_t i = 0; i < n; ++i) {
    auto t = pending_notices_.front();
    pending_notices_.pop_front();
    if (!t->is_done()) send_notice_now(t);
  }
  for (auto it = deferred_notices_.begin(); it != deferred_notices_.end();) {
    const auto& t = *it;
    bool blocked = false;
    Status failed;
    for (const auto& p : t->predecessors) {
      if (!p->is_done()) { blocked = true; break; }
      std::lock_guard<std::mutex> lock(p->mu);
      if (!p->status.ok()) { failed = p->status; break; }
    }
    if (blocked) { ++it; continue; }
    if (!failed.ok()) {
      t->finish(Aborted(fmt::format("notice {} not sent: an earlier transfer to peer {:016x} "
                                    "failed: {}", *t->notify_tag, t->peer->engine_id,
                                    failed.message())),
                TransferErrorKind::kCompletionError);
    } else if (!t->is_done()) {
      t->predecessors.clear();
      send_notice_now(t);
    }
    it = deferred_notices_.erase(it);
  }
}

void FabricRail::finish_write(OpContext* op) {
  auto& t = op->work.transfer;
  metrics_->add_rail_write(index_, op->work.len);
  if (t->writes_left.fetch_sub(1, std::memory_order_acq_rel) == 1 && !t->is_done()) {
    if (t->notify_tag) {
      send_notice_now(t);
    } else {
      t->finish(Status::Ok());
    }
  }
}

void FabricRail::handle_completion(OpContext* op, bool error, const std::string& error_text,
                                   int err) {
  last_activity_ = Clock::now();
  if (op->kind == OpContext::Kind::kRecv) {
    if (!error) {
      NoticeWire wire;
      std::memcpy(&wire, recv_buf_.data() + static_cast<size_t>(op->slot) * kNoticeBytes,
                  sizeof(wire));
      if (wire.magic == kNoticeMagic) {
        metrics_->add_notice_received();
        on_notice_(Notice{wire.from_engine, wire.tag});
      } else {
        log::warn("transfer rail {}: dropped a message that is not a notice", index_);
      }
    }
    if (!stop_.load() && err != FI_ECANCELED) {
      Status s = post_recv(op->slot);
      if (!s.ok()) log::error("transfer rail {}: {}", index_, s.message());
    }
    return;
  }
  if (op->abandoned) {  // its transfer already failed on a timeout
    if (op->kind == OpContext::Kind::kWrite) {
      --writes_inflight_;
      --peer_inflight_[op->work.transfer->peer.get()];
    }
    auto it = std::find(abandoned_.begin(), abandoned_.end(), op);
    if (it != abandoned_.end()) abandoned_.erase(it);
    if (op->kind == OpContext::Kind::kNotice) free_send_slots_.push_back(op->slot);
    free_op(op);
    return;
  }
  if (inflight_.erase(op) == 0) return;  // not ours (already released by a reopen)
  auto t = op->work.transfer;
  PeerRecord* peer = t->peer.get();
  if (op->kind == OpContext::Kind::kWrite) {
    --writes_inflight_;
    --peer_inflight_[peer];
  }
  last_completion_[peer] = Clock::now();
  if (op->kind == OpContext::Kind::kNotice) free_send_slots_.push_back(op->slot);
  if (error) {
    if (is_connection_error(err)) peer->unreachable.store(true);
    t->finish(Unavailable(fmt::format("{} to peer {:016x} failed on rail {} ({}): {}",
                                      op->kind == OpContext::Kind::kWrite ? "RMA write" : "notice",
                                      peer->engine_id, index_, provider_name(), error_text)),
              TransferErrorKind::kCompletionError);
  } else if (op->kind == OpContext::Kind::kWrite) {
    finish_write(op);
  } else {
    metrics_->add_notice_sent();
    t->finish(Status::Ok());
  }
  free_op(op);
}

int FabricRail::read_completions() {
  if (!cq_) return 0;
  int total = 0;
  for (;;) {
    fi_cq_data_entry entries[64];
    ssize_t n = fi_cq_read(cq_, entries, 64);
    if (n > 0) {
      for (ssize_t i = 0; i < n; ++i) {
        handle_completion(reinterpret_cast<OpContext*>(entries[i].op_context), false, {}, 0);
      }
      total += static_cast<int>(n);
      if (n < 64) return total;
      continue;
    }
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      ssize_t rc = fi_cq_readerr(cq_, &err, 0);
      if (rc < 0) return total;
      ++total;
      if (err.err == FI_ECANCELED && stop_.load()) continue;
      char buf[256];
      const char* prov = fi_cq_strerror(cq_, err.prov_errno, err.err_data, buf, sizeof(buf));
      std::string text = fmt::format("{} (provider: {})", fi_strerror(err.err), prov ? prov : "-");
      if (err.op_context) {
        handle_completion(reinterpret_cast<OpContext*>(err.op_context), true, text, err.err);
      } else {
        log::warn("transfer rail {}: error completion without context: {}", index_, text);
      }
      continue;
    }
    return total;
  }
}

void FabricRail::abandon(OpContext* op, Status why, TransferErrorKind kind) {
  inflight_.erase(op);
  op->abandoned = true;
  abandoned_.push_back(op);
  reopen_wanted_ = true;
  auto& t = op->work.transfer;
  t->peer->unreachable.store(true);
  t->finish(std::move(why), kind);
}

void FabricRail::check_timeouts() {
  auto now = Clock::now();
  if (now - last_timeout_check_ < std::chrono::milliseconds(5)) return;
  last_timeout_check_ = now;
  const auto bound = std::chrono::milliseconds(settings_.completion_timeout_ms);
  std::vector<OpContext*> stuck, dead;
  std::unordered_map<PeerRecord*, bool> alive;  // same-host peers with operations in flight
  for (OpContext* op : inflight_) {
    PeerRecord* peer = op->work.transfer->peer.get();
    if (peer->same_host) {
      auto [it, fresh] = alive.try_emplace(peer, true);
      if (fresh) it->second = peer->alive();
      if (!it->second) {
        dead.push_back(op);
        continue;
      }
    }
    auto since = op->posted;
    auto it = last_completion_.find(peer);
    if (it != last_completion_.end() && it->second > since) since = it->second;
    if (now - since > bound) stuck.push_back(op);
  }
  for (OpContext* op : dead) {
    auto& t = op->work.transfer;
    abandon(op, Unavailable(fmt::format("peer {:016x} (pid {} on this host) exited with a {} to it "
                                        "in flight on rail {} ({}); the peer is marked "
                                        "unreachable", t->peer->engine_id, t->peer->pid,
                                        op->kind == OpContext::Kind::kWrite ? "write" : "notice",
                                        index_, provider_name())),
            TransferErrorKind::kPeerUnavailable);
  }
  for (OpContext* op : stuck) {
    auto& t = op->work.transfer;
    abandon(op, DeadlineExceeded(fmt::format(
                    "peer {:016x} did not complete a {} within {} ms on rail {} ({}); the peer "
                    "is marked unreachable",
                    t->peer->engine_id, op->kind == OpContext::Kind::kWrite ? "write" : "notice",
                    settings_.completion_timeout_ms, index_, provider_name())),
            TransferErrorKind::kTimeout);
  }
  // A peer whose writes the provider keeps refusing with -FI_EAGAIN fails the same way.
  for (auto it = eagain_since_.begin(); it != eagain_since_.end();) {
    if (now - it->second <= bound) { ++it; continue; }
    PeerRecord* peer = it->first;
    peer->unreachable.store(true);
    for (auto& w : ready_) {
      if (w.transfer->peer.get() != peer) continue;
      w.transfer->finish(DeadlineExceeded(fmt::format(
                             "rail {} ({}) could not post a write to peer {:016x} for {} ms "
                             "(-FI_EAGAIN); the peer is marked unreachable",
                             index_, provider_name(), peer->engine_id,
                             settings_.completion_timeout_ms)),
                         TransferErrorKind::kTimeout);
      break;
    }
    it = eagain_since_.erase(it);
  }
  // Slices queued behind a failed or unreachable transfer are dropped by post_ready().
}

int FabricRail::progress_once() {
  {
    std::lock_guard<std::mutex> ilock(incoming_mu_);
    if (!incoming_.empty()) {
      // From here on the work is in state only the lock holder can reach: track it so that a
      // declare_stuck() fails it (work still in incoming_ is handed to the replacement).
      std::lock_guard<std::mutex> tlock(tracked_mu_);
      track(std::vector<RailWork>(incoming_.begin(), incoming_.end()));
    }
    while (!incoming_.empty()) {
      ready_.push_back(std::move(incoming_.front()));
      incoming_.pop_front();
    }
  }
  if (!ep_) {  // out of service: fail what is queued
    for (auto& w : ready_) {
      w.transfer->finish(Unavailable(fmt::format("rail {} is out of service", index_)),
                         TransferErrorKind::kPostError);
    }
    int n = static_cast<int>(ready_.size());
    ready_.clear();
    return n;
  }
  if (!ready_.empty()) post_ready();
  if (!deferred_notices_.empty() || !pending_notices_.empty()) post_deferred_notices();
  int n = read_completions();
  if (n > 0 && !ready_.empty()) post_ready();  // completions freed credits
  if (!inflight_.empty() || !eagain_since_.empty()) check_timeouts();
  return n;
}

void FabricRail::run() {
  int idle_passes = 0;
  const auto hot_window = std::chrono::microseconds(std::max<int64_t>(0, settings_.idle_poll_us));
  while (!stop_.load(std::memory_order_relaxed)) {
    int n;
    bool busy;
    uint64_t epoch = work_epoch_.load();
    {
      std::lock_guard<std::timed_mutex> lock(progress_mu_);
      Held held(this);
      if (reopen_wanted_) {
        reopen_wanted_ = false;
        reopen();
      }
      n = progress_once();
      busy = has_work();
      if (remote_writes_) {
        uint64_t seen = fi_cntr_read(remote_writes_);
        if (seen != remote_writes_seen_) {
          remote_writes_seen_ = seen;
          last_activity_ = Clock::now();
        }
      }
    }
    auto now = Clock::now();
    if (n > 0) {
      idle_passes = 0;
      last_activity_ = now;
      continue;
    }
    if (busy && ++idle_passes < 64) {
      std::this_thread::yield();
      continue;
    }
    idle_passes = 0;
    // Poll hot for a while after the last activity (posted or completed operation, received
    // notice): a peer's next write usually follows soon, and providers with manual progress
    // (shm) complete writes into this process only while it polls.
    if (!cq_waitable_ && now - last_activity_ < hot_window) {
      std::this_thread::yield();
      continue;
    }
    sleeping_.store(true);
    if (work_epoch_.load() != epoch) {
      sleeping_.store(false);
      continue;
    }
    if (cq_waitable_) {
      // The provider progresses inside fi_cq_sread; the CQ outlives this call because only
      // this thread reopens the rail. Completions are handled under the lock afterwards.
      fi_cq_data_entry entries[16];
      ssize_t got = fi_cq_sread(cq_, entries, 16, nullptr, busy ? 1 : 20);
      sleeping_.store(false);
      if (got > 0) {
        std::lock_guard<std::timed_mutex> lock(progress_mu_);
        Held held(this);
        for (ssize_t i = 0; i < got; ++i) {
          handle_completion(reinterpret_cast<OpContext*>(entries[i].op_context), false, {}, 0);
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
