// TransferEngine::Impl, shared by the engine's .cpp files (internal header):
//   engine_open.cpp       provider choice, fabric, domains and rails
//   engine_watchdog.cpp   the watchdog that replaces a rail stuck inside the provider, and
//                         queueing on a rail that is being replaced
//   transfer_engine.cpp   the public API: registration, peers, batches, notices, metrics
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cleave/transfer/transfer_engine.h"
#include "fabric_rail.h"

namespace cleave::transfer {

struct RegionRecord {
  MemoryRegion region;
  std::vector<fid_mr*> mrs;  // one per domain
};

struct InfoDeleter {
  void operator()(fi_info* i) const { fi_freeinfo(i); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

// A random, non-zero id for a new engine.
uint64_t random_engine_id();

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

  // The bound of holding_looks_stuck().
  std::chrono::milliseconds stuck_after() const { return stuck_bound(settings); }
  // Queues `work` on the rail at `index`; when that rail was just declared stuck, waits (up to
  // the watchdog's bound and a second) for its replacement to enter the view and queues there.
  void enqueue_on(size_t index, std::vector<RailWork>&& work);
  void watch();
  // `how`: what the watchdog saw (how long the lock was held, the holder's CPU time), for the
  // log line.
  void replace_stuck_rail(size_t index, const std::shared_ptr<FabricRail>& old,
                          const std::string& how);

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
    for (auto& r : stuck_rails) keep_rail_forever(r);  // its thread may still be inside
    RailsView view = rails_now();
    if (view) {
      for (auto& r : *view) {
        if (!r->stop()) {
          keep_rail_forever(r);  // its thread still runs inside the provider
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

}  // namespace cleave::transfer
