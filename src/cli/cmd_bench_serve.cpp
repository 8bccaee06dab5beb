// `cleave bench serve`, `cleave bench sweep` and `cleave tune`: flags (named as `vllm bench serve` names them)
// wired to the load generator in cleave::bench.
#include <cmath>
#include <fstream>
#include <iostream>
#include <limits>

#include "cleave/bench/serve_bench.h"
#include "cleave/bench/sweep.h"
#include "cleave/bench/tune.h"
#include "cleave/model/default_model.h"
#include "cleave/model/tokenizer.h"
#include "commands.h"

namespace cleave::cli {
namespace {

struct ServeArgs {
  std::string base_url = "http://127.0.0.1:8000", endpoint = "completions", model, dataset = "random";
  std::string request_rate = "inf", percentiles = "99", save_result, api_key, tokenizer;
  std::vector<std::string> goodput;
  int64_t num_prompts = 1000, random_input_len = 1024, random_output_len = 128;
  double random_range_ratio = 0.0, burstiness = 1.0, scale = 1.0, time_scale = 1.0,
         length_scale = 1.0, temperature = 0.0;
  int64_t max_concurrency = 0, max_requests = 1000;
  uint64_t seed = 0;
  bool ignore_eos = false, no_progress = false;
  double request_timeout_s = 600, max_duration_s = 1800;
};

void add_common_flags(CLI::App* cmd, ServeArgs* a, bool with_rate) {
  cmd->add_option("--base-url", a->base_url, "the server, http://HOST:PORT (nothing else is contacted)");
  cmd->add_option("--endpoint", a->endpoint, "completions or chat");
  cmd->add_option("--model", a->model, "model name to request (default: the first of /v1/models)");
  cmd->add_option("--dataset", a->dataset,
                  "random, preset:chat|rag|reasoning|agentic, trace:FILE (Mooncake JSONL) or "
                  "sharegpt:FILE");
  cmd->add_option("--num-prompts", a->num_prompts, "requests to send (random, presets, sharegpt)");
  cmd->add_option("--random-input-len", a->random_input_len,
                  "random: prompt length (tokens with --tokenizer, else words)");
  cmd->add_option("--random-output-len", a->random_output_len, "random: max_tokens");
  cmd->add_option("--random-range-ratio", a->random_range_ratio,
                  "random: lengths drawn from [len*(1-r), len*(1+r)]");
  if (with_rate) {
    cmd->add_option("--request-rate", a->request_rate,
                    "requests per second (gamma arrivals), or inf to send all at once; a trace "
                    "keeps its own timestamps");
  }
  cmd->add_option("--burstiness", a->burstiness, "gamma shape of the arrivals (1: Poisson)");
  cmd->add_option("--max-concurrency", a->max_concurrency, "requests in flight at most (0: no cap)");
  cmd->add_option("--seed", a->seed, "seed of the workload and the arrivals");
  cmd->add_option("--tokenizer", a->tokenizer,
                  "GGUF file or Hugging Face directory of the served model's tokenizer: prompts "
                  "are then sized in its tokens (else in words)");
  cmd->add_flag("--ignore-eos", a->ignore_eos, "generate max_tokens tokens whatever the model says");
  cmd->add_option("--temperature", a->temperature, "sampling temperature of every request");
  cmd->add_option("--goodput", a->goodput, "SLOs in ms: ttft:MS tpot:MS e2el:MS")->expected(1, 3);
  cmd->add_option("--percentiles", a->percentiles, "percentiles to report, e.g. 50,90,99");
  cmd->add_option("--api-key", a->api_key, "sent as Authorization: Bearer KEY");
  cmd->add_option("--scale", a->scale, "presets: multiply every length (small CPU models: 0.02-0.1)");
  cmd->add_option("--max-requests", a->max_requests, "trace: replay the first N requests");
  cmd->add_option("--time-scale", a->time_scale, "trace: multiply the timestamps (0.5: twice as fast)");
  cmd->add_option("--length-scale", a->length_scale,
                  "trace: multiply input/output lengths and the 512-token block size");
  cmd->add_option("--request-timeout", a->request_timeout_s, "seconds one request may take");
  cmd->add_option("--max-duration", a->max_duration_s,
                  "seconds the whole run may take; requests still open then count as failed");
  cmd->add_flag("--no-progress", a->no_progress, "no progress bar on stderr");
}

// Fills the options from the flags; false (message printed) when one is bad.
bool to_options(const ServeArgs& a, std::string_view cmd, bench::ServeBenchOptions* o,
                bench::WorkloadOptions* w) {
  const auto bad = [&](const std::string& msg) {
    std::cerr << "cleave bench " << cmd << ": " << msg << "\n";
    return false;
  };
  o->base_url = a.base_url;
  o->endpoint = a.endpoint;
  if (a.endpoint == "/v1/completions") o->endpoint = "completions";
  if (a.endpoint == "/v1/chat/completions") o->endpoint = "chat";
  o->model = a.model;
  o->api_key = a.api_key;
  if (a.request_rate == "inf") {
    o->request_rate = std::numeric_limits<double>::infinity();
  } else {
    char* end = nullptr;
    o->request_rate = std::strtod(a.request_rate.c_str(), &end);
    if (a.request_rate.empty() || end != a.request_rate.c_str() + a.request_rate.size() ||
        !(o->request_rate > 0) || !std::isfinite(o->request_rate)) {
      return bad("--request-rate '" + a.request_rate + "' is not a positive number or inf");
    }
  }
  o->burstiness = a.burstiness;
  o->max_concurrency = a.max_concurrency;
  o->seed = a.seed;
  o->ignore_eos = a.ignore_eos;
  o->temperature = a.temperature;
  o->progress = !a.no_progress;
  auto slo = bench::parse_goodput(a.goodput);
  if (!slo.ok()) return bad(slo.status().message());
  o->goodput = *slo;
  auto pct = bench::parse_percentiles(a.percentiles);
  if (!pct.ok()) return bad(pct.status().message());
  o->percentiles = *pct;
  if (!(a.request_timeout_s > 0) || !(a.max_duration_s > 0)) {
    return bad("--request-timeout and --max-duration must be positive seconds");
  }
  o->request_timeout = std::chrono::milliseconds(static_cast<int64_t>(a.request_timeout_s * 1000));
  o->max_duration = std::chrono::milliseconds(static_cast<int64_t>(a.max_duration_s * 1000));
  if (auto st = bench::validate(*o); !st.ok()) return bad(st.message());
  w->dataset = a.dataset;
  w->num_prompts = a.num_prompts;
  w->random_input_len = a.random_input_len;
  w->random_output_len = a.random_output_len;
  w->random_range_ratio = a.random_range_ratio;
  w->scale = a.scale;
  w->max_requests = a.max_requests;
  w->time_scale = a.time_scale;
  w->length_scale = a.length_scale;
  w->seed = a.seed;
  if (!a.tokenizer.empty()) {
    auto tok = load_tokenizer(a.tokenizer);
    if (!tok.ok()) return bad("--tokenizer " + a.tokenizer + ": " + tok.status().message());
    w->tokenizer = std::move(*tok);
  }
  return true;
}

bool resolve_model(std::string_view cmd, bench::ServeBenchOptions* o) {
  if (!o->model.empty()) return true;
  auto m = bench::first_served_model(*o);
  if (!m.ok()) {
    std::cerr << "cleave bench " << cmd << ": " << m.status().message() << "\n";
    return false;
  }
  o->model = *m;
  return true;
}

bool write_json(std::string_view cmd, const std::string& path, const nlohmann::ordered_json& j) {
  std::ofstream f(path);
  f << j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << "\n";
  if (!f) {
    std::cerr << "cleave bench " << cmd << ": cannot write " << path << "\n";
    return false;
  }
  return true;
}

}  // namespace

void add_bench_serve_commands(CLI::App* bench, int* exit_code) {
  auto* serve = bench->add_subcommand(
      "serve", "Load an OpenAI-compatible server with a workload and report TTFT, TPOT, ITL, "
               "E2EL, throughput and goodput (as `vllm bench serve`)");
  auto a = std::make_shared<ServeArgs>();
  add_common_flags(serve, a.get(), /*with_rate=*/true);
  serve->add_option("--save-result", a->save_result, "also write the result JSON to FILE");
  serve->callback([a, exit_code] {
    bench::ServeBenchOptions o;
    bench::WorkloadOptions wo;
    if (!to_options(*a, "serve", &o, &wo)) {
      *exit_code = 2;
      return;
    }
    auto workload = bench::build_workload(wo);
    if (!workload.ok()) {
      std::cerr << "cleave bench serve: " << workload.status().message() << "\n";
      *exit_code = workload.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
      return;
    }
    if (!resolve_model("serve", &o)) {
      *exit_code = 1;
      return;
    }
    auto run = bench::run_serve_bench(o, *workload);
    if (!run.ok()) {
      std::cerr << "cleave bench serve: " << run.status().message() << "\n";
      *exit_code = 1;
      return;
    }
    std::cout << bench::format_report(o, *workload, *run) << std::flush;
    if (!a->save_result.empty() &&
        !write_json("serve", a->save_result, bench::result_json(o, *workload, *run))) {
      *exit_code = 1;
      return;
    }
    for (const auto& r : run->records) {
      if (!r.success) {
        std::cerr << "cleave bench serve: first failure: " << r.error << "\n";
        break;
      }
    }
    *exit_code = run->metrics.completed > 0 ? 0 : 1;
  });

  auto* sweep = bench->add_subcommand(
      "sweep", "Find the highest request rate at which at least --attainment of the requests "
               "meet every --goodput SLO (runs `bench serve` at several rates)");
  auto sa = std::make_shared<ServeArgs>();
  struct SweepArgs {
    std::string rates;
    bench::SweepOptions o;
    double min_run_seconds = 0;
    int64_t max_prompts = 5000;
  };
  auto sw = std::make_shared<SweepArgs>();
  add_common_flags(sweep, sa.get(), /*with_rate=*/false);
  sweep->add_option("--rates", sw->rates, "rates to try, e.g. 0.5,1,2 (default: a search)");
  sweep->add_option("--start-rate", sw->o.start_rate, "the search's first rate (req/s)");
  sweep->add_option("--attainment", sw->o.attainment, "share of requests that must meet the SLOs");
  sweep->add_option("--max-runs", sw->o.max_runs, "runs of the search at most");
  sweep->add_option("--min-throughput-ratio", sw->o.min_throughput_ratio,
                    "a rate passes only if the server completed at least this share of it");
  sweep->add_option("--min-run-seconds", sw->min_run_seconds,
                    "send at least rate x S requests per run (default 0: --num-prompts each)");
  sweep->add_option("--max-prompts-per-run", sw->max_prompts, "cap of --min-run-seconds");
  sweep->add_option("--per-worker,--per-gpu", sw->o.per_worker,
                    "divide the goodput by the N workers (or GPUs) it used");
  sweep->add_option("--save-result", sa->save_result, "also write the sweep as JSON to FILE");
  sweep->callback([sa, sw, exit_code] {
    bench::ServeBenchOptions o;
    bench::WorkloadOptions wo;
    if (!to_options(*sa, "sweep", &o, &wo)) {
      *exit_code = 2;
      return;
    }
    sw->o.rates.clear();
    if (!sw->rates.empty()) {
      std::string item;
      for (size_t pos = 0; pos <= sw->rates.size();) {
        size_t end = sw->rates.find(',', pos);
        if (end == std::string::npos) end = sw->rates.size();
        item = sw->rates.substr(pos, end - pos);
        char* e = nullptr;
        const double r = std::strtod(item.c_str(), &e);
        if (item.empty() || e != item.c_str() + item.size() || !(r > 0) || !std::isfinite(r)) {
          std::cerr << "cleave bench sweep: --rates: '" << item << "' is not a positive number\n";
          *exit_code = 2;
          return;
        }
        sw->o.rates.push_back(r);
        pos = end + 1;
      }
    }
    if (!resolve_model("sweep", &o)) {
      *exit_code = 1;
      return;
    }
    const auto make = [wo, sw](int step, double rate) {
      return bench::workload_for_rate(wo, step, rate, sw->min_run_seconds, sw->max_prompts);
    };
    if (auto first = make(0, 1.0); !first.ok()) {
      std::cerr << "cleave bench sweep: " << first.status().message() << "\n";
      *exit_code = 2;
      return;
    }
    auto result = bench::run_sweep(o, sw->o, make, [](const bench::SweepPoint& p) {
      std::cerr << "cleave bench sweep: " << p.rate << " req/s: " << 100 * p.attainment
                << "% of requests met the SLOs\n";
    });
    if (!result.ok()) {
      std::cerr << "cleave bench sweep: " << result.status().message() << "\n";
      *exit_code = result.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
      return;
    }
    std::cout << bench::format_sweep(o, sw->o, *result) << std::flush;
    if (!sa->save_result.empty() &&
        !write_json("sweep", sa->save_result, bench::sweep_json(sw->o, *result))) {
      *exit_code = 1;
      return;
    }
    *exit_code = 0;
  });
}

void add_tune_command(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand(
      "tune", "Serve a workload under candidate configurations on this machine, sweep each for "
              "goodput, and write the best as a config for `cleave serve --config`");
  struct TuneArgs {
    std::string model, workload = "preset:chat", out;
    std::vector<std::string> slo;
    int workers = 2, max_runs = 4, max_candidates = 100;
    double budget_minutes = 60, attainment = 0.9, start_rate = 1.0, scale = 0.05;
    int64_t num_prompts = 30, max_concurrency = 0, max_requests = 200;
    double time_scale = 1.0, length_scale = 0.02, request_timeout_s = 120, min_run_seconds = 10;
    int64_t max_prompts_per_run = 600;
    uint64_t seed = 0;
    std::string endpoint = "completions";
  };
  auto a = std::make_shared<TuneArgs>();
  cmd->add_option("--model", a->model, "model to serve (default: the embedded default)");
  cmd->add_option("--workload", a->workload, "preset:NAME, trace:FILE, sharegpt:FILE or random");
  cmd->add_option("--slo", a->slo, "SLOs in ms, e.g. ttft:500,tpot:50")->required()->expected(1, 3);
  cmd->add_option("--out", a->out, "the recommended config (YAML); FILE.md and FILE.svg beside it")
      ->required();
  cmd->add_option("--budget-minutes", a->budget_minutes, "stop starting candidates after this");
  cmd->add_option("--workers", a->workers, "worker (CPU) budget: unified replicas or P + D");
  cmd->add_option("--attainment", a->attainment, "share of requests that must meet the SLOs");
  cmd->add_option("--max-runs", a->max_runs, "sweep runs per candidate at most");
  cmd->add_option("--max-candidates", a->max_candidates, "candidates measured at most");
  cmd->add_option("--start-rate", a->start_rate, "the first candidate's first rate (req/s)");
  cmd->add_option("--scale", a->scale, "presets: multiply every length");
  cmd->add_option("--num-prompts", a->num_prompts, "requests per sweep run, at least");
  cmd->add_option("--min-run-seconds", a->min_run_seconds,
                  "runs at high rates send rate x S requests (at most --max-prompts-per-run)");
  cmd->add_option("--max-prompts-per-run", a->max_prompts_per_run, "cap of --min-run-seconds");
  cmd->add_option("--max-concurrency", a->max_concurrency, "requests in flight at most (0: no cap)");
  cmd->add_option("--max-requests", a->max_requests, "trace: requests per run");
  cmd->add_option("--time-scale", a->time_scale, "trace: multiply the timestamps");
  cmd->add_option("--length-scale", a->length_scale, "trace: multiply lengths and the block size");
  cmd->add_option("--request-timeout", a->request_timeout_s, "seconds one request may take");
  cmd->add_option("--endpoint", a->endpoint, "completions or chat");
  cmd->add_option("--seed", a->seed, "seed of the workloads");
  cmd->callback([a, exit_code] {
    bench::TuneOptions o;
    o.model = a->model;
    o.workers = a->workers;
    o.budget_minutes = a->budget_minutes;
    o.max_candidates = a->max_candidates;
    o.min_run_seconds = a->min_run_seconds;
    o.max_prompts_per_run = a->max_prompts_per_run;
    auto slo = bench::parse_goodput(a->slo);
    if (!slo.ok()) {
      std::cerr << "cleave tune: " << slo.status().message() << "\n";
      *exit_code = 2;
      return;
    }
    o.bench.goodput = *slo;
    o.bench.endpoint = a->endpoint;
    o.bench.max_concurrency = a->max_concurrency;
    o.bench.seed = a->seed;
    o.bench.progress = false;
    o.bench.request_timeout = std::chrono::milliseconds(static_cast<int64_t>(a->request_timeout_s * 1000));
    o.bench.max_duration = std::chrono::minutes(10);
    o.sweep.attainment = a->attainment;
    o.sweep.max_runs = a->max_runs;
    o.sweep.start_rate = a->start_rate;
    o.workload.dataset = a->workload;
    o.workload.num_prompts = a->num_prompts;
    o.workload.scale = a->scale;
    o.workload.max_requests = a->max_requests;
    o.workload.time_scale = a->time_scale;
    o.workload.length_scale = a->length_scale;
    o.workload.seed = a->seed;
    // Prompts sized in the served model's tokens: its own tokenizer, or the embedded default's.
    auto model_path = a->model.empty() ? ensure_default_model() : Result<std::string>(a->model);
    auto tok = model_path.ok() ? load_tokenizer(*model_path)
                               : Result<std::unique_ptr<Tokenizer>>(model_path.status());
    if (!tok.ok()) {
      std::cerr << "cleave tune: tokenizer of the model: " << tok.status().message() << "\n";
      *exit_code = 1;
      return;
    }
    o.workload.tokenizer = std::move(*tok);
    if (a->max_runs <= 0 || a->max_candidates <= 0) {
      std::cerr << "cleave tune: --max-runs and --max-candidates must be positive\n";
      *exit_code = 2;
      return;
    }
    auto r = bench::run_tune(o);
    if (!r.ok()) {
      std::cerr << "cleave tune: " << r.status().message() << "\n";
      *exit_code = r.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
      return;
    }
    const std::string table = bench::tune_table(*r);
    std::cout << table << std::flush;
    std::string stem = a->out;
    if (stem.size() > 5 && stem.ends_with(".yaml")) stem.resize(stem.size() - 5);
    const auto write = [&](const std::string& path, const std::string& text) {
      std::ofstream f(path);
      f << text;
      if (!f) std::cerr << "cleave tune: cannot write " << path << "\n";
      return static_cast<bool>(f);
    };
    bool ok = write(stem + ".md", "# cleave tune: " + a->workload + "\n\n" + table) &&
              write(stem + ".svg", bench::tune_svg(*r, "cleave tune: goodput per candidate (" +
                                                         a->workload + ")"));
    if (r->best < 0) {
      std::cerr << "cleave tune: no candidate met the SLOs; no config written\n";
      *exit_code = 1;
      return;
    }
    const auto& win = r->rows[static_cast<size_t>(r->best)];
    char numbers[200];
    std::snprintf(numbers, sizeof(numbers),
                  "# goodput %.3f req/s at %.3f req/s; confirmation run %.3f req/s; search %.0f s\n",
                  win.goodput, win.sweep.best_rate, r->confirmed_goodput, r->seconds);
    std::string header = "# cleave tune: " + a->workload + "; recommended: " + win.candidate.name +
                         "\n" + numbers;
    ok = write(a->out, header + bench::candidate_yaml(win.candidate, a->model)) && ok;
    std::cout << "Recommended config: " << a->out << " (table " << stem << ".md, chart " << stem
              << ".svg)\n";
    *exit_code = ok ? 0 : 1;
  });
}

}  // namespace cleave::cli
