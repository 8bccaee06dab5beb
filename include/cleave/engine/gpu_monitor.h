// What operators watch on GPU nodes, beside the engine's own figures: a device's utilization and
// memory in use, read through NVML (the driver's management library, libnvidia-ml.so.1, loaded at
// run time so that cleave needs it only where there is a GPU).
//
// Thread-safety: sample() may be called from any thread, one call at a time per monitor.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "cleave/common/status.h"

namespace cleave {

struct GpuSample {
  double utilization = 0;    // fraction of the last sample period a kernel ran (0..1)
  uint64_t memory_used = 0;  // bytes in use on the device (every process)
  uint64_t memory_total = 0;
};

class GpuMonitor {
 public:
  // Watches CUDA device `cuda_ordinal` (matched to NVML's device by PCI bus id, so that
  // CUDA_VISIBLE_DEVICES and NVML's own order cannot mix devices up). Unavailable, with the
  // reason, where this build has no CUDA backend, there is no such device, or NVML is absent
  // (a container without the driver's libraries) or fails.
  static Result<std::unique_ptr<GpuMonitor>> open(int cuda_ordinal);
  ~GpuMonitor();
  GpuMonitor(const GpuMonitor&) = delete;
  GpuMonitor& operator=(const GpuMonitor&) = delete;

  // The device's figures now; Unavailable with NVML's message when the read fails.
  Result<GpuSample> sample();
  int cuda_ordinal() const { return ordinal_; }
  const std::string& pci_bus_id() const { return bus_id_; }

 private:
  struct Nvml;
  GpuMonitor(int ordinal, std::string bus_id, std::unique_ptr<Nvml> nvml);
  int ordinal_;
  std::string bus_id_;
  std::unique_ptr<Nvml> nvml_;
};

}  // namespace cleave
