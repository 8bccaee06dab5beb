// `cleave bench transfer`: initiator and target roles.
#include "cleave/bench/transfer_bench.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>

#include "cleave/transfer/transfer_engine.h"
#include "fmt/format.h"
#include "raw_fabric_loop.h"

extern char** environ;

namespace cleave::transfer {

namespace {

using Clock = std::chrono::steady_clock;

std::string hex(std::string_view b) {
  std::string s;
  for (unsigned char c : b) s += fmt::format("{:02x}", c);
  return s;
}
std::string unhex(std::string_view h) {
  std::string s;
  for (size_t i = 0; i + 1 < h.size(); i += 2) {
    s.push_back(static_cast<char>(std::stoi(std::string(h.substr(i, 2)), nullptr, 16)));
  }
  return s;
}

class TargetProcess {
 public:
  ~TargetProcess() {
    if (in_) fclose(in_);
    if (out_) fclose(out_);
    if (pid_ > 0) {
      for (int i = 0; i < 300; ++i) {
        if (waitpid(pid_, nullptr, WNOHANG) == pid_) return;
        usleep(10000);
      }
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  Status start(const std::vector<std::string>& argv) {
    int to[2], from[2];
    if (pipe(to) || pipe(from)) return Internal("bench: pipe() failed");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, to[0], 0);
    posix_spawn_file_actions_adddup2(&fa, from[1], 1);
    posix_spawn_file_actions_addclose(&fa, to[1]);
    posix_spawn_file_actions_addclose(&fa, from[0]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    int rc = posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    close(to[0]);
    close(from[1]);
    if (rc) return Internal(fmt::format("bench: cannot start the target {}: {}", argv[0], strerror(rc)));
    in_ = fdopen(to[1], "w");
    out_ = fdopen(from[0], "r");
    return Status::Ok();
  }
  // The next line that starts with `key ` (log lines the target prints are skipped).
  Result<std::string> expect(const std::string& key) {
    char line[8192];
    for (;;) {
      if (!fgets(line, sizeof(line), out_)) {
        return Unavailable(fmt::format("bench: the target exited before printing {}", key));
      }
      std::string s(line);
      while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
      if (s.rfind(key + " ", 0) == 0) return s.substr(key.size() + 1);
    }
  }
  void send(const std::string& line) {
    fputs((line + "\n").c_str(), in_);
    fflush(in_);
  }

 private:
  pid_t pid_ = -1;
  FILE* in_ = nullptr;
  FILE* out_ = nullptr;
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(std::ceil(p * static_cast<double>(v.size()))) ;
  return v[std::min(v.size() - 1, i == 0 ? 0 : i - 1)];
}

}  // namespace

Result<std::vector<uint64_t>> parse_sizes(const std::string& list) {
  std::vector<uint64_t> out;
  size_t pos = 0;
  while (pos <= list.size()) {
    size_t end = list.find(',', pos);
    std::string item = list.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
    size_t digits = 0;
    while (digits < item.size() && std::isdigit(static_cast<unsigned char>(item[digits]))) ++digits;
    std::string unit = item.substr(digits);
    uint64_t mult = unit.empty() || unit == "B" ? 1
                    : unit == "KiB" || unit == "K" || unit == "k" ? 1024
                    : unit == "MiB" || unit == "M" ? 1ull << 20
                    : unit == "GiB" || unit == "G" ? 1ull << 30 : 0;
    if (digits == 0 || mult == 0) {
      return InvalidArgument(fmt::format("--sizes: '{}' is not a size (e.g. 4096, 64KiB, 1MiB)", item));
    }
    out.push_back(std::stoull(item.substr(0, digits)) * mult);
    if (end == std::string::npos) break;
    pos = end + 1;
  }
  return out;
}

int run_transfer_bench_target(const std::string& provider, int64_t rails, uint64_t region_bytes) {
  TransferSettings s;
  s.provider = provider;
  s.node = "127.0.0.1";
  s.rails = rails;
  auto engine = TransferEngine::create(s, true);
  if (!engine.ok()) {
    std::fprintf(stderr, "bench target: %s\n", engine.status().to_string().c_str());
    return 1;
  }
  std::vector<char> region(region_bytes, 0), raw_region(region_bytes, 0);
  auto mr = (*engine)->register_memory(region.data(), region.size(), MemoryKind::host());
  RawFabricEndpoint raw;
  Status rs = raw.open(provider, raw_region.data(), raw_region.size());
  if (!mr.ok() || !rs.ok()) {
    std::fprintf(stderr, "bench target: %s %s\n", mr.status().to_string().c_str(), rs.to_string().c_str());
    return 1;
  }
  std::cout << "ADDR " << hex((*engine)->address()) << "\n"
            << "DESC " << hex(mr->remote.encode()) << "\n"
            << "RAW " << hex(raw.name()) << " " << raw.key() << " "
            << (raw.virt_addr() ? reinterpret_cast<uint64_t>(raw_region.data()) : 0) << std::endl;
  std::atomic<bool> stop_raw{true};
  std::thread raw_thread;
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "RAW ON" && !raw_thread.joinable()) {
      stop_raw = false;
      raw_thread = std::thread([&] { raw.serve(stop_raw); });
    } else if (line == "RAW OFF" && raw_thread.joinable()) {
      stop_raw = true;
      raw_thread.join();
    }
    std::cout << "ACK" << " " << line << std::endl;
  }
  stop_raw = true;
  if (raw_thread.joinable()) raw_thread.join();
  return 0;
}

namespace {

// One round in this process: ours at every size, then (with our engine gone) the raw loop.
Result<std::vector<TransferBenchRow>> run_round(const TransferBenchOptions& o) {
  const uint64_t max_size = *std::max_element(o.sizes.begin(), o.sizes.end());
  TargetProcess target;
  std::vector<std::string> argv = o.target_command;
  for (std::string a : {"--role", "target", "--provider", o.provider.c_str()}) argv.push_back(a);
  argv.push_back("--rails");
  argv.push_back(std::to_string(o.rails));
  argv.push_back("--region-bytes");
  argv.push_back(std::to_string(max_size));
  CLEAVE_RETURN_IF_ERROR(target.start(argv));
  CLEAVE_ASSIGN_OR_RETURN(std::string addr, target.expect("ADDR"));
  CLEAVE_ASSIGN_OR_RETURN(std::string desc_hex, target.expect("DESC"));
  CLEAVE_ASSIGN_OR_RETURN(std::string raw_line, target.expect("RAW"));

  TransferSettings s;
  s.provider = o.provider;
  s.node = "127.0.0.1";
  s.rails = o.rails;
  s.delivery_complete = o.delivery_complete;
  CLEAVE_ASSIGN_OR_RETURN(auto engine, TransferEngine::create(s, true));
  CLEAVE_ASSIGN_OR_RETURN(uint64_t peer, engine->connect(unhex(addr)));
  CLEAVE_ASSIGN_OR_RETURN(RemoteDescriptor desc, RemoteDescriptor::decode(unhex(desc_hex)));
  std::vector<char> src(max_size, 'c'), raw_src(max_size, 'r');
  CLEAVE_ASSIGN_OR_RETURN(MemoryRegion mr, engine->register_memory(src.data(), src.size(), MemoryKind::host()));

  std::vector<TransferBenchRow> rows;
  for (uint64_t size : o.sizes) {
    TransferBenchRow row;
    row.provider = engine->provider();
    row.size_bytes = size;
    std::vector<double> lat_us;
    std::deque<std::pair<TransferHandle, Clock::time_point>> inflight;
    auto reap = [&]() -> Status {
      auto [h, t0] = inflight.front();
      inflight.pop_front();
      CLEAVE_RETURN_IF_ERROR(h.wait(std::chrono::seconds(60)));
      lat_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      return Status::Ok();
    };
    // Warm-up (connection set-up) is not timed.
    CLEAVE_ASSIGN_OR_RETURN(auto warm, engine->submit(Batch{peer, {{mr.id, 0, desc, 0, size}}, std::nullopt}));
    CLEAVE_RETURN_IF_ERROR(warm.wait(std::chrono::seconds(60)));
    auto start = Clock::now();
    for (int64_t i = 0; i < o.iters; ++i) {
      if (static_cast<int64_t>(inflight.size()) >= o.window) CLEAVE_RETURN_IF_ERROR(reap());
      auto t0 = Clock::now();
      CLEAVE_ASSIGN_OR_RETURN(auto h, engine->submit(Batch{peer, {{mr.id, 0, desc, 0, size}}, std::nullopt}));
      inflight.emplace_back(h, t0);
    }
    while (!inflight.empty()) CLEAVE_RETURN_IF_ERROR(reap());
    double secs = std::chrono::duration<double>(Clock::now() - start).count();
    row.gbps = static_cast<double>(size) * static_cast<double>(o.iters) / secs / 1e9;
    row.p50_us = percentile(lat_us, 0.50);
    row.p99_us = percentile(lat_us, 0.99);
    rows.push_back(row);
  }

  // The raw baseline: one endpoint, fi_write, same window, while the target polls its CQ.
  engine.reset();
  target.send("RAW ON");
  CLEAVE_RETURN_IF_ERROR(target.expect("ACK").status());
  RawFabricEndpoint raw;
  CLEAVE_RETURN_IF_ERROR(raw.open(o.provider, raw_src.data(), raw_src.size()));
  std::string raw_name_hex = raw_line.substr(0, raw_line.find(' '));
  uint64_t raw_key = 0, raw_base = 0;
  std::sscanf(raw_line.c_str() + raw_name_hex.size(), " %lu %lu", &raw_key, &raw_base);
  CLEAVE_RETURN_IF_ERROR(raw.connect(unhex(raw_name_hex)));
  for (auto& row : rows) {
    CLEAVE_RETURN_IF_ERROR(raw.write_loop(row.size_bytes, 1, 1, raw_base, raw_key,
                                          o.delivery_complete).status());
    CLEAVE_ASSIGN_OR_RETURN(double secs, raw.write_loop(row.size_bytes, o.iters, o.window, raw_base,
                                                        raw_key, o.delivery_complete));
    row.raw_gbps = static_cast<double>(row.size_bytes) * static_cast<double>(o.iters) / secs / 1e9;
    row.ratio = row.raw_gbps > 0 ? row.gbps / row.raw_gbps : 0;
  }
  target.send("RAW OFF");
  (void)target.expect("ACK");
  return rows;
}

std::vector<std::string> round_argv(const TransferBenchOptions& o) {
  std::vector<std::string> argv = o.target_command;
  for (std::string a : {"--role", "round", "--provider", o.provider.c_str()}) argv.push_back(a);
  std::string sizes;
  for (uint64_t size : o.sizes) sizes += (sizes.empty() ? "" : ",") + std::to_string(size);
  for (const std::string& a :
       {std::string("--sizes"), sizes, std::string("--iters"), std::to_string(o.iters),
        std::string("--rails"), std::to_string(o.rails), std::string("--window"),
        std::to_string(o.window), std::string("--delivery-complete"),
        std::string(o.delivery_complete ? "true" : "false")}) {
    argv.push_back(a);
  }
  return argv;
}

}  // namespace

int run_transfer_bench_round(const TransferBenchOptions& o) {
  auto rows = run_round(o);
  if (!rows.ok()) {
    std::fprintf(stderr, "bench round: %s\n", rows.status().to_string().c_str());
    return 1;
  }
  for (const auto& r : *rows) {
    std::cout << fmt::format("ROW {} {} {} {} {} {}\n", r.provider, r.size_bytes, r.gbps, r.p50_us,
                             r.p99_us, r.raw_gbps);
  }
  std::cout << "END ok" << std::endl;
  return 0;
}

// Each round runs in a fresh pair of processes (an initiator and its target): shm in libfabric
// 1.17 crashes when a process's endpoints towards one peer are closed and opened again, or when
// two endpoint pairs between the same processes take turns. Each figure is the median over the
// rounds, so that ours and raw see the same machine (other load, clock, page cache) on average.
Result<std::vector<TransferBenchRow>> run_transfer_bench(const TransferBenchOptions& o) {
  if (o.sizes.empty() || o.iters < 1 || o.window < 1 || o.rounds < 1) {
    return InvalidArgument(
        "bench: need at least one size, --iters >= 1, --window >= 1 and --rounds >= 1");
  }
  const size_t n = o.sizes.size();
  std::vector<std::vector<double>> gbps(n), raw(n), p50(n), p99(n), ratio(n);
  std::string provider;
  for (int64_t round = 0; round < o.rounds; ++round) {
    TargetProcess child;  // the round's initiator (it starts its own target)
    CLEAVE_RETURN_IF_ERROR(child.start(round_argv(o)));
    for (size_t k = 0; k < n; ++k) {
      CLEAVE_ASSIGN_OR_RETURN(std::string line, child.expect("ROW"));
      char prov[64] = {0};
      unsigned long size = 0;
      double g = 0, a = 0, b = 0, r = 0;
      if (std::sscanf(line.c_str(), "%63s %lu %lf %lf %lf %lf", prov, &size, &g, &a, &b, &r) != 6 ||
          size != o.sizes[k]) {
        return Internal(fmt::format("bench: round {} printed an unexpected row '{}'", round, line));
      }
      provider = prov;
      gbps[k].push_back(g);
      p50[k].push_back(a);
      p99[k].push_back(b);
      raw[k].push_back(r);
      ratio[k].push_back(r > 0 ? g / r : 0);
    }
    CLEAVE_RETURN_IF_ERROR(child.expect("END").status());
  }
  std::vector<TransferBenchRow> rows;
  for (size_t k = 0; k < n; ++k) {
    TransferBenchRow row;
    row.provider = provider;
    row.size_bytes = o.sizes[k];
    row.rounds = o.rounds;
    row.gbps = percentile(gbps[k], 0.5);
    row.raw_gbps = percentile(raw[k], 0.5);
    row.p50_us = percentile(p50[k], 0.5);
    row.p99_us = percentile(p99[k], 0.5);
    row.ratio = percentile(ratio[k], 0.5);
    row.ratio_min = *std::min_element(ratio[k].begin(), ratio[k].end());
    row.ratio_max = *std::max_element(ratio[k].begin(), ratio[k].end());
    rows.push_back(row);
  }
  return rows;
}

std::string tcp_congestion_control(const std::string& provider) {
  if (provider.rfind("tcp", 0) != 0 && provider.rfind("sockets", 0) != 0) return "";
  std::ifstream f("/proc/sys/net/ipv4/tcp_congestion_control");
  std::string cc;
  if (!(f >> cc)) return "unknown";
  return cc;
}

}  // namespace cleave::transfer
