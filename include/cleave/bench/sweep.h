// `cleave bench sweep`: the highest request rate at which at least `attainment` (0.9) of the
// requests meet every SLO (DistServe's goodput), found by running `cleave bench serve` at
// several rates.
//
// SLO attainment at a rate = requests that completed and met every SLO / requests of the run
// (failures count against it). A rate passes when the attainment holds and the server kept up
// with it: request throughput at least min_throughput_ratio (0.8) of the offered rate. (A short
// run at a rate the server cannot sustain ends before its queue grows, so its attainment alone
// would pass any rate.) Rates are the given list, or a search: start at start_rate,
// double while the attainment holds (halve while it does not, when even the start fails),
// then bisect between the best passing and the lowest failing rate; at most max_runs runs.
// Each run takes a fresh workload from `make_workload(step, rate)` (so that a prefix cache does
// not serve one run from the one before; workload_for_rate() sizes it to the rate); a workload with its own arrivals (a trace) is re-timed
// to the rate: every arrival multiplied by (its own mean rate / the rate).
#pragma once

#include <functional>
#include <vector>

#include "cleave/bench/serve_bench.h"

namespace cleave::bench {

struct SweepPoint {
  double rate = 0;
  double attainment = 0;
  bool passed = false;  // attainment held and the server kept up with the rate
  BenchMetrics metrics;
};

struct SweepOptions {
  std::vector<double> rates;  // given rates (ascending or not); empty: search
  double start_rate = 1.0;
  double attainment = 0.9;
  double min_throughput_ratio = 0.8;
  int max_runs = 8;
  int per_worker = 1;  // divide the goodput by this many workers (or GPUs)
  // Points measured already against the same server configuration (`cleave tune`'s probes):
  // when the search asks for one's rate it is taken as that run instead of running it again.
  std::vector<SweepPoint> known;
};

struct SweepResult {
  std::vector<SweepPoint> points;  // in the order run
  // Highest rate that met the attainment (0 when none did), and that divided by per_worker.
  double best_rate = 0;
  double best_rate_per_worker = 0;
  double seconds = 0;  // the whole sweep
};

double slo_attainment(const std::vector<RequestRecord>& records, const GoodputSlo& slo);

// Each run prints its progress bar when base.progress; `on_point` (optional) sees each point.
Result<SweepResult> run_sweep(const ServeBenchOptions& base, const SweepOptions& sweep,
                              const std::function<Result<Workload>(int step, double rate)>& make_workload,
                              const std::function<void(const SweepPoint&)>& on_point = {});

// The workload of one sweep run: `base` with its seed moved by `step`, and (for datasets that
// draw arrivals) max(num_prompts, rate * min_run_seconds) requests, at most max_prompts, so
// that a run at a high rate lasts long enough to build a queue when the server cannot keep up.
Result<Workload> workload_for_rate(const WorkloadOptions& base, int step, double rate,
                                   double min_run_seconds, int64_t max_prompts);

// Re-times a workload's own arrivals to `rate` requests per second (unchanged when it has none).
void retime_arrivals(Workload* w, double rate);

nlohmann::ordered_json sweep_json(const SweepOptions& sweep, const SweepResult& r);
std::string format_sweep(const ServeBenchOptions& base, const SweepOptions& sweep,
                         const SweepResult& r);

}  // namespace cleave::bench
