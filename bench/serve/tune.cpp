// `cleave tune`: candidates one dimension at a time, a `cleave serve` per candidate, sweeps,
// pruning, the confirmation run, and the table and chart of the result.
#include "cleave/bench/tune.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include <fmt/format.h>

#include "serve_process.h"

namespace cleave::bench {
namespace {

// Goodput of a sweep point: the rate of requests that met the SLOs at the offered rate (rate x
// attainment). vLLM's request_goodput divides by the run's duration instead, which moves with
// the span of that run's random arrivals (+-20% for 20 Poisson arrivals) even when the server
// does not: a prediction made from it would not survive a rerun.
double rate_goodput(const SweepPoint& p) { return p.rate * p.attainment; }

using Settings = std::vector<std::pair<std::string, std::string>>;

void set(Settings* s, const std::string& key, const std::string& value) {
  for (auto& [k, v] : *s) {
    if (k == key) {
      v = value;
      return;
    }
  }
  s->emplace_back(key, value);
}

std::string get(const Settings& s, const std::string& key) {
  for (const auto& [k, v] : s) {
    if (k == key) return v;
  }
  return "";
}

// Later dimensions: (key, values, label).
struct Dimension {
  std::string key;
  std::vector<std::string> values;
  std::string label;
};
const std::vector<Dimension>& later_dimensions() {
  static const std::vector<Dimension> dims = {
      {"engine.max_tokens_per_step", {"256", "128", "1024"}, "tok/step"},
      {"engine.max_num_seqs", {"64", "16"}, "max seqs"},
      {"engine.prefix_caching", {"true", "false"}, "prefix cache"},
      {"engine.kv_cache_bytes", {"268435456", "33554432"}, "KV bytes"},
  };
  return dims;
}

std::string describe(const Settings& s) {
  std::string mode = get(s, "router.mode");
  std::string out;
  if (mode == "unified") {
    out = fmt::format("unified x{} ({} thr)", get(s, "pools.unified.replicas"),
                      get(s, "pools.unified.threads"));
  } else {
    out = fmt::format("P:D {}:{}", get(s, "pools.prefill.replicas"), get(s, "pools.decode.replicas"));
  }
  for (const auto& d : later_dimensions()) {
    const std::string v = get(s, d.key);
    if (!v.empty() && v != d.values.front()) out += fmt::format(", {} {}", d.label, v);
  }
  return out;
}

std::string yaml_scalar(const std::string& v) {
  const bool plain = !v.empty() && v.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_.-") ==
                                       std::string::npos;
  if (plain) return v;
  std::string out = "\"";
  for (char c : v) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

}  // namespace

std::vector<TuneCandidate> mode_candidates(int workers) {
  std::vector<TuneCandidate> out;
  const auto add = [&](Settings s) { out.push_back({describe(s), std::move(s)}); };
  for (const int r : workers > 1 ? std::vector<int>{1, workers} : std::vector<int>{1}) {
    Settings s;
    set(&s, "router.mode", "unified");
    set(&s, "pools.unified.replicas", std::to_string(r));
    set(&s, "pools.unified.threads", std::to_string(std::max(1, workers / r)));
    add(s);
  }
  for (int p = 1; p < workers; ++p) {
    const int d = workers - p;
    Settings s;
    set(&s, "router.mode", "disaggregated");
    set(&s, "pools.prefill.replicas", std::to_string(p));
    set(&s, "pools.decode.replicas", std::to_string(d));
    set(&s, "pools.prefill.threads", "1");
    set(&s, "pools.decode.threads", "1");
    add(s);
  }
  return out;
}

std::string candidate_yaml(const TuneCandidate& c, const std::string& model) {
  // Nested maps of the dotted keys, in the order first seen.
  struct Node {
    std::string value;
    std::vector<std::string> order;
    std::map<std::string, Node> kids;
  };
  Node root;
  Settings all = c.settings;
  if (!model.empty()) all.insert(all.begin(), {"model.path", model});
  for (const auto& [key, value] : all) {
    Node* n = &root;
    size_t pos = 0;
    while (pos <= key.size()) {
      size_t dot = key.find('.', pos);
      if (dot == std::string::npos) dot = key.size();
      const std::string part = key.substr(pos, dot - pos);
      if (!n->kids.count(part)) n->order.push_back(part);
      n = &n->kids[part];
      pos = dot + 1;
    }
    n->value = value;
  }
  std::string out;
  const auto emit = [&out](const auto& self, const Node& n, int depth) -> void {
    for (const auto& name : n.order) {
      const Node& k = n.kids.at(name);
      out += std::string(static_cast<size_t>(depth * 2), ' ') + name + ":";
      if (k.kids.empty()) {
        out += " " + yaml_scalar(k.value) + "\n";
      } else {
        out += "\n";
        self(self, k, depth + 1);
      }
    }
  };
  emit(emit, root, 0);
  return out;
}

Result<TuneResult> run_tune(const TuneOptions& o) {
  if (o.workers < 1) return InvalidArgument(fmt::format("--workers {} is not positive", o.workers));
  if (!(o.budget_minutes > 0)) {
    return InvalidArgument(fmt::format("--budget-minutes {} is not positive", o.budget_minutes));
  }
  if (!o.bench.goodput.any()) return InvalidArgument("--slo needs at least one of ttft, tpot, e2el");
  CLEAVE_RETURN_IF_ERROR(build_workload(o.workload).status());
  const auto started = std::chrono::steady_clock::now();
  const auto elapsed_min = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count() / 60;
  };
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("cleave-tune-{}", ::getpid());
  std::filesystem::create_directories(dir);
  TuneResult result;
  int step = 0;

  // Runs `fn` against a `cleave serve` of the row's candidate; a candidate that does not start
  // or serves no model gets a note instead.
  const auto with_serve = [&](TuneRow& row,
                              const std::function<Status(const ServeBenchOptions&)>& fn) -> Status {
    const auto yaml = dir / fmt::format("candidate-{}.yaml", &row - result.rows.data());
    std::ofstream(yaml) << candidate_yaml(row.candidate, o.model);
    auto serve = ServeProcess::start(o.cleave_binary, yaml.string(), std::chrono::seconds(180));
    if (!serve.ok()) {
      row.note = "failed to start: " + serve.status().message().substr(0, 300);
      return Status::Ok();
    }
    ServeBenchOptions b = o.bench;
    b.base_url = (*serve)->url();
    auto model = first_served_model(b);
    if (!model.ok()) {
      row.note = "no model: " + model.status().message();
      return Status::Ok();
    }
    b.model = *model;
    CLEAVE_RETURN_IF_ERROR(fn(b));
    return (*serve)->stop();
  };
  const auto make = [&](int, double rate) {
    return workload_for_rate(o.workload, step++, rate, o.min_run_seconds, o.max_prompts_per_run);
  };
  const auto out_of_budget = [&](TuneRow& row, const char* what) {
    if (elapsed_min() <= o.budget_minutes) return false;
    row.skipped = true;
    row.note = fmt::format("{}: the budget of minutes ran out", what);
    return true;
  };
  const auto best_so_far = [&]() -> int {
    int best = -1;
    for (size_t i = 0; i < result.rows.size(); ++i) {
      const auto& r = result.rows[i];
      if (!r.swept || r.sweep.best_rate <= 0) continue;
      if (best < 0 || r.goodput > result.rows[static_cast<size_t>(best)].goodput) best = static_cast<int>(i);
    }
    return best;
  };

  // One group of candidates (the modes, or the values of one later dimension), breadth first:
  // each is probed with one run at `probe_rate`, then they are swept from that rate in the order
  // of their probes' goodput, best first, while the budget lasts (the probe is the sweep's first
  // point). A probe under half the best goodput known at that rate (`known_goodput`, or the
  // group's best probe) prunes its candidate. So a budget that runs out in the first sweep has
  // still measured every candidate of the group once, and sweeps the likeliest winner first.
  const auto run_group = [&](std::vector<TuneCandidate> group, double probe_rate,
                             double known_goodput) -> Status {
    std::vector<size_t> idx;
    for (auto& c : group) {
      bool seen = false;
      for (const auto& r : result.rows) seen = seen || r.candidate.settings == c.settings;
      if (seen || static_cast<int>(result.rows.size()) >= o.max_candidates) continue;
      TuneRow row;
      row.candidate = std::move(c);
      result.rows.push_back(std::move(row));
      idx.push_back(result.rows.size() - 1);
    }
    for (const size_t i : idx) {
      TuneRow& row = result.rows[i];
      if (out_of_budget(row, "skipped")) continue;
      std::fprintf(stderr, "cleave tune: candidate %zu: %s: probe at %.3f req/s\n", i + 1,
                   row.candidate.name.c_str(), probe_rate);
      CLEAVE_RETURN_IF_ERROR(with_serve(row, [&](const ServeBenchOptions& b) -> Status {
        SweepOptions probe = o.sweep;
        probe.rates = {probe_rate};
        CLEAVE_ASSIGN_OR_RETURN(SweepResult first, run_sweep(b, probe, make));
        row.probe = first.points.front();
        return Status::Ok();
      }));
      if (row.probe) known_goodput = std::max(known_goodput, rate_goodput(*row.probe));
    }
    const auto order = [&](size_t a, size_t b) {
      const auto& pa = result.rows[a].probe;
      const auto& pb = result.rows[b].probe;
      if (!pa || !pb) return pa.has_value() && !pb.has_value();
      if (rate_goodput(*pa) != rate_goodput(*pb)) return rate_goodput(*pa) > rate_goodput(*pb);
      return pa->metrics.e2el.median < pb->metrics.e2el.median;  // the same goodput: less latency
    };
    std::stable_sort(idx.begin(), idx.end(), order);
    for (const size_t i : idx) {
      TuneRow& row = result.rows[i];
      if (!row.probe) continue;
      const double g = rate_goodput(*row.probe);
      if (g < 0.5 * known_goodput) {
        row.pruned = true;
        row.note = fmt::format("pruned: {:.3f} req/s goodput at {:.3f} req/s, under half the best",
                               g, probe_rate);
        continue;
      }
      if (out_of_budget(row, "not swept")) continue;
      std::fprintf(stderr, "cleave tune: candidate %zu: %s: sweep\n", i + 1, row.candidate.name.c_str());
      CLEAVE_RETURN_IF_ERROR(with_serve(row, [&](const ServeBenchOptions& b) -> Status {
        SweepOptions s = o.sweep;
        s.start_rate = probe_rate;
        s.known = {*row.probe};
        CLEAVE_ASSIGN_OR_RETURN(row.sweep, run_sweep(b, s, make));
        row.swept = true;
        for (const auto& p : row.sweep.points) {
          if (p.rate == row.sweep.best_rate) row.goodput = rate_goodput(p);
        }
        if (row.sweep.best_rate == 0) row.note = "no rate met the SLOs";
        return Status::Ok();
      }));
    }
    return Status::Ok();
  };

  CLEAVE_RETURN_IF_ERROR(run_group(mode_candidates(o.workers), o.sweep.start_rate, 0));
  for (const auto& d : later_dimensions()) {
    const int best = best_so_far();
    if (best < 0) break;
    const TuneRow& base = result.rows[static_cast<size_t>(best)];
    std::vector<TuneCandidate> group;
    for (const auto& v : d.values) {
      Settings s = base.candidate.settings;
      // The first value is the default: the base measured it already (when it left it unset).
      if (v == d.values.front() && get(s, d.key).empty()) continue;
      set(&s, d.key, v);
      group.push_back({describe(s), s});
    }
    CLEAVE_RETURN_IF_ERROR(run_group(std::move(group), base.sweep.best_rate, base.goodput));
  }
  result.best = best_so_far();
  if (result.best >= 0) {
    // Confirmation: the winner served anew, measured once at its rate with a fresh workload.
    const TuneRow& win = result.rows[static_cast<size_t>(result.best)];
    result.predicted_goodput = win.goodput;
    const auto yaml = dir / "recommended.yaml";
    std::ofstream(yaml) << candidate_yaml(win.candidate, o.model);
    CLEAVE_ASSIGN_OR_RETURN(auto serve,
                            ServeProcess::start(o.cleave_binary, yaml.string(), std::chrono::seconds(180)));
    ServeBenchOptions b = o.bench;
    b.base_url = serve->url();
    CLEAVE_ASSIGN_OR_RETURN(b.model, first_served_model(b));
    b.request_rate = win.sweep.best_rate;
    // A first run warms the new server as the sweep's earlier runs warmed the candidate's (its
    // prefix cache, first-use allocations); the second is the measurement.
    ServeBenchRun run;
    for (int pass = 0; pass < 2; ++pass) {
      CLEAVE_ASSIGN_OR_RETURN(Workload wl,
                              workload_for_rate(o.workload, 777 + pass, win.sweep.best_rate,
                                                o.min_run_seconds, o.max_prompts_per_run));
      retime_arrivals(&wl, win.sweep.best_rate);
      CLEAVE_ASSIGN_OR_RETURN(run, run_serve_bench(b, wl));
    }
    result.confirmed_attainment = slo_attainment(run.records, b.goodput);
    result.confirmed_goodput = win.sweep.best_rate * result.confirmed_attainment;
    result.confirmed_failed = run.metrics.failed;
    for (const auto& rec : run.records) {
      if (!rec.success) {
        result.confirmed_first_error = rec.error.substr(0, 200);
        break;
      }
    }
    result.confirmed_within = std::abs(result.confirmed_goodput - result.predicted_goodput) <=
                              o.confirm_tolerance * result.predicted_goodput;
    CLEAVE_RETURN_IF_ERROR(serve->stop());
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return result;
}

std::string tune_table(const TuneResult& r) {
  std::string out = "| # | candidate | probe: goodput at rate (req/s) | best rate (req/s) | goodput (req/s) "
                    "| runs | status |\n|---|---|---:|---:|---:|---:|---|\n";
  for (size_t i = 0; i < r.rows.size(); ++i) {
    const auto& row = r.rows[i];
    std::string status = row.note.empty() ? (row.swept ? "swept" : "probed") : row.note;
    if (static_cast<int>(i) == r.best) status = "**recommended**";
    const std::string probe =
        row.probe ? fmt::format("{:.3f} at {:.3f}", rate_goodput(*row.probe), row.probe->rate) : "-";
    const size_t runs = row.swept ? row.sweep.points.size() : (row.probe ? 1 : 0);
    out += fmt::format("| {} | {} | {} | {:.3f} | {:.3f} | {} | {} |\n", i + 1, row.candidate.name,
                       probe, row.sweep.best_rate, row.goodput, runs, status);
  }
  if (r.best >= 0) {
    out += fmt::format(
        "\nConfirmation run: {:.3f} req/s goodput against {:.3f} predicted ({}); SLO attainment "
        "{:.1f}%, {} failed{}.\n",
        r.confirmed_goodput, r.predicted_goodput, r.confirmed_within ? "within 10%" : "NOT within 10%",
        100 * r.confirmed_attainment, r.confirmed_failed,
        r.confirmed_first_error.empty() ? "" : " (first: " + r.confirmed_first_error + ")");
  } else {
    out += "\nNo candidate met the SLOs at any rate tried.\n";
  }
  out += fmt::format("The search took {:.1f} s.\n", r.seconds);
  return out;
}

std::string tune_svg(const TuneResult& r, const std::string& title) {
  const int n = static_cast<int>(r.rows.size());
  const int bar = 48, gap = 24, left = 70, top = 50, height = 260, bottom = 170;
  const int width = left + n * (bar + gap) + gap;
  // A candidate that was only probed (pruned, or the budget ran out before its sweep) shows its
  // probe's goodput, in grey.
  const auto shown = [](const TuneRow& row) {
    return row.swept || !row.probe ? row.goodput : rate_goodput(*row.probe);
  };
  double max_g = 0;
  for (const auto& row : r.rows) max_g = std::max(max_g, shown(row));
  if (max_g <= 0) max_g = 1;
  const auto esc = [](const std::string& s) {
    std::string o;
    for (char c : s) {
      if (c == '<') o += "&lt;";
      else if (c == '>') o += "&gt;";
      else if (c == '&') o += "&amp;";
      else o += c;
    }
    return o;
  };
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"24\" font-size=\"15\">{}</text>\n",
      std::max(width, 420), top + height + bottom, left, esc(title));
  s += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"black\"/>\n", left, top,
                   top + height);
  s += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"black\"/>\n", left,
                   top + height, width);
  for (int t = 0; t <= 4; ++t) {
    const double v = max_g * t / 4;
    const int y = top + height - static_cast<int>(height * t / 4);
    s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{:.2f}</text>\n", left - 6, y + 4, v);
  }
  s += fmt::format("<text x=\"16\" y=\"{}\" transform=\"rotate(-90 16 {})\">goodput (req/s)</text>\n",
                   top + height / 2 + 40, top + height / 2 + 40);
  for (int i = 0; i < n; ++i) {
    const auto& row = r.rows[static_cast<size_t>(i)];
    const int h = static_cast<int>(height * shown(row) / max_g);
    const int x = left + gap + i * (bar + gap);
    const char* color = i == r.best ? "#2b8a3e" : (row.swept ? "#4263eb" : "#adb5bd");
    s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"/>\n", x,
                     top + height - h, bar, h, color);
    s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{:.2f}</text>\n", x + bar / 2,
                     top + height - h - 4, shown(row));
    const int ly = top + height + 14;
    s += fmt::format("<text x=\"{0}\" y=\"{1}\" transform=\"rotate(40 {0} {1})\">{2}</text>\n",
                     x + 4, ly, esc(fmt::format("{}. {}{}", i + 1, row.candidate.name,
                                     row.swept || !row.probe ? "" : " (probe)")));
  }
  s += "</svg>\n";
  return s;
}

}  // namespace cleave::bench
