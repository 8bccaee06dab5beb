// TransferEngine::Impl::open: provider choice (with the hints EFA wants, dropping optional ones
// a provider refuses), fabric, one domain per NIC, rails and the watchdog thread.
#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>

#include "cleave/common/log.h"
#include "engine_impl.h"
#include "fmt/format.h"

namespace cleave::transfer {

uint64_t random_engine_id() {
  std::random_device rd;
  uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  v ^= static_cast<uint64_t>(::getpid()) << 17;
  v ^= static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  return v ? v : 1;
}

namespace {

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

}  // namespace cleave::transfer
