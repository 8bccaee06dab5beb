// FabricRail's posting side: queueing work, posting write slices paced by the TX depth and
// per-peer caps (-FI_EAGAIN answered by progress), and sending notices once their batch is
// done.
#include <cstring>

#include "cleave/common/log.h"
#include "fabric_rail.h"
#include "fmt/format.h"

namespace cleave::transfer {

void FabricRail::enqueue(std::vector<RailWork>&& work) {
  if (try_enqueue(work)) return;
  for (auto& w : work) {
    w.transfer->finish(Unavailable(fmt::format("rail {} ({}) is stuck inside the provider and "
                                               "was replaced; submit again", index_,
                                               provider_name())),
                       TransferErrorKind::kPostError);
  }
}

bool FabricRail::try_enqueue(std::vector<RailWork>& work) {
  // declare_stuck() sets stuck_ holding incoming_mu_ and tracked_mu_: work tracked or queued
  // before that is failed by it or handed to the replacement, work after it is refused here.
  std::unique_lock<std::timed_mutex> lock(progress_mu_, std::try_to_lock);
  if (lock.owns_lock()) {
    // The submitter drives the rail: it posts, and reads completions when credits run low or
    // nobody read them for kSubmitterReadAfter (a read is a provider progress call: on tcp an
    // epoll and a recv, too dear for every 4 KiB batch). The rail's thread steps aside
    // meanwhile, as it does for a waiter, instead of blocking on the lock and being woken by
    // every unlock.
    {
      std::lock_guard<std::mutex> tlock(tracked_mu_);
      if (stuck_.load()) return false;
      track(work);
    }
    const int64_t now = steady_ns(Clock::now());
    driven_at_ns_.store(now, std::memory_order_relaxed);
    Held held(this, now);
    for (auto& w : work) push_ready(std::move(w));
    post_ready();
    if (writes_inflight_ * 2 >= depth_ || now - last_read_ns_ > kSubmitterReadAfterNs) {
      if (read_completions() > 0 && !ready_.empty()) post_ready();
    }
    // A notice whose batches are done goes out now, from this thread: left to the next pass
    // it would wait for the rail's thread to wake up (up to a nap, more on a busy machine).
    if (!deferred_notices_.empty() || !pending_notices_.empty()) post_deferred_notices();
    lock.unlock();
  } else {
    std::lock_guard<std::mutex> ilock(incoming_mu_);
    if (stuck_.load()) return false;
    for (auto& w : work) incoming_.push_back(std::move(w));
    incoming_queued_.store(true, std::memory_order_release);
  }
  work_epoch_.fetch_add(1);
  if (sleeping_.load()) wake();
  return true;
}

OpContext* FabricRail::new_op() {
  if (free_ops_.empty()) {
    storage_->op_store.push_back(std::make_unique<OpContext>());
    return storage_->op_store.back().get();
  }
  OpContext* op = free_ops_.back();
  free_ops_.pop_back();
  return op;
}

void FabricRail::free_op(OpContext* op) {
  op->work.transfer.reset();
  op->abandoned = false;
  op->slot = -1;
  op->inflight_at = OpContext::kNotInFlight;
  free_ops_.push_back(op);
}

void FabricRail::add_inflight(OpContext* op) {
  op->inflight_at = inflight_.size();
  inflight_.push_back(op);
}

bool FabricRail::remove_inflight(OpContext* op) {
  const size_t i = op->inflight_at;
  if (i >= inflight_.size() || inflight_[i] != op) return false;
  inflight_[i] = inflight_.back();
  inflight_[i]->inflight_at = i;
  inflight_.pop_back();
  op->inflight_at = OpContext::kNotInFlight;
  return true;
}

int FabricRail::post(RailWork& w, fi_addr_t dest) {
  if (!ep_) return -FI_ENODEV;
  if (dest == FI_ADDR_NOTAVAIL) return -FI_EADDRNOTAVAIL;
  OpContext* op = new_op();
  op->kind = OpContext::Kind::kWrite;
  uint64_t flags = FI_COMPLETION | (delivery_complete_ ? FI_DELIVERY_COMPLETE : 0);
  ssize_t rc = ep_->write(w.local, w.len, w.local_desc, dest, w.remote_addr, w.key, flags,
                          &op->ctx);
  if (rc != 0) {
    free_op(op);
    return static_cast<int>(rc);
  }
  op->work = std::move(w);
  op->posted = pass_now_;
  last_activity_ = pass_now_;
  add_inflight(op);
  ++writes_inflight_;
  ++peer_inflight_[op->work.transfer->peer.get()];
  return 0;
}

void FabricRail::push_ready(RailWork&& w, bool front) {
  PeerRecord* peer = w.transfer->peer.get();
  if (ready_.empty()) ready_peer_ = peer;
  else if (ready_peer_ != peer) ready_peer_ = nullptr;
  if (front) ready_.push_front(std::move(w));
  else ready_.push_back(std::move(w));
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
  // The peer named by posting_to() while this loop posts (set when the peer changes, cleared
  // at the end: only fabric calls can get stuck, and this loop makes none for anyone else).
  PeerRecord* posting = nullptr;
  for (auto it = ready_.begin(); it != ready_.end() && writes_inflight_ < depth_;) {
    RailWork& w = *it;
    TransferState* t = w.transfer.get();
    if (t->is_done() ||  // failed earlier: drop the rest of its slices
        (t->post_by != Clock::time_point::max() &&
         t->fail_if_past_deadline(pass_now_, w.kind == RailWork::Kind::kWrite
                                                 ? "a write slice" : "a notice"))) {
      it = ready_.erase(it);
      continue;
    }
    PeerRecord* peer = t->peer.get();
    if (peer->same_host && (posted_since_check >= 64 ||
                            (peer != checked_one && !checked.count(peer)))) {
      posted_since_check = 0;
      if (!checked_one) checked_one = peer;
      else checked.insert(peer);
      if (!peer->probably_alive(steady_ns(pass_now_))) peer->unreachable.store(true);
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
    int rc = -FI_EAGAIN;
    size_t& inflight = peer_inflight_[peer];  // stable: unordered_map never moves its values
    auto refusal = eagain_since_.empty() ? eagain_since_.end() : eagain_since_.find(peer);
    const bool wait_for_completion = refusal != eagain_since_.end() &&
                                     refusal->second.inflight > 0 &&
                                     inflight >= refusal->second.inflight;
    if (inflight < peer_cap && !wait_for_completion) {
      if (posting != peer) {
        set_posting_to(w.transfer->peer);
        posting = peer;
      }
      auto slot = peers_.find(peer);
      if (slot == peers_.end()) {
        rc = post(w, FI_ADDR_NOTAVAIL);
      } else {
        maybe_wake(slot->second);
        rc = post(w, slot->second.addr);
      }
    }
    ++posted_since_check;
    if (rc == -FI_EAGAIN) {  // progress (completions) frees credits; others may go on
      if (inflight < peer_cap) {
        if (refusal == eagain_since_.end()) {
          refusal = eagain_since_.emplace(peer, Refusal{pass_now_}).first;
        }
        refusal->second.inflight = inflight;
      }
      if (peer == ready_peer_) break;  // all that is queued is for this peer
      if (!blocked_one) blocked_one = peer;
      else blocked.insert(peer);
      if (blocked.size() > 16) break;
      ++it;
      continue;
    }
    if (refusal != eagain_since_.end()) eagain_since_.erase(refusal);
    if (rc != 0) {
      t->finish(Internal(fabric_error(fmt::format("rail {}: fi_writemsg of {} bytes", index_, w.len),
                                      rc)),
                TransferErrorKind::kPostError);
    }
    it = ready_.erase(it);
  }
  if (posting) set_posting_to(nullptr);
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
  if (t->fail_if_past_deadline(pass_now_, fmt::format("notice {}", *t->notify_tag))) return;
  if (t->peer->unreachable.load() || !t->peer->probably_alive(steady_ns(pass_now_))) {
    t->peer->unreachable.store(true);
    t->finish(Unavailable(fmt::format("notice {} not sent: peer {:016x} is unreachable (pid {})",
                                      *t->notify_tag, t->peer->engine_id, t->peer->pid)),
              TransferErrorKind::kPeerUnavailable);
    return;
  }
  // The id says which rail numbered it, so that ids of one engine never collide; a re-send
  // keeps the first one.
  if (t->notice_id == 0) {
    t->notice_id = (static_cast<uint64_t>(index_ + 1) << 48) | ++notices_posted_;
  }
  set_posting_to(t->peer);
  ssize_t rc = 0;
  OpContext* op = send_wire(OpContext::Kind::kNotice,
                            NoticeWire{kNoticeMagic, engine_id_, *t->notify_tag, t->notice_id,
                                       t->notify_value},
                            addr_of(t->peer.get()), &rc);
  set_posting_to(nullptr);
  if (rc == -FI_EAGAIN) {
    pending_notices_.push_back(t);
    return;
  }
  if (rc != 0) {
    t->finish(Internal(fabric_error(fmt::format("rail {}: fi_send of a notice", index_),
                                    static_cast<int>(rc))),
              TransferErrorKind::kPostError);
    return;
  }
  op->work.transfer = t;
  op->posted = pass_now_;
  add_inflight(op);
}

OpContext* FabricRail::send_wire(OpContext::Kind kind, const NoticeWire& wire, fi_addr_t dest,
                                 ssize_t* rc) {
  if (free_send_slots_.empty()) {
    *rc = -FI_EAGAIN;
    return nullptr;
  }
  const int slot = free_send_slots_.back();
  char* buf = storage_->send_slot(slot);
  std::memcpy(buf, &wire, sizeof(wire));
  OpContext* op = new_op();
  op->kind = kind;
  op->slot = slot;
  // A notice completes once it is at the peer (where the provider can say so), so that a
  // reopen of this rail, which closes the endpoint, cannot lose a notice reported as sent.
  const uint64_t flags =
      FI_COMPLETION |
      (kind == OpContext::Kind::kNotice && delivery_complete_ ? FI_DELIVERY_COMPLETE : 0);
  *rc = ep_->send(buf, sizeof(wire), storage_->send_mr->desc(), dest, flags, &op->ctx);
  if (*rc != 0) {
    free_op(op);
    return nullptr;
  }
  free_send_slots_.pop_back();
  return op;
}

void FabricRail::maybe_wake(PeerSlot& slot) {
  const auto hot = std::chrono::microseconds(settings_.idle_poll_us);
  if (!wake_peers_ || hot.count() <= 0 || !ep_ || slot.addr == FI_ADDR_NOTAVAIL) return;
  const auto now = pass_now_;
  if (now - slot.woken < hot / 2) return;
  ssize_t rc = 0;
  (void)send_wake(slot, &rc);  // no slot, -FI_EAGAIN or worse: the writes that follow will tell
}

OpContext* FabricRail::send_wake(PeerSlot& slot, ssize_t* rc) {
  OpContext* op = send_wire(OpContext::Kind::kWake, NoticeWire{kWakeMagic, engine_id_, 0, 0},
                            slot.addr, rc);
  if (op) {
    wakes_inflight_.insert(op);
    slot.woken = pass_now_;
  }
  return op;
}

void FabricRail::send_hellos() {
  const auto bound = std::chrono::milliseconds(settings_.completion_timeout_ms);
  std::erase_if(hellos_due_, [&](const std::pair<PeerRecord*, Clock::time_point>& due) {
    auto it = peers_.find(due.first);
    if (!ep_ || it == peers_.end() || it->second.addr == FI_ADDR_NOTAVAIL ||
        it->second.peer.expired() || pass_now_ - due.second > bound) {
      return true;
    }
    ssize_t rc = 0;
    if (send_wake(it->second, &rc)) return true;
    if (rc == -FI_EAGAIN) return false;  // the provider may be connecting: ask again next pass
    log::debug("transfer rail {}: the hello to peer {:016x} was refused: {}", index_,
               due.first->engine_id, fi_strerror(static_cast<int>(-rc)));
    return true;  // the writes that follow will tell
  });
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

Status FabricRail::post_recv(int slot) {
  OpContext* op = storage_->recv_ops[static_cast<size_t>(slot)].get();
  void* buf = storage_->recv_slot(slot);
  for (;;) {
    ssize_t rc = ep_->recv(buf, RailStorage::kNoticeBytes, storage_->recv_mr->desc(), &op->ctx);
    if (rc == 0) return Status::Ok();
    if (rc != -FI_EAGAIN) {
      return Internal(fabric_error(fmt::format("rail {}: fi_recv", index_), static_cast<int>(rc)));
    }
    fi_cq_data_entry dummy;
    (void)ep_->read(&dummy, 0);
  }
}

void FabricRail::set_posting_to(const std::shared_ptr<PeerRecord>& peer) {
  std::lock_guard<std::mutex> plock(posting_mu_);
  posting_to_ = peer;
}

}  // namespace cleave::transfer
