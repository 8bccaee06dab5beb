// `cleave bench transfer`: transfer-engine bandwidth and latency against a raw fi_write loop
// (`bench serve` and `bench sweep` are in cmd_bench_serve.cpp; main.cpp adds them, so that the
// standalone transfer_bench links this file alone).
#include <fstream>
#include <iostream>

#include "commands.h"
#include "nlohmann/json.hpp"

#include "cleave/bench/transfer_bench.h"

namespace cleave::cli {

CLI::App* add_bench_command(CLI::App& app, int* exit_code) {
  auto* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  auto* cmd = bench->add_subcommand(
      "transfer", "Write bandwidth/latency of the transfer engine vs a raw fi_write loop (two processes)");
  struct Args {
    std::string provider = "tcp;ofi_rxm";
    std::string sizes = "4KiB,64KiB,1MiB,4MiB";
    int64_t iters = 200, rails = 1, window = 64, rounds = 3;
    std::string json, role = "initiator";
    uint64_t region_bytes = 0;
    bool delivery_complete = true;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--provider", a->provider, "libfabric provider, e.g. 'tcp;ofi_rxm', shm, efa");
  cmd->add_option("--sizes", a->sizes, "comma-separated sizes (4096, 64KiB, 1MiB...)");
  cmd->add_option("--iters", a->iters, "writes per size")->check(CLI::PositiveNumber);
  cmd->add_option("--rails", a->rails, "rails (endpoints) of the engine")->check(CLI::Range(1, 64));
  cmd->add_option("--window", a->window, "writes in flight")->check(CLI::PositiveNumber);
  cmd->add_option("--rounds", a->rounds,
                  "rounds of (ours, then raw) at every size; each figure is the median, and the "
                  "ratio is the median of the rounds' ours/raw (their range is printed too)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--delivery-complete", a->delivery_complete,
                  "post both ours and the raw loop's writes with FI_DELIVERY_COMPLETE (true, the "
                  "engine's default) or with the provider's default completion (false)");
  cmd->add_option("--json", a->json, "also write the results as a JSON list to FILE");
  cmd->add_option("--role", a->role, "internal: initiator, round or target")->group("");
  cmd->add_option("--region-bytes", a->region_bytes, "internal: target region size")->group("");
  cmd->callback([a, exit_code] {
    using namespace cleave::transfer;
    if (a->role == "target") {
      *exit_code = run_transfer_bench_target(a->provider, a->rails, a->region_bytes);
      return;
    }
    auto sizes = parse_sizes(a->sizes);
    if (!sizes.ok()) {
      std::cerr << "cleave bench transfer: " << sizes.status().message() << "\n";
      *exit_code = 2;
      return;
    }
    TransferBenchOptions o;
    o.provider = a->provider;
    o.sizes = *sizes;
    o.iters = a->iters;
    o.rails = a->rails;
    o.window = a->window;
    o.rounds = a->rounds;
    o.delivery_complete = a->delivery_complete;
    o.target_command = {"/proc/self/exe", "bench", "transfer"};
    if (a->role == "round") {
      *exit_code = run_transfer_bench_round(o);
      return;
    }
    auto rows = run_transfer_bench(o);
    if (!rows.ok()) {
      std::cerr << "cleave bench transfer: " << rows.status().to_string() << "\n";
      *exit_code = 1;
      return;
    }
    nlohmann::json j = nlohmann::json::array();
    const std::string cc = tcp_congestion_control(o.provider);
    std::printf("%-14s %12s %10s %10s %10s %10s %7s %13s  (delivery_complete=%s on both sides; "
                "medians of %ld rounds%s%s)\n",
                "provider", "size_bytes", "GB/s", "p50_us", "p99_us", "raw_GB/s", "ratio",
                "ratio_range", o.delivery_complete ? "true" : "false",
                static_cast<long>(o.rounds), cc.empty() ? "" : "; tcp congestion control ",
                cc.c_str());
    for (const auto& r : *rows) {
      std::printf("%-14s %12lu %10.3f %10.1f %10.1f %10.3f %7.3f %6.3f-%-6.3f\n",
                  r.provider.c_str(), static_cast<unsigned long>(r.size_bytes), r.gbps, r.p50_us,
                  r.p99_us, r.raw_gbps, r.ratio, r.ratio_min, r.ratio_max);
      nlohmann::json row = {{"provider", r.provider}, {"size_bytes", r.size_bytes},
                            {"gbps", r.gbps}, {"p50_us", r.p50_us}, {"p99_us", r.p99_us},
                            {"raw_gbps", r.raw_gbps}, {"ratio", r.ratio},
                            {"ratio_min", r.ratio_min}, {"ratio_max", r.ratio_max},
                            {"rounds", r.rounds}, {"delivery_complete", o.delivery_complete}};
      if (!cc.empty()) row["tcp_congestion_control"] = cc;
      j.push_back(std::move(row));
    }
    if (!a->json.empty()) {
      std::ofstream f(a->json);
      f << j.dump(2) << "\n";
      if (!f) {
        std::cerr << "cleave bench transfer: cannot write " << a->json << "\n";
        *exit_code = 1;
        return;
      }
    }
    *exit_code = 0;
  });
  return bench;
}

}  // namespace cleave::cli
