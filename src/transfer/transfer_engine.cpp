// TransferEngine: provider selection, domains and rails, registration, peers, batches.
#include "cleave/transfer/transfer_engine.h"

#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <mutex>

#include <cstring>
#include <random>

#include "cleave/common/log.h"
#include "fmt/format.h"
#include "transfer_codec.h"
#include "fabric_rail.h"

namespace cleave::transfer {

namespace {

struct RegionRecord {
  MemoryRegion region;
  std::vector<fid_mr*> mrs;  // one per domain
};

uint64_t random_engine_id() {
  std::random_device rd;
  uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  v ^= static_cast<uint64_t>(::getpid()) << 17;
  v ^= static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  return v ? v : 1;
}

struct InfoDeleter {
  void operator()(fi_info* i) const { fi_freeinfo(i); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

// fi_getinfo for one provider with the hints the engine wants; drops optional wishes
// (FI_HMEM, FI_DELIVERY_COMPLETE) one by one when the provider refuses them.
Result<InfoPtr> get_provider_info(const std::string& provider, const TransferSettings& settings,
                                  bool* hmem, bool* delivery_complete) {
  bool want_hmem = *hmem;
  bool want_dc = *delivery_complete;
  int last_rc = 0;
  // FI_RMA_EVENT (a counter of remote writes into this process) lets an idle target notice
  // incoming writes and poll hot; it is optional, so it is asked for only with the other
  // wishes granted first (attempt 0), and then dropped.
  for (int pass = 0; pass < 2; ++pass)
  for (int attempt = 0; attempt < 4; ++attempt) {
    if (pass == 0 && attempt > 0) break;
    bool use_hmem = want_hmem && (attempt == 0 || attempt == 1);
    bool use_dc = want_dc && (attempt == 0 || attempt == 2);
    if (attempt > 0 && !((want_hmem && attempt == 1) || (want_dc && attempt == 2) || attempt == 3)) {
      continue;
    }
    InfoPtr hints(fi_allocinfo());
    if (!hints) return ResourceExhausted("fi_allocinfo failed");
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_RMA | FI_MSG | (use_hmem ? FI_HMEM : 0) | (pass == 0 ? FI_RMA_EVENT : 0);
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode =
        FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | (use_hmem ? FI_MR_HMEM : 0);
    hints->domain_attr->threading = FI_THREAD_SAFE;
    if (use_dc) hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    hints->fabric_attr->prov_name = strdup(provider.c_str());
    bool is_shm = provider.rfind("shm", 0) == 0;
    const char* node = (!settings.node.empty() && !is_shm) ? settings.node.c_str() : nullptr;
    fi_info* info = nullptr;
    int rc = fi_getinfo(fi_version(), node, nullptr, node ? FI_SOURCE : 0, hints.get(), &info);
    if (rc == 0 && info) {
      *hmem = use_hmem;
      *delivery_complete = use_dc;
      return InfoPtr(info);
    }
    last_rc = rc;
  }
  return Unavailable(fabric_error(
      fmt::format("libfabric provider '{}' offers no FI_EP_RDM endpoint with FI_RMA|FI_MSG "
                  "(fi_getinfo, API {}.{})",
                  provider, FI_MAJOR(fi_version()), FI_MINOR(fi_version())),
      last_rc));
}

}  // namespace

struct TransferEngine::Impl : ProgressDriver {
  TransferSettings settings;
  InfoPtr info;
  fid_fabric* fabric = nullptr;
  std::vector<fid_domain*> domains;
  std::vector<fi_info*> domain_info;
  std::vector<int> rail_domain;
  // The rails in service, replaced as a whole (copy on write) when the watchdog swaps in a new
  // rail for a stuck one; readers take a snapshot and never hold rails_mu while using it.
  using RailsView = std::shared_ptr<const std::vector<std::shared_ptr<FabricRail>>>;
  mutable std::mutex rails_mu;
  RailsView rails_view;
  std::vector<std::shared_ptr<FabricRail>> stuck_rails;  // never destroyed (threads inside)
  std::unique_ptr<std::atomic<uint64_t>[]> replaced;      // per rail index
  std::thread watchdog;
  std::mutex watchdog_mu;
  std::condition_variable watchdog_cv;
  bool watchdog_stop = false;
  bool virt_addr = false, prov_key = false, mr_local = false, hmem = false, dc = false;
  uint64_t engine_id = random_engine_id();
  std::string provider;
  MetricsCounters metrics;
  std::atomic<uint64_t> next_key{1}, next_region{1}, next_peer{1}, round_robin{0};

  std::mutex regions_mu;
  std::unordered_map<uint64_t, RegionRecord> regions;
  std::mutex peers_mu;
  std::unordered_map<uint64_t, std::shared_ptr<PeerRecord>> peers;  // by peer id
  std::unordered_map<uint64_t, uint64_t> peer_by_engine;
  std::mutex notices_mu;
  std::condition_variable notices_cv;
  std::deque<Notice> notices;

  static uint64_t take_key(void* self) {
    return static_cast<Impl*>(self)->next_key.fetch_add(1);
  }

  RailsView rails_now() const {
    std::lock_guard<std::mutex> lock(rails_mu);
    return rails_view;
  }

  Pass drive_progress() override {
    Pass p;
    for (auto& r : *rails_now()) {
      int n = r->try_progress();
      if (n < 0) continue;
      p.events += n;
      ++p.rails;
    }
    return p;
  }

  // A rail whose progress lock one holder has kept for this long is stuck inside the provider.
  std::chrono::milliseconds stuck_after() const {
    return std::chrono::milliseconds(
        std::max<int64_t>(50, std::min<int64_t>(settings.completion_timeout_ms, 1000)));
  }
  // Queues `work` on the rail at `index`; when that rail was just declared stuck, waits (up to
  // the watchdog's bound and a second) for its replacement to enter the view and queues there.
  void enqueue_on(size_t index, std::vector<RailWork>&& work);
  void watch();
  void replace_stuck_rail(size_t index, const std::shared_ptr<FabricRail>& old);

  ~Impl() override {
    if (watchdog.joinable()) {
      {
        std::lock_guard<std::mutex> lock(watchdog_mu);
        watchdog_stop = true;
      }
      watchdog_cv.notify_all();
      watchdog.join();
    }
    bool leaked = !stuck_rails.empty();
    for (auto& r : stuck_rails) new std::shared_ptr<FabricRail>(r);  // leak on purpose
    RailsView view = rails_now();
    if (view) {
      for (auto& r : *view) {
        if (!r->stop()) {
          new std::shared_ptr<FabricRail>(r);  // its thread still runs inside the provider
          leaked = true;
        }
      }
    }
    {
      std::lock_guard<std::mutex> lock(rails_mu);
      rails_view.reset();
    }
    view.reset();
    if (leaked) return;  // the stuck endpoint still uses the domain and fabric
    for (auto& [id, rec] : regions) {
      for (fid_mr* mr : rec.mrs) if (mr) fi_close(&mr->fid);
    }
    for (fid_domain* d : domains) fi_close(&d->fid);
    if (fabric) fi_close(&fabric->fid);
  }

  Status open(const TransferSettings& s, bool peers_on_this_host);
  Result<std::shared_ptr<PeerRecord>> find_peer(uint64_t peer);
  void on_notice(const Notice& n) {
    {
      std::lock_guard<std::mutex> lock(notices_mu);
      notices.push_back(n);
    }
    notices_cv.notify_all();
  }
};

namespace {

// libfabric 1.17's shm provider names its endpoints "<pid>:<n>:<m>" under /dev/shm, and a process
// killed with SIGKILL leaves them behind; a later process that gets the same pid then fails
// fi_enable with EBUSY. Once per process, before its first shm endpoint exists, remove the names
// of its own pid (no live process can own them) and of pids that no longer exist.
void remove_stale_shm_names() {
  static std::once_flag once;
  std::call_once(once, [] {
    DIR* dir = ::opendir("/dev/shm");
    if (dir == nullptr) return;
    const long self = static_cast<long>(::getpid());
    int removed = 0;
    while (const dirent* e = ::readdir(dir)) {
      char* end = nullptr;
      const long pid = std::strtol(e->d_name, &end, 10);
      if (end == e->d_name || *end != ':' || pid <= 0) continue;
      const bool dead = pid != self && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
      if (pid != self && !dead) continue;
      if (::unlinkat(::dirfd(dir), e->d_name, 0) == 0) ++removed;
    }
    ::closedir(dir);
    if (removed > 0) log::debug("transfer: removed {} stale shm endpoint names", removed);
  });
}

}  // namespace

Status TransferEngine::Impl::open(const TransferSettings& s, bool peers_on_this_host) {
  settings = s;
  if (settings.rails < 1 || settings.rails > 64) {
    return InvalidArgument(fmt::format("transfer.rails must be 1..64, got {}", settings.rails));
  }
  if (settings.slice_bytes < 4096) {
    return InvalidArgument(
        fmt::format("transfer.slice_bytes must be at least 4096, got {}", settings.slice_bytes));
  }
  if (settings.completion_timeout_ms < 1) {
    return InvalidArgument(fmt::format("transfer.completion_timeout_ms must be positive, got {}",
                                       settings.completion_timeout_ms));
  }
  std::vector<std::string> candidates;
  if (settings.provider == "auto" || settings.provider.empty()) {
    candidates = {"efa", "verbs;ofi_rxm"};
    if (peers_on_this_host) candidates.push_back("shm");
    candidates.push_back("tcp;ofi_rxm");
  } else {
    candidates = {settings.provider};
  }
#ifdef CLEAVE_HAVE_CUDA
  bool want_hmem = settings.hmem;
#else
  bool want_hmem = false;
#endif
  std::string tried;
  for (const auto& c : candidates) {
    bool h = want_hmem, d = settings.delivery_complete;
    auto got = get_provider_info(c, settings, &h, &d);
    if (got.ok()) {
      info = std::move(got).value();
      hmem = h;
      dc = d;
      break;
    }
    tried += fmt::format("\n  {}", got.status().message());
  }
  if (!info) {
    return Unavailable(fmt::format("no usable libfabric provider (transfer.provider={}):{}",
                                   settings.provider, tried));
  }
  provider = info->fabric_attr->prov_name;
  if (provider == "shm") remove_stale_shm_names();
  uint64_t mr_mode = info->domain_attr->mr_mode;
  virt_addr = mr_mode & FI_MR_VIRT_ADDR;
  prov_key = mr_mode & FI_MR_PROV_KEY;
  mr_local = mr_mode & FI_MR_LOCAL;
  if (mr_mode & FI_MR_ENDPOINT) {
    return Unimplemented(fmt::format("provider {} needs FI_MR_ENDPOINT, which this engine does "
                                     "not support", provider));
  }

  int rc = fi_fabric(info->fabric_attr, &fabric, nullptr);
  if (rc) return Internal(fabric_error(fmt::format("fi_fabric({})", provider), rc));
  // One domain per distinct NIC the provider offers (same fabric); rails go round-robin.
  for (fi_info* i = info.get(); i; i = i->next) {
    if (std::strcmp(i->fabric_attr->prov_name, info->fabric_attr->prov_name) != 0 ||
        std::strcmp(i->fabric_attr->name, info->fabric_attr->name) != 0) {
      continue;
    }
    bool seen = false;
    for (fi_info* d : domain_info) seen |= std::strcmp(d->domain_attr->name, i->domain_attr->name) == 0;
    if (!seen) domain_info.push_back(i);
    if (static_cast<int64_t>(domain_info.size()) >= settings.rails) break;
  }
  for (fi_info* d : domain_info) {
    fid_domain* dom = nullptr;
    rc = fi_domain(fabric, d, &dom, nullptr);
    if (rc) return Internal(fabric_error(fmt::format("fi_domain({})", d->domain_attr->name), rc));
    domains.push_back(dom);
  }
  metrics.init(provider, static_cast<int>(settings.rails));
  replaced = std::make_unique<std::atomic<uint64_t>[]>(static_cast<size_t>(settings.rails));
  auto rails = std::make_shared<std::vector<std::shared_ptr<FabricRail>>>();
  for (int i = 0; i < settings.rails; ++i) {
    replaced[i].store(0);
    int dom = i % static_cast<int>(domains.size());
    rail_domain.push_back(dom);
    const auto d = static_cast<size_t>(dom);
    auto rail = std::make_shared<FabricRail>(i, make_libfabric_port(domains[d], domain_info[d]),
                                             settings, &metrics, dc,
                                             [this](const Notice& n) { on_notice(n); });
    CLEAVE_RETURN_IF_ERROR(rail->open(engine_id, &Impl::take_key, this));
    rails->push_back(std::move(rail));
  }
  for (auto& r : *rails) r->start();
  {
    std::lock_guard<std::mutex> lock(rails_mu);
    rails_view = rails;
  }
  watchdog = std::thread([this] {
    pthread_setname_np(pthread_self(), "xfer-watchdog");
    watch();
  });
  log::info("transfer engine {:016x}: provider {} (fabric {}), {} rail(s) on {} domain(s), "
            "mr_mode{}{}{}, delivery_complete={}, hmem={}, rma_event={}, tx depth {}, libfabric "
            "API {}.{}",
            engine_id, provider, info->fabric_attr->name, rails->size(), domains.size(),
            virt_addr ? " virt_addr" : " offsets", prov_key ? " prov_key" : " requested_keys",
            mr_local ? " local" : "", dc, hmem, (info->caps & FI_RMA_EVENT) != 0, info->tx_attr->size, FI_MAJOR(fi_version()),
            FI_MINOR(fi_version()));
  return Status::Ok();
}

void TransferEngine::Impl::enqueue_on(size_t index, std::vector<RailWork>&& work) {
  const auto deadline = Clock::now() + stuck_after() + std::chrono::seconds(1);
  for (;;) {
    RailsView view = rails_now();
    const auto& rail = (*view)[index];
    if (rail->try_enqueue(work)) return;
    if (Clock::now() >= deadline) {
      rail->enqueue(std::move(work));  // fails it, naming the stuck rail
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Runs on its own thread so that timeouts fire even while a rail's thread (or a caller driving
// progress) is stuck inside the provider.
void TransferEngine::Impl::watch() {
  const auto period = std::chrono::milliseconds(
      std::clamp<int64_t>(settings.completion_timeout_ms / 20, 1, 10));
  std::unique_lock<std::mutex> lock(watchdog_mu);
  while (!watchdog_cv.wait_for(lock, period, [&] { return watchdog_stop; })) {
    lock.unlock();
    RailsView view = rails_now();
    const auto now = Clock::now();
    for (size_t i = 0; i < view->size(); ++i) {
      const auto& rail = (*view)[i];
      if (rail->is_stuck()) continue;
      auto busy = rail->busy_for(now);
      if (busy > stuck_after()) {
        replace_stuck_rail(i, rail);
      } else if (busy > std::chrono::milliseconds(20)) {
        // Inside a post to a process that no longer exists: it will not come back.
        auto target = rail->posting_to();
        if (target && !target->alive()) replace_stuck_rail(i, rail);
      }
    }
    lock.lock();
  }
}

// Fails the stuck rail's transfers, then opens a fresh rail (new endpoint, same domain) with
// every live peer in its AV and swaps it in. The stuck rail is leaked: its thread may never
// come back from the provider, and closing its endpoint could block the same way.
void TransferEngine::Impl::replace_stuck_rail(size_t index, const std::shared_ptr<FabricRail>& old) {
  auto target = old->posting_to();
  std::string why = fmt::format(
      "transfer rail {} ({}) got stuck inside the provider{}; its transfers failed and the "
      "rail is replaced (a peer that connected to this engine before must connect again to its "
      "new address)",
      index, provider,
      target ? fmt::format(" while posting to peer {:016x} (pid {}), now marked unreachable",
                           target->engine_id, target->pid)
             : std::string());
  log::error("{}", why);
  std::vector<RailWork> untouched = old->declare_stuck(why);
  metrics.add_error(TransferErrorKind::kTimeout);
  const size_t dom = static_cast<size_t>(rail_domain[index]);
  auto rail = std::make_shared<FabricRail>(static_cast<int>(index),
                                           make_libfabric_port(domains[dom], domain_info[dom]),
                                           settings, &metrics, dc,
                                           [this](const Notice& n) { on_notice(n); });
  Status s = rail->open(engine_id, &Impl::take_key, this);
  if (!s.ok()) {
    // The stuck rail stays in the view: work given to it fails at once.
    log::error("transfer rail {}: opening its replacement failed: {}", index, s.message());
    for (auto& w : untouched) {
      w.transfer->finish(Unavailable(fmt::format("{}; opening the replacement failed: {}", why,
                                                 s.message())),
                         TransferErrorKind::kPostError);
    }
    std::lock_guard<std::mutex> lock(rails_mu);
    stuck_rails.push_back(rail);
    return;
  }
  std::vector<std::pair<std::shared_ptr<PeerRecord>, std::string>> live;
  {
    std::lock_guard<std::mutex> lock(peers_mu);
    for (auto& [id, peer] : peers) {
      if (!peer->unreachable.load() && peer->alive()) live.emplace_back(peer, peer->rail_names[index]);
    }
  }
  for (auto& [peer, name] : live) {
    Status st = rail->insert_peer(peer, name);
    if (!st.ok()) log::warn("transfer rail {} (replacement): {}", index, st.message());
  }
  rail->start();
  if (!untouched.empty()) rail->enqueue(std::move(untouched));
  {
    std::lock_guard<std::mutex> lock(rails_mu);
    auto next = std::make_shared<std::vector<std::shared_ptr<FabricRail>>>(*rails_view);
    (*next)[index] = rail;
    rails_view = next;
    stuck_rails.push_back(old);
  }
  replaced[index].fetch_add(1);
}

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

Result<TransferHandle> TransferEngine::submit(const Batch& batch) {
  Impl& im = *impl_;
  CLEAVE_ASSIGN_OR_RETURN(auto peer, im.find_peer(batch.peer));
  if (batch.writes.empty()) {
    if (batch.notify_tag) return notify(batch.peer, *batch.notify_tag);
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
  auto rails = im.rails_now();
  const uint64_t slice = std::min<uint64_t>(static_cast<uint64_t>(im.settings.slice_bytes),
                                            (*rails)[0]->max_msg_size());
  auto state = std::make_shared<TransferState>();
  state->metrics = &im.metrics;
  state->driver = &im;
  state->peer = peer;
  state->notify_tag = batch.notify_tag;
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
    std::erase_if(peer->recent, [](const std::weak_ptr<TransferState>& w) {
      auto s = w.lock();
      return !s || s->is_done();
    });
    peer->recent.push_back(state);
  }
  for (size_t r = 0; r < nrails; ++r) {
    if (!per_rail[r].empty()) im.enqueue_on(r, std::move(per_rail[r]));
  }
  return TransferHandle(state);
}

Result<TransferHandle> TransferEngine::notify(uint64_t peer_id, uint64_t tag) {
  Impl& im = *impl_;
  CLEAVE_ASSIGN_OR_RETURN(auto peer, im.find_peer(peer_id));
  if (peer->unreachable.load()) {
    im.metrics.add_error(TransferErrorKind::kPeerUnavailable);
    return Unavailable(fmt::format("notify: peer {:016x} is unreachable", peer->engine_id));
  }
  auto state = std::make_shared<TransferState>();
  state->metrics = &im.metrics;
  state->driver = &im;
  state->peer = peer;
  state->notify_tag = tag;
  {
    std::lock_guard<std::mutex> lock(peer->mu);
    for (auto& w : peer->recent) {
      if (auto s = w.lock(); s && !s->is_done()) state->predecessors.push_back(s);
    }
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
