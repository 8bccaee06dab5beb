// `cleave tune`: measures a workload on this machine under candidate configurations and
// recommends one.
//
// Each candidate is a set of settings (dotted keys of the config, e.g. router.mode=unified)
// written as a YAML file; `cleave serve --config FILE` is started with it on 127.0.0.1 (port
// 0), and `cleave bench sweep` finds the highest rate at which the SLO attainment holds. The
// search goes one group at a time (the mode and P:D split within the worker budget, then tokens
// per step, max sequences, prefix caching, KV size, each group varying one setting of the best
// so far), and breadth first within a group: every candidate is probed with one run at the
// same rate (--start-rate for the modes, the best's rate after), then swept from there in the
// order of the probes, best first. A probe under half the best goodput known at that rate prunes
// its candidate. When the budget of minutes runs out the remaining probes and sweeps are
// skipped. The winner is served again and measured at its rate once more after one warm-up run
// (the confirmation run: its goodput must be within 10% of the sweep's); goodput here is the
// offered rate times the share of requests that met the SLOs; the result is the YAML,
// a table and an SVG.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cleave/bench/sweep.h"

namespace cleave::bench {

struct TuneCandidate {
  std::string name;                                          // "unified x2, 512 tok/step"
  std::vector<std::pair<std::string, std::string>> settings;  // dotted key -> value
};

struct TuneOptions {
  std::string cleave_binary = "/proc/self/exe";
  std::string model;        // model.path ("" = the embedded default)
  int workers = 2;          // worker (CPU) budget: P + D or unified replicas
  double budget_minutes = 30;
  WorkloadOptions workload;
  ServeBenchOptions bench;  // base_url and model are set per candidate
  SweepOptions sweep;
  double confirm_tolerance = 0.10;
  int max_candidates = 100;  // candidates measured at most (the rest are not generated)
  double min_run_seconds = 10;  // see workload_for_rate(); 3 s runs were too noisy to confirm
  int64_t max_prompts_per_run = 600;
};

struct TuneRow {
  TuneCandidate candidate;
  bool pruned = false, skipped = false;
  std::string note;  // why it was pruned / skipped / failed
  std::optional<SweepPoint> probe;  // the group's common first run
  bool swept = false;
  SweepResult sweep;  // its first point is the probe
  double goodput = 0;  // rate x SLO attainment at the best passing rate (0: none passed)
};

struct TuneResult {
  std::vector<TuneRow> rows;
  int best = -1;  // index into rows
  double predicted_goodput = 0, confirmed_goodput = 0;
  bool confirmed_within = false;
  double confirmed_attainment = 0;  // of the confirmation run
  int64_t confirmed_failed = 0;
  std::string confirmed_first_error;
  double seconds = 0;
};

// The candidates of one dimension given the settings chosen so far (the first: mode and split).
std::vector<TuneCandidate> mode_candidates(int workers);

// YAML that `cleave serve --config` takes: nested maps of the dotted keys.
std::string candidate_yaml(const TuneCandidate& c, const std::string& model);

Result<TuneResult> run_tune(const TuneOptions& options);

std::string tune_table(const TuneResult& r);
std::string tune_svg(const TuneResult& r, const std::string& title);

}  // namespace cleave::bench
