// TransferEngine's public API: registration, peers, batches (validated before anything is
// posted, then coalesced, sliced and spread over the rails), notices and metrics. Opening and
// the watchdog are in engine_open.cpp and engine_watchdog.cpp.
#include "cleave/transfer/transfer_engine.h"

#include <unistd.h>

#include "cleave/common/log.h"
#include "engine_impl.h"
#include "fmt/format.h"
#include "transfer_codec.h"

namespace cleave::transfer {

Result<std::shared_ptr<PeerRecord>> TransferEngine::Impl::find_peer(uint64_t peer) {
  std::lock_guard<std::mutex> lock(peers_mu);
  auto it = peers.find(peer);
  if (it == peers.end()) {
    return NotFound(fmt::format("peer id {} is not connected to this transfer engine", peer));
  }
  return it->second;
}

TransferEngine::TransferEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TransferEngine::~TransferEngine() = default;

Result<std::unique_ptr<TransferEngine>> TransferEngine::create(const TransferSettings& settings,
                                                               bool peers_on_this_host) {
  auto impl = std::make_unique<Impl>();
  CLEAVE_RETURN_IF_ERROR(impl->open(settings, peers_on_this_host));
  return std::unique_ptr<TransferEngine>(new TransferEngine(std::move(impl)));
}

const std::string& TransferEngine::provider() const { return impl_->provider; }
bool TransferEngine::hmem() const { return impl_->hmem; }
bool TransferEngine::provider_revokes_keys(std::string_view provider) {
  return provider.starts_with("tcp") || provider.starts_with("shm") ||
         provider.starts_with("sockets");
}
uint64_t TransferEngine::engine_id() const { return impl_->engine_id; }
int TransferEngine::rails() const { return static_cast<int>(impl_->rails_now()->size()); }
std::string TransferEngine::address() const {
  EngineAddress addr{impl_->engine_id, impl_->provider, {}, local_host_id(),
                     static_cast<uint32_t>(::getpid())};
  for (const auto& r : *impl_->rails_now()) addr.rail_names.push_back(r->name());
  return addr.encode();
}

Result<MemoryRegion> TransferEngine::register_memory(void* ptr, uint64_t len, MemoryKind kind) {
  if (!ptr || len == 0) {
    return InvalidArgument(fmt::format("register_memory: empty range (ptr={}, len={})", ptr, len));
  }
  if (kind.type == MemoryKind::Type::kCuda) {
#ifndef CLEAVE_HAVE_CUDA
    return FailedPrecondition("register_memory: CUDA memory needs a build with CUDA "
                              "(CLEAVE_WITH_CUDA)");
#else
    if (!impl_->hmem) {
      return FailedPrecondition(fmt::format(
          "register_memory: provider {} was opened without FI_HMEM, so it cannot register CUDA "
          "memory (device {})", impl_->provider, kind.device));
    }
#endif
  }
  RegionRecord rec;
  rec.region.id = impl_->next_region.fetch_add(1);
  rec.region.ptr = ptr;
  rec.region.len = len;
  rec.region.kind = kind;
  std::vector<uint64_t> domain_keys;
  const uint64_t access = FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
  auto fail = [&](Status s) {
    for (fid_mr* mr : rec.mrs) fi_close(&mr->fid);
    return s;
  };
  for (size_t d = 0; d < impl_->domains.size(); ++d) {
    uint64_t requested_key = impl_->next_key.fetch_add(1);
    fid_mr* mr = nullptr;
    iovec iov{ptr, len};
    fi_mr_attr attr{};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = requested_key;
    attr.iface = FI_HMEM_SYSTEM;
#ifdef CLEAVE_HAVE_CUDA
    if (kind.type == MemoryKind::Type::kCuda) {
      attr.iface = FI_HMEM_CUDA;
      attr.device.cuda = kind.device;
    }
#endif
    int rc = fi_mr_regattr(impl_->domains[d], &attr, 0, &mr);
    if (rc) {
      return fail(Internal(fabric_error(
          fmt::format("register_memory: fi_mr_regattr of {} bytes at {} ({} memory) on {}", len,
                      ptr, kind.type == MemoryKind::Type::kCuda ? "CUDA" : "host", impl_->provider),
          rc)));
    }
    rec.mrs.push_back(mr);
    domain_keys.push_back(impl_->prov_key ? fi_mr_key(mr) : requested_key);
  }
  RemoteDescriptor& rd = rec.region.remote;
  rd.engine_id = impl_->engine_id;
  rd.region_id = rec.region.id;
  rd.addr = reinterpret_cast<uint64_t>(ptr);
  rd.len = len;
  rd.virt_addr = impl_->virt_addr;
  for (int dom : impl_->rail_domain) rd.keys.push_back(domain_keys[static_cast<size_t>(dom)]);
  MemoryRegion out = rec.region;
  std::lock_guard<std::mutex> lock(impl_->regions_mu);
  impl_->regions.emplace(out.id, std::move(rec));
  return out;
}

Status TransferEngine::deregister(uint64_t region_id) {
  std::lock_guard<std::mutex> lock(impl_->regions_mu);
  auto it = impl_->regions.find(region_id);
  if (it == impl_->regions.end()) {
    return NotFound(fmt::format("deregister: region {} is not registered", region_id));
  }
  for (fid_mr* mr : it->second.mrs) fi_close(&mr->fid);
  impl_->regions.erase(it);
  return Status::Ok();
}

Result<uint64_t> TransferEngine::connect(std::string_view peer_address) {
  CLEAVE_ASSIGN_OR_RETURN(EngineAddress a, EngineAddress::decode(peer_address));
  if (a.provider != impl_->provider) {
    return FailedPrecondition(fmt::format("peer {:016x} uses provider '{}' but this engine uses "
                                          "'{}'; both sides must use the same provider",
                                          a.engine_id, a.provider, impl_->provider));
  }
  std::lock_guard<std::mutex> lock(impl_->peers_mu);
  auto known = impl_->peer_by_engine.find(a.engine_id);
  if (a.rail_names.empty()) {
    return InvalidArgument(fmt::format("peer {:016x}: its address lists no endpoint", a.engine_id));
  }
  auto rails = impl_->rails_now();
  const size_t nrails = rails->size();
  const bool same_host = !a.host_id.empty() && a.host_id == local_host_id() && a.pid != 0;
  if (known != impl_->peer_by_engine.end()) {
    // The peer may have reopened endpoints since (new names), and a reopen of ours may have
    // dropped it from an AV: insert_peer() handles both.
    auto& peer = impl_->peers[known->second];
    peer->connects.fetch_add(1);
    peer->unreachable.store(false);
    for (size_t i = 0; i < nrails; ++i) {
      peer->rail_names[i] = a.rail_names[i % a.rail_names.size()];
      CLEAVE_RETURN_IF_ERROR((*rails)[i]->insert_peer(peer, peer->rail_names[i]));
    }
    return known->second;
  }
  auto peer = std::make_shared<PeerRecord>();
  peer->id = impl_->next_peer.fetch_add(1);
  peer->engine_id = a.engine_id;
  peer->same_host = same_host;
  peer->pid = static_cast<pid_t>(a.pid);
  peer->stats = impl_->metrics.peer_counters(a.engine_id);
  for (size_t i = 0; i < nrails; ++i) {
    peer->rail_names.push_back(a.rail_names[i % a.rail_names.size()]);
  }
  for (size_t i = 0; i < nrails; ++i) {
    CLEAVE_RETURN_IF_ERROR((*rails)[i]->insert_peer(peer, peer->rail_names[i]));
  }
  impl_->peers[peer->id] = peer;
  impl_->peer_by_engine[a.engine_id] = peer->id;
  return peer->id;
}

bool TransferEngine::reachable(uint64_t peer) const {
  auto p = impl_->find_peer(peer);
  return p.ok() && !(*p)->unreachable.load();
}

Result<TransferHandle> TransferEngine::submit(const Batch& batch) {
  Impl& im = *impl_;
  CLEAVE_ASSIGN_OR_RETURN(auto peer, im.find_peer(batch.peer));
  if (batch.writes.empty()) {
    if (batch.notify_tag) return notify(batch.peer, *batch.notify_tag, 0, batch.post_by);
    return InvalidArgument("submit: the batch has no writes and no notice");
  }
  auto refuse = [&](Status s) {
    im.metrics.add_error(TransferErrorKind::kInvalidDescriptor);
    return s;
  };
  if (peer->unreachable.load()) {
    im.metrics.add_error(TransferErrorKind::kPeerUnavailable);
    return Unavailable(fmt::format("submit: peer {:016x} is unreachable (an earlier transfer to "
                                   "it failed); reconnect first", peer->engine_id));
  }
  if (batch.post_by && Clock::now() >= *batch.post_by) {
    im.metrics.add_error(TransferErrorKind::kPastDeadline);
    return DeadlineExceeded(fmt::format("submit: the batch's deadline has passed; nothing is "
                                        "posted to peer {:016x}", peer->engine_id));
  }
  auto rails = im.rails_now();
  const uint64_t slice = std::min<uint64_t>(static_cast<uint64_t>(im.settings.slice_bytes),
                                            (*rails)[0]->max_msg_size());
  auto state = std::make_shared<TransferState>();
  state->metrics = &im.metrics;
  state->driver = &im;
  state->hot = std::chrono::microseconds(im.settings.idle_poll_us);
  state->peer = peer;
  state->peer_connects = peer->connects.load();
  state->notify_tag = batch.notify_tag;
  if (batch.post_by) state->post_by = *batch.post_by;
  const size_t nrails = rails->size();
  std::vector<std::vector<RailWork>> per_rail(nrails);
  {
    std::lock_guard<std::mutex> lock(im.regions_mu);
    for (size_t i = 0; i < batch.writes.size(); ++i) {
      const WriteOp& w = batch.writes[i];
      if (w.len == 0) return refuse(InvalidArgument(fmt::format("write {}: zero length", i)));
      auto it = im.regions.find(w.local_region);
      if (it == im.regions.end()) {
        return refuse(NotFound(fmt::format("write {}: local region {} is not registered with this "
                                           "engine", i, w.local_region)));
      }
      const MemoryRegion& lr = it->second.region;
      if (w.local_offset > lr.len || w.len > lr.len - w.local_offset) {
        return refuse(OutOfRange(fmt::format(
            "write {}: local range [{}, +{}) is outside region {} of {} bytes", i, w.local_offset,
            w.len, lr.id, lr.len)));
      }
      if (w.remote.engine_id != peer->engine_id) {
        return refuse(InvalidArgument(fmt::format(
            "write {}: remote descriptor (region {}) belongs to engine {:016x}, not to the target "
            "peer {:016x}: a foreign key", i, w.remote.region_id, w.remote.engine_id,
            peer->engine_id)));
      }
      if (w.remote.keys.empty()) {
        return refuse(InvalidArgument(fmt::format("write {}: remote descriptor has no keys", i)));
      }
      if (w.remote_offset > w.remote.len || w.len > w.remote.len - w.remote_offset) {
        return refuse(OutOfRange(fmt::format(
            "write {}: remote range [{}, +{}) is outside remote region {} of {} bytes", i,
            w.remote_offset, w.len, w.remote.region_id, w.remote.len)));
      }
      state->bytes += w.len;
    }
    std::vector<PlannedSlice> slices = plan_slices(batch.writes, slice);
    uint64_t rr = im.round_robin.fetch_add(slices.size());
    for (const PlannedSlice& s : slices) {
      size_t rail = static_cast<size_t>(rr++ % nrails);
      const RegionRecord& rec = im.regions.at(s.local_region);
      const RemoteDescriptor& rd = batch.writes[s.remote_index].remote;
      RailWork work;
      work.kind = RailWork::Kind::kWrite;
      work.transfer = state;
      work.local = static_cast<char*>(rec.region.ptr) + s.local_offset;
      work.local_desc = fi_mr_desc(rec.mrs[static_cast<size_t>(im.rail_domain[rail])]);
      work.len = s.len;
      work.remote_addr = rd.virt_addr ? rd.addr + s.remote_offset : s.remote_offset;
      work.key = rd.keys[rail % rd.keys.size()];
      per_rail[rail].push_back(std::move(work));
    }
    state->writes_left.store(static_cast<int64_t>(slices.size()));
  }
  {
    std::lock_guard<std::mutex> lock(peer->mu);
    sweep_finished(peer->recent, &peer->recent_prune_at, 64);
    peer->recent.push_back(state);
  }
  for (size_t r = 0; r < nrails; ++r) {
    if (!per_rail[r].empty()) im.enqueue_on(r, std::move(per_rail[r]));
  }
  return TransferHandle(state);
}

Result<TransferHandle> TransferEngine::notify(uint64_t peer_id, uint64_t tag, uint64_t value,
                                              std::optional<Clock::time_point> post_by) {
  Impl& im = *impl_;
  CLEAVE_ASSIGN_OR_RETURN(auto peer, im.find_peer(peer_id));
  if (peer->unreachable.load()) {
    im.metrics.add_error(TransferErrorKind::kPeerUnavailable);
    return Unavailable(fmt::format("notify: peer {:016x} is unreachable", peer->engine_id));
  }
  if (post_by && Clock::now() >= *post_by) {
    im.metrics.add_error(TransferErrorKind::kPastDeadline);
    return DeadlineExceeded(fmt::format("notify: the notice's deadline has passed; notice {} is "
                                        "not sent to peer {:016x}", tag, peer->engine_id));
  }
  auto state = std::make_shared<TransferState>();
  state->metrics = &im.metrics;
  state->driver = &im;
  state->hot = std::chrono::microseconds(im.settings.idle_poll_us);
  state->peer = peer;
  state->peer_connects = peer->connects.load();
  state->notify_tag = tag;
  state->notify_value = value;
  if (post_by) state->post_by = *post_by;
  {
    std::lock_guard<std::mutex> lock(peer->mu);
    std::erase_if(peer->recent, [&](const std::weak_ptr<TransferState>& w) {
      auto s = w.lock();
      if (!s || s->is_done()) return true;
      state->predecessors.push_back(std::move(s));
      return false;
    });
    peer->recent.push_back(state);
  }
  RailWork work;
  work.kind = RailWork::Kind::kNotice;
  work.transfer = state;
  std::vector<RailWork> v;
  v.push_back(std::move(work));
  auto rails = im.rails_now();
  im.enqueue_on(static_cast<size_t>(im.round_robin.fetch_add(1) % rails->size()), std::move(v));
  return TransferHandle(state);
}

std::vector<Notice> TransferEngine::take_notices() {
  std::lock_guard<std::mutex> lock(impl_->notices_mu);
  std::vector<Notice> out(impl_->notices.begin(), impl_->notices.end());
  impl_->notices.clear();
  return out;
}

Result<Notice> TransferEngine::wait_notice(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(impl_->notices_mu);
  if (!impl_->notices_cv.wait_for(lock, timeout, [&] { return !impl_->notices.empty(); })) {
    return DeadlineExceeded(fmt::format("no notice arrived within {} ms", timeout.count()));
  }
  Notice n = impl_->notices.front();
  impl_->notices.pop_front();
  return n;
}

TransferMetricsSnapshot TransferEngine::metrics() const {
  TransferMetricsSnapshot m = impl_->metrics.snapshot();
  auto rails = impl_->rails_now();
  for (size_t i = 0; i < rails->size(); ++i) {
    m.rail_reopens.push_back((*rails)[i]->reopens() + impl_->replaced[i].load());
  }
  return m;
}

}  // namespace cleave::transfer
