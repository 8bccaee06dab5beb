// Metrics: counters, gauges and histograms with labels, rendered in the Prometheus text
// exposition format (version 0.0.4), as the workers' GetMetrics RPC and the router's /metrics
// serve them. Names follow vLLM's where vLLM has the metric ("cleave:num_requests_running").
//
// Use: register each family once at start-up (MetricsRegistry::counter/gauge/histogram return
// the family; registering the same name twice returns the same family when the kind, help and
// label names agree, else an error). Get a child for a label set once (family.with({"prefill"}))
// and keep the pointer: children live as long as the registry, and the update path
// (inc/set/observe) is lock-free (relaxed atomics), with no allocation.
//
// Thread-safety: everything may be called from any thread. render() takes a consistent-enough
// snapshot (each value read atomically; a histogram's buckets, sum and count are read one after
// the other, never torn within one value).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"

namespace cleave::metrics {

class Counter {
 public:
  void inc(double v = 1.0);  // v >= 0; negative values are ignored
  double value() const;
 private:
  std::atomic<double> v_{0.0};
};

class Gauge {
 public:
  void set(double v);
  void add(double v);
  double value() const;
 private:
  std::atomic<double> v_{0.0};
};

class Histogram {
 public:
  // `bounds`: strictly increasing upper bounds (the +Inf bucket is implied).
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  // Cumulative counts per bound, then +Inf; sum; count.
  std::vector<uint64_t> cumulative_counts() const;
  double sum() const;
  uint64_t count() const;
  const std::vector<double>& bounds() const { return bounds_; }
 private:
  std::vector<double> bounds_;
  // bounds_.size() + 1 per-bucket counts (not cumulative); the count is their total, so that a
  // rendering's _count always equals its +Inf bucket.
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;
  std::atomic<double> sum_{0.0};
};

enum class Kind : uint8_t { kCounter, kGauge, kHistogram };

// A metric name with its label names; children per label-value tuple.
template <typename Child>
class Family {
 public:
  // The child for these label values (one per label name, in order); created on first use.
  // Takes a lock: look children up once and keep the pointer.
  Child& with(const std::vector<std::string>& label_values);
  // The child with no labels (families registered without label names).
  Child& get() { return with({}); }

 private:
  friend class MetricsRegistry;
  // Name, help, label names and the children (stable addresses), under a mutex; defined in
  // metrics.cpp, instantiated there for Counter, Gauge and Histogram.
  struct Impl;
  explicit Family(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

class MetricsRegistry {
 public:
  MetricsRegistry();
  ~MetricsRegistry();
  // Names: [a-zA-Z_:][a-zA-Z0-9_:]*; label names [a-zA-Z_][a-zA-Z0-9_]*. InvalidArgument for a
  // bad name or a re-registration that disagrees (kind, help, labels or bounds).
  Result<Family<Counter>> counter(std::string name, std::string help,
                                  std::vector<std::string> label_names = {});
  Result<Family<Gauge>> gauge(std::string name, std::string help,
                              std::vector<std::string> label_names = {});
  Result<Family<Histogram>> histogram(std::string name, std::string help, std::vector<double> bounds,
                                      std::vector<std::string> label_names = {});

  // Prometheus text format: families in registration order, children in creation order;
  // "# HELP" and "# TYPE" lines, label values escaped (\\, \", \n), counters as given (names
  // ending in _total are the caller's choice), histograms with _bucket{le=...}, _sum, _count.
  std::string render() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Upper bounds for latencies in seconds: 0.5 ms .. 60 s, roughly x2-x2.5 per step.
std::vector<double> latency_buckets_seconds();

}  // namespace cleave::metrics
