// The rate sweep: SLO attainment per rate and the highest rate that keeps it.
#include "cleave/bench/sweep.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include <fmt/format.h>

namespace cleave::bench {

double slo_attainment(const std::vector<RequestRecord>& records, const GoodputSlo& slo) {
  if (records.empty()) return 0;
  int64_t good = 0;
  for (const auto& r : records) good += meets_slo(r, slo) ? 1 : 0;
  return static_cast<double>(good) / static_cast<double>(records.size());
}

Result<Workload> workload_for_rate(const WorkloadOptions& base, int step, double rate,
                                   double min_run_seconds, int64_t max_prompts) {
  WorkloadOptions w = base;
  w.seed = base.seed + static_cast<uint64_t>(step) * 1000003ull;
  if (min_run_seconds > 0 && std::isfinite(rate)) {
    const auto wanted = static_cast<int64_t>(std::ceil(rate * min_run_seconds));
    w.num_prompts = std::max(base.num_prompts, std::min(wanted, std::max(max_prompts, base.num_prompts)));
  }
  return build_workload(w);
}

void retime_arrivals(Workload* w, double rate) {
  double last = 0;
  int64_t timed = 0;
  for (const auto& r : w->requests) {
    if (r.arrival_s) {
      last = std::max(last, *r.arrival_s);
      ++timed;
    }
  }
  if (timed < 2 || last <= 0) {
    // One or no timed arrival: nothing to stretch; spread them at the rate.
    int64_t i = 0;
    for (auto& r : w->requests) {
      if (r.arrival_s) r.arrival_s = static_cast<double>(i++) / rate;
    }
    return;
  }
  const double own_rate = static_cast<double>(timed - 1) / last;
  const double factor = own_rate / rate;
  for (auto& r : w->requests) {
    if (r.arrival_s) r.arrival_s = *r.arrival_s * factor;
  }
}

Result<SweepResult> run_sweep(const ServeBenchOptions& base, const SweepOptions& s,
                              const std::function<Result<Workload>(int, double)>& make_workload,
                              const std::function<void(const SweepPoint&)>& on_point) {
  if (!base.goodput.any()) {
    return InvalidArgument("a sweep needs at least one SLO (--goodput ttft:MS tpot:MS e2el:MS)");
  }
  if (!(s.attainment > 0 && s.attainment <= 1)) {
    return InvalidArgument(fmt::format("attainment {} is not in (0, 1]", s.attainment));
  }
  if (!(s.start_rate > 0) || !std::isfinite(s.start_rate)) {
    return InvalidArgument(fmt::format("--start-rate {} is not a positive number", s.start_rate));
  }
  for (double r : s.rates) {
    if (!(r > 0) || !std::isfinite(r)) {
      return InvalidArgument(fmt::format("rate {} is not a positive number", r));
    }
  }
  if (!(s.min_throughput_ratio >= 0 && s.min_throughput_ratio <= 1)) {
    return InvalidArgument(fmt::format("throughput ratio {} is not in [0, 1]", s.min_throughput_ratio));
  }
  if (s.max_runs <= 0 || s.per_worker <= 0) {
    return InvalidArgument("--max-runs and --per-worker must be positive");
  }
  const auto started = std::chrono::steady_clock::now();
  SweepResult out;
  int step = 0;
  std::vector<SweepPoint> known = s.known;
  const auto measure = [&](double rate) -> Result<SweepPoint> {
    for (auto it = known.begin(); it != known.end(); ++it) {
      if (it->rate == rate) {
        SweepPoint p = *it;
        known.erase(it);
        out.points.push_back(p);
        if (on_point) on_point(p);
        return p;
      }
    }
    CLEAVE_ASSIGN_OR_RETURN(Workload w, make_workload(step++, rate));
    retime_arrivals(&w, rate);
    ServeBenchOptions o = base;
    o.request_rate = rate;
    CLEAVE_ASSIGN_OR_RETURN(ServeBenchRun run, run_serve_bench(o, w));
    SweepPoint p;
    p.rate = rate;
    p.attainment = slo_attainment(run.records, base.goodput);
    p.metrics = run.metrics;
    p.passed = p.attainment + 1e-12 >= s.attainment &&
               run.metrics.request_throughput >= s.min_throughput_ratio * rate;
    out.points.push_back(p);
    if (on_point) on_point(p);
    return p;
  };
  const auto passes = [](const SweepPoint& p) { return p.passed; };

  if (!s.rates.empty()) {
    for (double rate : s.rates) {
      CLEAVE_ASSIGN_OR_RETURN(SweepPoint p, measure(rate));
      (void)p;
    }
  } else {
    double good = 0, bad = 0;  // 0: not found yet
    double rate = s.start_rate;
    int runs = 0;
    while (runs < s.max_runs) {
      CLEAVE_ASSIGN_OR_RETURN(SweepPoint p, measure(rate));
      ++runs;
      if (passes(p)) {
        good = rate;
        if (bad > 0) break;
        rate *= 2;
      } else {
        bad = rate;
        if (good > 0) break;
        rate /= 2;
      }
    }
    // Bisect between the best passing and the lowest failing rate with the runs left, down to
    // a tenth of the passing rate.
    while (runs < s.max_runs && good > 0 && bad > good && (bad - good) > 0.1 * good) {
      const double mid = (good + bad) / 2;
      CLEAVE_ASSIGN_OR_RETURN(SweepPoint p, measure(mid));
      ++runs;
      if (passes(p)) good = mid;
      else bad = mid;
    }
  }
  for (const auto& p : out.points) {
    if (passes(p)) out.best_rate = std::max(out.best_rate, p.rate);
  }
  out.best_rate_per_worker = out.best_rate / s.per_worker;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return out;
}

nlohmann::ordered_json sweep_json(const SweepOptions& s, const SweepResult& r) {
  nlohmann::ordered_json j;
  j["attainment_target"] = s.attainment;
  j["per_worker"] = s.per_worker;
  j["best_rate"] = r.best_rate;
  j["best_rate_per_worker"] = r.best_rate_per_worker;
  j["seconds"] = r.seconds;
  auto points = nlohmann::ordered_json::array();
  for (const auto& p : r.points) {
    points.push_back({{"request_rate", p.rate},
                      {"slo_attainment", p.attainment},
                      {"passed", p.passed},
                      {"completed", p.metrics.completed},
                      {"failed", p.metrics.failed},
                      {"request_throughput", p.metrics.request_throughput},
                      {"request_goodput", p.metrics.request_goodput},
                      {"request_goodput_per_worker", p.metrics.request_goodput / s.per_worker},
                      {"output_throughput", p.metrics.output_throughput},
                      {"median_ttft_ms", p.metrics.ttft.median},
                      {"median_tpot_ms", p.metrics.tpot.median},
                      {"median_e2el_ms", p.metrics.e2el.median}});
  }
  j["points"] = std::move(points);
  return j;
}

std::string format_sweep(const ServeBenchOptions& base, const SweepOptions& s, const SweepResult& r) {
  std::string slo;
  if (base.goodput.ttft_ms) slo += fmt::format(" ttft<={}ms", *base.goodput.ttft_ms);
  if (base.goodput.tpot_ms) slo += fmt::format(" tpot<={}ms", *base.goodput.tpot_ms);
  if (base.goodput.e2el_ms) slo += fmt::format(" e2el<={}ms", *base.goodput.e2el_ms);
  std::string out = fmt::format("SLO:{}; target attainment {:.0f}%\n", slo, 100 * s.attainment);
  out += fmt::format("{:>10} {:>11} {:>9} {:>6} {:>11} {:>12} {:>12} {:>12} {:>12} {:>6}\n",
                     "rate_rps", "attainment", "completed", "failed", "thruput_rps", "goodput_rps",
                     "median_ttft", "median_tpot", "median_e2el", "pass");
  std::vector<SweepPoint> sorted = r.points;
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.rate < b.rate; });
  for (const auto& p : sorted) {
    out += fmt::format("{:>10.3f} {:>10.1f}% {:>9} {:>6} {:>11.3f} {:>12.3f} {:>10.1f}ms {:>10.1f}ms "
                       "{:>10.1f}ms {:>6}\n",
                       p.rate, 100 * p.attainment, p.metrics.completed, p.metrics.failed,
                       p.metrics.request_throughput, p.metrics.request_goodput,
                       p.metrics.ttft.median, p.metrics.tpot.median, p.metrics.e2el.median,
                       p.passed ? "yes" : "no");
  }
  if (r.best_rate > 0) {
    out += fmt::format("Highest rate meeting the SLOs: {:.3f} req/s", r.best_rate);
    if (s.per_worker > 1) out += fmt::format(" ({:.3f} req/s per worker of {})", r.best_rate_per_worker, s.per_worker);
    out += "\n";
  } else {
    out += "No rate tried met the SLOs.\n";
  }
  out += fmt::format("Sweep took {:.1f} s\n", r.seconds);
  return out;
}

}  // namespace cleave::bench
