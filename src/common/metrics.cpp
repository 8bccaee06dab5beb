#include "cleave/common/metrics.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_map>

#include "cleave/common/log.h"
#include "fmt/format.h"

namespace cleave::metrics {

// ---- values ----

void Counter::inc(double v) {
  if (!(v >= 0.0)) return;  // negative or NaN: a counter only goes up
  v_.fetch_add(v, std::memory_order_relaxed);
}
double Counter::value() const { return v_.load(std::memory_order_relaxed); }

void Gauge::set(double v) { v_.store(v, std::memory_order_relaxed); }
void Gauge::add(double v) { v_.fetch_add(v, std::memory_order_relaxed); }
double Gauge::value() const { return v_.load(std::memory_order_relaxed); }

namespace {
// Strictly increasing finite bounds (the registry refuses anything else; a Histogram built
// directly gets the same cleaning so that observe() can binary-search).
std::vector<double> clean_bounds(std::vector<double> b) {
  std::erase_if(b, [](double x) { return !std::isfinite(x); });
  std::sort(b.begin(), b.end());
  b.erase(std::unique(b.begin(), b.end()), b.end());
  return b;
}
}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(clean_bounds(std::move(bounds))),
      buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void Histogram::observe(double v) {
  if (std::isnan(v)) return;
  // The first bound >= v (Prometheus buckets are "le"); past the end is the +Inf bucket.
  const size_t i = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) -
                                       bounds_.begin());
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

std::vector<uint64_t> Histogram::cumulative_counts() const {
  std::vector<uint64_t> out(bounds_.size() + 1);
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    total += buckets_[i].load(std::memory_order_relaxed);
    out[i] = total;
  }
  return out;
}

double Histogram::sum() const { return sum_.load(std::memory_order_relaxed); }

uint64_t Histogram::count() const {
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) total += buckets_[i].load(std::memory_order_relaxed);
  return total;
}

// ---- text format helpers ----

namespace {

std::string_view kind_name(Kind k) {
  switch (k) {
    case Kind::kCounter: return "counter";
    case Kind::kGauge: return "gauge";
    case Kind::kHistogram: return "histogram";
  }
  return "untyped";
}

bool valid_metric_name(std::string_view n) {
  if (n.empty()) return false;
  for (size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    const bool digit = c >= '0' && c <= '9';
    if (!(alpha || (i > 0 && digit))) return false;
  }
  return true;
}

bool valid_label_name(std::string_view n) {
  if (n.empty()) return false;
  for (size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    const bool digit = c >= '0' && c <= '9';
    if (!(alpha || (i > 0 && digit))) return false;
  }
  return true;
}

// HELP text: backslash and line feed escaped.
void append_help(std::string& out, std::string_view s) {
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
}

// Label values: backslash, double quote and line feed escaped.
void append_label_value(std::string& out, std::string_view s) {
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
}

// Go's ParseFloat spelling of the specials; otherwise the shortest text that reads back exactly.
void append_number(std::string& out, double v) {
  if (std::isnan(v)) out += "NaN";
  else if (std::isinf(v)) out += v > 0 ? "+Inf" : "-Inf";
  else fmt::format_to(std::back_inserter(out), "{}", v);
}

// `{a="x",b="y"` (no closing brace) or "" when there are no labels and no `extra`.
void append_labels(std::string& out, const std::vector<std::string>& names,
                   const std::vector<std::string>& values, std::string_view extra_name = {},
                   std::string_view extra_value = {}) {
  if (names.empty() && extra_name.empty()) return;
  out += '{';
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) out += ',';
    out += names[i];
    out += "=\"";
    append_label_value(out, values[i]);
    out += '"';
  }
  if (!extra_name.empty()) {
    if (!names.empty()) out += ',';
    out += extra_name;
    out += "=\"";
    out += extra_value;
    out += '"';
  }
  out += '}';
}

std::string join(const std::vector<std::string>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i];
  return out + "]";
}

std::string join(const std::vector<double>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += fmt::format("{}{}", i ? ", " : "", v[i]);
  return out + "]";
}

}  // namespace

// ---- families ----

// What the registry needs of every family, whatever its child type.
struct FamilyCore {
  std::string name;
  std::string help;
  Kind kind = Kind::kCounter;
  std::vector<std::string> label_names;
  std::vector<double> bounds;  // histograms

  virtual ~FamilyCore() = default;
  virtual void render(std::string& out) const = 0;

  void render_header(std::string& out) const {
    out += "# HELP ";
    out += name;
    out += ' ';
    append_help(out, help);
    out += "\n# TYPE ";
    out += name;
    out += ' ';
    out += kind_name(kind);
    out += '\n';
  }
};

template <typename Child>
struct Family<Child>::Impl final : FamilyCore {
  struct Entry {
    std::vector<std::string> label_values;
    std::unique_ptr<Child> child;
  };
  mutable std::mutex mu;
  std::vector<Entry> children;  // creation order; the Child objects never move
  std::map<std::vector<std::string>, Child*> by_values;
  // Handed out for a wrong number of label values (a caller bug): updates go nowhere visible.
  std::unique_ptr<Child> discard;

  std::unique_ptr<Child> make_child() const {
    if constexpr (std::is_same_v<Child, Histogram>) return std::make_unique<Histogram>(bounds);
    else return std::make_unique<Child>();
  }

  Child& with(const std::vector<std::string>& values) {
    std::lock_guard<std::mutex> lock(mu);
    if (values.size() != label_names.size()) {
      if (!discard) {
        log::error("metric {}: {} label values given for label names {}; this child is not "
                   "exported", name, values.size(), join(label_names));
        discard = make_child();
      }
      return *discard;
    }
    auto it = by_values.find(values);
    if (it != by_values.end()) return *it->second;
    children.push_back({values, make_child()});
    Child* c = children.back().child.get();
    by_values.emplace(values, c);
    return *c;
  }

  void render(std::string& out) const override {
    render_header(out);
    std::lock_guard<std::mutex> lock(mu);
    for (const Entry& e : children) {
      if constexpr (std::is_same_v<Child, Histogram>) {
        const Histogram& h = *e.child;
        const std::vector<uint64_t> cum = h.cumulative_counts();
        const double sum = h.sum();
        std::string le;
        for (size_t i = 0; i < cum.size(); ++i) {
          le.clear();
          if (i < h.bounds().size()) append_number(le, h.bounds()[i]);
          else le = "+Inf";
          out += name;
          out += "_bucket";
          append_labels(out, label_names, e.label_values, "le", le);
          fmt::format_to(std::back_inserter(out), " {}\n", cum[i]);
        }
        out += name;
        out += "_sum";
        append_labels(out, label_names, e.label_values);
        out += ' ';
        append_number(out, sum);
        out += '\n';
        out += name;
        out += "_count";
        append_labels(out, label_names, e.label_values);
        fmt::format_to(std::back_inserter(out), " {}\n", cum.back());
      } else {
        out += name;
        append_labels(out, label_names, e.label_values);
        out += ' ';
        append_number(out, e.child->value());
        out += '\n';
      }
    }
  }
};

template <typename Child>
Child& Family<Child>::with(const std::vector<std::string>& label_values) {
  return impl_->with(label_values);
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

// ---- registry ----

struct MetricsRegistry::Impl {
  mutable std::mutex mu;
  std::vector<std::shared_ptr<FamilyCore>> families;  // registration order
  std::unordered_map<std::string, std::shared_ptr<FamilyCore>> by_name;

  // A histogram writes name_bucket, name_sum and name_count: no other family may own those
  // sample names. Empty when `name` (of `kind`) clashes with nothing registered.
  std::string sample_name_clash(const std::string& name, Kind kind) const {
    static constexpr std::string_view kSuffixes[] = {"_bucket", "_sum", "_count"};
    for (std::string_view suffix : kSuffixes) {
      if (name.ends_with(suffix)) {
        auto it = by_name.find(name.substr(0, name.size() - suffix.size()));
        if (it != by_name.end() && it->second->kind == Kind::kHistogram) {
          return fmt::format("metric name {} clashes with the samples of histogram {}", name,
                             it->second->name);
        }
      }
      if (kind == Kind::kHistogram) {
        const std::string sample = name + std::string(suffix);
        if (by_name.count(sample)) {
          return fmt::format("histogram {} would write samples named {}, which is already a "
                             "metric", name, sample);
        }
      }
    }
    return {};
  }

  // The existing family of that name when it agrees, a new one otherwise, or an error.
  template <typename Child>
  Result<std::shared_ptr<typename Family<Child>::Impl>> add(Kind kind, std::string name,
                                                            std::string help,
                                                            std::vector<double> bounds,
                                                            std::vector<std::string> labels) {
    using FamilyImpl = typename Family<Child>::Impl;
    if (!valid_metric_name(name)) {
      return InvalidArgument(fmt::format("metric name '{}' is not valid (it must match "
                                         "[a-zA-Z_:][a-zA-Z0-9_:]*)", name));
    }
    for (size_t i = 0; i < labels.size(); ++i) {
      const std::string& l = labels[i];
      if (!valid_label_name(l)) {
        return InvalidArgument(fmt::format("metric {}: label name '{}' is not valid (it must "
                                           "match [a-zA-Z_][a-zA-Z0-9_]*)", name, l));
      }
      if (l.starts_with("__")) {
        return InvalidArgument(fmt::format("metric {}: label name '{}' is reserved (names "
                                           "starting with __ are Prometheus's)", name, l));
      }
      if (kind == Kind::kHistogram && l == "le") {
        return InvalidArgument(fmt::format("metric {}: a histogram cannot have a label 'le' (its "
                                           "buckets use it)", name));
      }
      if (std::find(labels.begin(), labels.begin() + static_cast<ptrdiff_t>(i), l) !=
          labels.begin() + static_cast<ptrdiff_t>(i)) {
        return InvalidArgument(fmt::format("metric {}: label name '{}' appears twice", name, l));
      }
    }
    for (size_t i = 0; i < bounds.size(); ++i) {
      if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1]))) {
        return InvalidArgument(fmt::format("histogram {}: bucket bounds {} must be finite and "
                                           "strictly increasing (+Inf is implied)", name,
                                           join(bounds)));
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = by_name.find(name); it != by_name.end()) {
      const FamilyCore& f = *it->second;
      std::vector<std::string> diffs;
      if (f.kind != kind) {
        diffs.push_back(fmt::format("kind {} vs {}", kind_name(f.kind), kind_name(kind)));
      }
      if (f.help != help) diffs.push_back(fmt::format("help '{}' vs '{}'", f.help, help));
      if (f.label_names != labels) {
        diffs.push_back(fmt::format("labels {} vs {}", join(f.label_names), join(labels)));
      }
      if (f.kind == kind && f.bounds != bounds) {
        diffs.push_back(fmt::format("bounds {} vs {}", join(f.bounds), join(bounds)));
      }
      if (!diffs.empty()) {
        std::string msg = fmt::format("metric {} is already registered differently:", name);
        for (size_t i = 0; i < diffs.size(); ++i) msg += (i ? "; " : " ") + diffs[i];
        return InvalidArgument(std::move(msg));
      }
      return std::static_pointer_cast<FamilyImpl>(it->second);
    }
    if (std::string clash = sample_name_clash(name, kind); !clash.empty()) {
      return InvalidArgument(std::move(clash));
    }
    auto f = std::make_shared<FamilyImpl>();
    f->name = std::move(name);
    f->help = std::move(help);
    f->kind = kind;
    f->label_names = std::move(labels);
    f->bounds = std::move(bounds);
    // A family without labels has its one child from the start, so that it renders as 0.
    if (f->label_names.empty()) {
      f->children.push_back({{}, f->make_child()});
      f->by_values.emplace(std::vector<std::string>{}, f->children.back().child.get());
    }
    families.push_back(f);
    by_name.emplace(f->name, f);
    return f;
  }
};

MetricsRegistry::MetricsRegistry() : impl_(std::make_unique<Impl>()) {}
MetricsRegistry::~MetricsRegistry() = default;

Result<Family<Counter>> MetricsRegistry::counter(std::string name, std::string help,
                                                 std::vector<std::string> label_names) {
  CLEAVE_ASSIGN_OR_RETURN(auto f, impl_->add<Counter>(Kind::kCounter, std::move(name),
                                                      std::move(help), {}, std::move(label_names)));
  return Family<Counter>(std::move(f));
}

Result<Family<Gauge>> MetricsRegistry::gauge(std::string name, std::string help,
                                             std::vector<std::string> label_names) {
  CLEAVE_ASSIGN_OR_RETURN(auto f, impl_->add<Gauge>(Kind::kGauge, std::move(name),
                                                    std::move(help), {}, std::move(label_names)));
  return Family<Gauge>(std::move(f));
}

Result<Family<Histogram>> MetricsRegistry::histogram(std::string name, std::string help,
                                                     std::vector<double> bounds,
                                                     std::vector<std::string> label_names) {
  CLEAVE_ASSIGN_OR_RETURN(auto f, impl_->add<Histogram>(Kind::kHistogram, std::move(name),
                                                        std::move(help), std::move(bounds),
                                                        std::move(label_names)));
  return Family<Histogram>(std::move(f));
}

std::string MetricsRegistry::render() const {
  std::vector<std::shared_ptr<FamilyCore>> families;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    families = impl_->families;
  }
  std::string out;
  for (const auto& f : families) f->render(out);
  return out;
}

std::vector<double> latency_buckets_seconds() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
          0.25,   0.5,   1.0,    2.5,   5.0,  10.0,  25.0, 60.0};
}

}  // namespace cleave::metrics
