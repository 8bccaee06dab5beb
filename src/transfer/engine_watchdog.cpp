// The engine's watchdog: a rail whose progress lock one holder keeps too long is stuck inside
// the provider; its transfers fail and a fresh rail takes its place. Work queued meanwhile waits
// for the replacement (enqueue_on).
#include <pthread.h>

#include "cleave/common/log.h"
#include "engine_impl.h"
#include "fmt/format.h"

namespace cleave::transfer {

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
  constexpr auto kSighting = std::chrono::milliseconds(20);
  // Per rail index: the holding being watched (its start) and its holder's CPU time when the
  // watchdog first saw it busy; -1: that clock could not be read.
  struct Holding {
    int64_t since = 0;
    int64_t cpu_at = -1;
    Clock::time_point seen_at{};
  };
  std::vector<Holding> holdings;
  std::unique_lock<std::mutex> lock(watchdog_mu);
  while (!watchdog_cv.wait_for(lock, period, [&] { return watchdog_stop; })) {
    lock.unlock();
    RailsView view = rails_now();
    holdings.resize(view->size());
    const auto now = Clock::now();
    for (size_t i = 0; i < view->size(); ++i) {
      const auto& rail = (*view)[i];
      Holding& h = holdings[i];
      const auto busy = rail->busy_for(now);
      if (rail->is_stuck() || busy <= kSighting) {
        h = Holding{};
        continue;
      }
      const int64_t since = rail->held_since_ns();
      const int64_t cpu = rail->holder_cpu_ns();
      if (h.since != since) h = Holding{since, cpu, now};
      const auto ms = [](auto d) {
        return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
      };
      // Inside a post to a process that no longer exists: it will not come back.
      auto target = rail->posting_to();
      if (target && !target->alive()) {
        replace_stuck_rail(i, rail, fmt::format(" (the lock held {} ms)", ms(busy)));
        h = Holding{};
        continue;
      }
      const int64_t used_ns = cpu >= 0 && h.cpu_at >= 0 ? cpu - h.cpu_at : -1;
      if (!holding_looks_stuck(busy, used_ns, stuck_after())) continue;
      const auto used = std::chrono::nanoseconds(std::max<int64_t>(used_ns, 0));
      replace_stuck_rail(
          i, rail,
          used_ns < 0
              ? fmt::format(" (the lock held {} ms)", ms(busy))
              : fmt::format(" (the lock held {} ms; its holder used {} ms of CPU in the last {} ms)",
                            ms(busy), ms(used), ms(now - h.seen_at)));
      h = Holding{};
    }
    lock.lock();
  }
}

// Fails the stuck rail's transfers, then opens a fresh rail (new endpoint, same domain) with
// every live peer in its AV and swaps it in. The stuck rail is leaked: its thread may never
// come back from the provider, and closing its endpoint could block the same way.
void TransferEngine::Impl::replace_stuck_rail(size_t index, const std::shared_ptr<FabricRail>& old,
                                              const std::string& how) {
  auto target = old->posting_to();
  std::string why = fmt::format(
      "transfer rail {} ({}) got stuck inside the provider{}{}; its transfers failed and the "
      "rail is replaced (a peer that connected to this engine before must connect again to its "
      "new address)",
      index, provider, how,
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

}  // namespace cleave::transfer
