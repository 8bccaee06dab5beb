// `cleave bench transfer`: an initiator (this process) and a target process (the same binary
// re-executed with --role target) measure the engine's write bandwidth and latency per size,
// beside a raw single-endpoint fi_write loop over the same provider (what libfabric gives).
// Library cleave::transfer_bench (bench/transfer/), not part of cleave::transfer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cleave/common/status.h"

namespace cleave::transfer {

struct TransferBenchOptions {
  std::string provider = "tcp;ofi_rxm";
  std::vector<uint64_t> sizes = {4096, 65536, 1 << 20, 4 << 20};
  int64_t iters = 200;
  int64_t rails = 1;
  int64_t window = 64;  // writes in flight
  // Rounds of (ours at every size, then raw at every size), each in fresh processes; every
  // figure is the median over the rounds (p50/p99: the medians of the rounds' percentiles).
  int64_t rounds = 3;
  // Completion semantics of both ours and the raw loop (the same on both sides, for a fair
  // ratio): FI_DELIVERY_COMPLETE, or the provider's default completion.
  bool delivery_complete = true;
  // argv prefix that starts the target role, e.g. {"/proc/self/exe", "bench", "transfer"}.
  std::vector<std::string> target_command;
};

struct TransferBenchRow {
  std::string provider;
  uint64_t size_bytes = 0;
  int64_t rounds = 0;
  double gbps = 0, p50_us = 0, p99_us = 0, raw_gbps = 0;
  // ours/raw: the median of the rounds' own ratios (ours and raw of one round ran back to back
  // on the same pair of processes), and the lowest and highest of them.
  double ratio = 0, ratio_min = 0, ratio_max = 0;
};

Result<std::vector<TransferBenchRow>> run_transfer_bench(const TransferBenchOptions& opts);
// The round role: one round (ours at every size, then raw) in this process with its own
// target; prints a ROW line per size and END. Returns the process exit code.
int run_transfer_bench_round(const TransferBenchOptions& opts);
// The target role: prints its addresses on stdout and serves until stdin closes. Returns the
// process exit code.
int run_transfer_bench_target(const std::string& provider, int64_t rails, uint64_t region_bytes);
// "4KiB,64KiB,1MiB" -> bytes; InvalidArgument names the bad item.
Result<std::vector<uint64_t>> parse_sizes(const std::string& list);
// For a provider over kernel TCP ("tcp", "tcp;ofi_rxm", "sockets"): this host's congestion
// control (net.ipv4.tcp_congestion_control), which shapes loopback figures (BBR paces a
// loopback flow, and its rate is bimodal from run to run); "" for other providers.
std::string tcp_congestion_control(const std::string& provider);

}  // namespace cleave::transfer
