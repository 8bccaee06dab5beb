// Target process for the transfer integration tests. It registers a zeroed region, prints
//   ADDR <hex engine address>
//   DESC <hex remote descriptor>
// and then, for every notice, hashes part (tag >> 32) of the region (the region is cut into
// `parts` equal parts) and prints "NOTICE <tag> <hash>". It exits when its stdin closes.
// Commands on stdin, one a line: REVOKE deregisters the region's current registration (a
// reservation that ended: writes with its key are refused) and prints "REVOKED <region id>";
// REGISTER
// registers the region again and prints "DESC <hex descriptor>" with the new key.
// With REGION_FILE the region is that file, mapped shared (the test maps it too and can look at
// the target's memory at any moment, not only when a notice arrives).
// Usage: transfer_test_peer PROVIDER RAILS REGION_BYTES PARTS [REGION_FILE]
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>

#include "cleave/transfer/transfer_engine.h"
#include "peer_process.h"

using namespace cleave::transfer;

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    std::fprintf(stderr, "usage: %s PROVIDER RAILS REGION_BYTES PARTS [REGION_FILE]\n", argv[0]);
    return 2;
  }
  TransferSettings settings;
  settings.provider = argv[1];
  settings.node = "127.0.0.1";
  settings.rails = std::atoll(argv[2]);
  const uint64_t region_bytes = std::strtoull(argv[3], nullptr, 10);
  const uint64_t parts = std::strtoull(argv[4], nullptr, 10);
  auto engine = TransferEngine::create(settings, true);
  if (!engine.ok()) {
    std::fprintf(stderr, "peer: %s\n", engine.status().to_string().c_str());
    return 1;
  }
  auto& e = **engine;
  std::vector<char> owned;
  char* region = nullptr;
  if (argc == 6) {
    int fd = open(argv[5], O_RDWR);
    void* p = fd < 0 ? MAP_FAILED
                     : mmap(nullptr, region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "peer: cannot map %s\n", argv[5]);
      return 1;
    }
    close(fd);
    region = static_cast<char*>(p);
  } else {
    owned.assign(region_bytes, 0);
    region = owned.data();
  }
  auto mr = e.register_memory(region, region_bytes, MemoryKind::host());
  if (!mr.ok()) {
    std::fprintf(stderr, "peer: %s\n", mr.status().to_string().c_str());
    return 1;
  }
  std::mutex out_mu;  // stdout is shared by the notice loop and the command thread
  {
    std::lock_guard<std::mutex> lock(out_mu);
    std::cout << "ADDR " << testing::to_hex(e.address()) << "\n"
              << "DESC " << testing::to_hex(mr->remote.encode()) << std::endl;
  }
  std::atomic<bool> done{false};
  std::thread stdin_watch([&] {
    uint64_t live = mr->id;  // 0: revoked, none registered
    std::string line;
    while (std::getline(std::cin, line)) {
      if (line == "REVOKE" && live != 0) {
        const uint64_t live_was = live;
        cleave::Status s = e.deregister(live);
        live = 0;
        std::lock_guard<std::mutex> lock(out_mu);
        if (s.ok()) std::cout << "REVOKED " << live_was << std::endl;
        else std::cout << "ERROR " << s.to_string() << std::endl;
      } else if (line == "REGISTER" && live == 0) {
        auto again = e.register_memory(region, region_bytes, MemoryKind::host());
        std::lock_guard<std::mutex> lock(out_mu);
        if (!again.ok()) {
          std::cout << "ERROR " << again.status().to_string() << std::endl;
          continue;
        }
        live = again->id;
        std::cout << "DESC " << testing::to_hex(again->remote.encode()) << std::endl;
      } else if (!line.empty()) {
        std::lock_guard<std::mutex> lock(out_mu);
        std::cout << "ERROR unknown or out-of-turn command '" << line << "'" << std::endl;
      }
    }
    done = true;
  });
  const uint64_t part_bytes = region_bytes / parts;
  while (!done) {
    auto n = e.wait_notice(std::chrono::milliseconds(50));
    if (!n.ok()) continue;
    uint64_t part = n->tag >> 32;
    if (part >= parts) part = 0;
    uint64_t h = testing::checksum(region + part * part_bytes, part_bytes);
    std::lock_guard<std::mutex> lock(out_mu);
    std::cout << "NOTICE " << n->tag << " " << h << std::endl;
  }
  stdin_watch.join();
  return 0;
}
