// `cleave tune`: candidates one dimension at a time, a `cleave serve` per candidate, sweeps,
// pruning, the confirmation run, and the table and chart of the result.
#include "cleave/bench/tune.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
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

  const auto measure = [&](TuneRow& row, double best_rate, double best_goodput) -> Status {
    if (elapsed_min() > o.budget_minutes) {
      row.skipped = true;
      row.note = "skipped: the budget of minutes ran out";
      return Status::Ok();
    }
    const auto yaml = dir / fmt::format("candidate-{}.yaml", result.rows.size());
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
    const auto make = [&](int, double rate) {
      return workload_for_rate(o.workload, step++, rate, o.min_run_seconds, o.max_prompts_per_run);
    };
    row.measured = true;
    if (best_rate > 0) {
      // Pruning: one run at the best candidate's rate; clearly worse (under half its goodput)
      // is dropped.
      SweepOptions probe = o.sweep;
      probe.rates = {best_rate};
      CLEAVE_ASSIGN_OR_RETURN(SweepResult first, run_sweep(b, probe, make));
      const double g = rate_goodput(first.points.front());
      if (g < 0.5 * best_goodput) {
        row.pruned = true;
        row.sweep = first;
        row.goodput = first.best_rate > 0 ? g : 0;
        row.note = fmt::format("pruned: {:.3f} req/s goodput at {:.3f} req/s, under half the best",
                               g, best_rate);
        return (*serve)->stop();
      }
    }
    SweepOptions s = o.sweep;
    if (best_rate > 0) s.start_rate = best_rate;
    CLEAVE_ASSIGN_OR_RETURN(row.sweep, run_sweep(b, s, make));
    for (const auto& p : row.sweep.points) {
      if (p.rate == row.sweep.best_rate) row.goodput = rate_goodput(p);
    }
    if (row.sweep.best_rate == 0) row.note = "no rate met the SLOs";
    return (*serve)->stop();
  };
  const auto best_so_far = [&]() -> int {
    int best = -1;
    for (size_t i = 0; i < result.rows.size(); ++i) {
      const auto& r = result.rows[i];
      if (!r.measured || r.pruned || r.sweep.best_rate <= 0) continue;
      if (best < 0 || r.goodput > result.rows[static_cast<size_t>(best)].goodput) best = static_cast<int>(i);
    }
    return best;
  };
  const auto try_candidate = [&](TuneCandidate c) -> Status {
    for (const auto& r : result.rows) {
      if (r.candidate.settings == c.settings) return Status::Ok();  // measured already
    }
    if (static_cast<int>(result.rows.size()) >= o.max_candidates) return Status::Ok();
    const int best = best_so_far();
    const double rate = best >= 0 ? result.rows[static_cast<size_t>(best)].sweep.best_rate : 0;
    const double goodput = best >= 0 ? result.rows[static_cast<size_t>(best)].goodput : 0;
    TuneRow row;
    row.candidate = std::move(c);
    result.rows.push_back(std::move(row));
    std::fprintf(stderr, "cleave tune: candidate %zu: %s\n", result.rows.size(),
                 result.rows.back().candidate.name.c_str());
    return measure(result.rows.back(), rate, goodput);
  };

  for (auto& c : mode_candidates(o.workers)) CLEAVE_RETURN_IF_ERROR(try_candidate(std::move(c)));
  for (const auto& d : later_dimensions()) {
    const int best = best_so_far();
    if (best < 0) break;
    const Settings base = result.rows[static_cast<size_t>(best)].candidate.settings;
    for (const auto& v : d.values) {
      Settings s = base;
      // The first value is the default: the base measured it already (when it left it unset).
      if (v == d.values.front() && get(s, d.key).empty()) continue;
      set(&s, d.key, v);
      CLEAVE_RETURN_IF_ERROR(try_candidate({describe(s), s}));
    }
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
  std::string out = "| # | candidate | best rate (req/s) | goodput (req/s) | runs | status |\n"
                    "|---|---|---:|---:|---:|---|\n";
  for (size_t i = 0; i < r.rows.size(); ++i) {
    const auto& row = r.rows[i];
    std::string status = row.note.empty() ? "measured" : row.note;
    if (static_cast<int>(i) == r.best) status = "**recommended**";
    out += fmt::format("| {} | {} | {:.3f} | {:.3f} | {} | {} |\n", i + 1, row.candidate.name,
                       row.sweep.best_rate, row.goodput, row.sweep.points.size(), status);
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
  double max_g = 0;
  for (const auto& row : r.rows) max_g = std::max(max_g, row.goodput);
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
    const int h = static_cast<int>(height * row.goodput / max_g);
    const int x = left + gap + i * (bar + gap);
    const char* color = i == r.best ? "#2b8a3e" : (row.pruned || row.skipped ? "#adb5bd" : "#4263eb");
    s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"/>\n", x,
                     top + height - h, bar, h, color);
    s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{:.2f}</text>\n", x + bar / 2,
                     top + height - h - 4, row.goodput);
    const int ly = top + height + 14;
    s += fmt::format("<text x=\"{0}\" y=\"{1}\" transform=\"rotate(40 {0} {1})\">{2}</text>\n",
                     x + 4, ly, esc(fmt::format("{}. {}", i + 1, row.candidate.name)));
  }
  s += "</svg>\n";
  return s;
}

}  // namespace cleave::bench
