// GpuMonitor over NVML, loaded with dlopen: the few entry points it needs are declared here with
// the C ABI of nvml.h (NVML's interface is stable across driver versions; the _v2 names are
// the current ones).
#include "cleave/engine/gpu_monitor.h"

#include <dlfcn.h>

#include "fmt/format.h"

#ifdef CLEAVE_HAVE_CUDA
#include "../cuda/cuda_backend.h"
#endif

namespace cleave {
namespace {

using NvmlReturn = int;  // nvmlReturn_t: 0 is NVML_SUCCESS
using NvmlDevice = void*;
struct NvmlMemory {  // nvmlMemory_t
  unsigned long long total, free, used;
};
struct NvmlUtilization {  // nvmlUtilization_t
  unsigned int gpu, memory;
};

}  // namespace

struct GpuMonitor::Nvml {
  void* lib = nullptr;
  NvmlDevice device = nullptr;
  NvmlReturn (*init)() = nullptr;
  NvmlReturn (*shutdown)() = nullptr;
  const char* (*error_string)(NvmlReturn) = nullptr;
  NvmlReturn (*by_bus_id)(const char*, NvmlDevice*) = nullptr;
  NvmlReturn (*utilization)(NvmlDevice, NvmlUtilization*) = nullptr;
  NvmlReturn (*memory)(NvmlDevice, NvmlMemory*) = nullptr;
  bool initialized = false;

  std::string error(NvmlReturn r) const {
    return error_string ? error_string(r) : fmt::format("NVML error {}", r);
  }
  ~Nvml() {
    if (initialized) shutdown();
    if (lib) dlclose(lib);
  }
};

GpuMonitor::GpuMonitor(int ordinal, std::string bus_id, std::unique_ptr<Nvml> nvml)
    : ordinal_(ordinal), bus_id_(std::move(bus_id)), nvml_(std::move(nvml)) {}

GpuMonitor::~GpuMonitor() = default;

Result<std::unique_ptr<GpuMonitor>> GpuMonitor::open(int cuda_ordinal) {
#ifndef CLEAVE_HAVE_CUDA
  return Unavailable(fmt::format("GPU metrics for device {}: this build has no CUDA backend",
                                 cuda_ordinal));
#else
  CLEAVE_ASSIGN_OR_RETURN(std::string bus_id, cuda_pci_bus_id(cuda_ordinal));
  auto n = std::make_unique<Nvml>();
  n->lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!n->lib) {
    const char* why = dlerror();
    return Unavailable(fmt::format("GPU metrics: NVML cannot be loaded ({}); the node's driver "
                                   "libraries are not in this container",
                                   why ? why : "libnvidia-ml.so.1 not found"));
  }
  auto sym = [&](auto& fn, const char* name) -> Status {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(n->lib, name));
    if (!fn) return Unavailable(fmt::format("GPU metrics: NVML has no {}", name));
    return Status::Ok();
  };
  CLEAVE_RETURN_IF_ERROR(sym(n->init, "nvmlInit_v2"));
  CLEAVE_RETURN_IF_ERROR(sym(n->shutdown, "nvmlShutdown"));
  CLEAVE_RETURN_IF_ERROR(sym(n->error_string, "nvmlErrorString"));
  CLEAVE_RETURN_IF_ERROR(sym(n->by_bus_id, "nvmlDeviceGetHandleByPciBusId_v2"));
  CLEAVE_RETURN_IF_ERROR(sym(n->utilization, "nvmlDeviceGetUtilizationRates"));
  CLEAVE_RETURN_IF_ERROR(sym(n->memory, "nvmlDeviceGetMemoryInfo"));
  if (NvmlReturn r = n->init(); r != 0) {
    return Unavailable(fmt::format("GPU metrics: nvmlInit: {}", n->error(r)));
  }
  n->initialized = true;
  if (NvmlReturn r = n->by_bus_id(bus_id.c_str(), &n->device); r != 0) {
    return Unavailable(fmt::format("GPU metrics: NVML has no device at PCI {} (CUDA device {}): {}",
                                   bus_id, cuda_ordinal, n->error(r)));
  }
  return std::unique_ptr<GpuMonitor>(new GpuMonitor(cuda_ordinal, std::move(bus_id), std::move(n)));
#endif
}

Result<GpuSample> GpuMonitor::sample() {
  NvmlUtilization u{};
  NvmlMemory m{};
  if (NvmlReturn r = nvml_->utilization(nvml_->device, &u); r != 0) {
    return Unavailable(fmt::format("GPU metrics: utilization of {}: {}", bus_id_, nvml_->error(r)));
  }
  if (NvmlReturn r = nvml_->memory(nvml_->device, &m); r != 0) {
    return Unavailable(fmt::format("GPU metrics: memory of {}: {}", bus_id_, nvml_->error(r)));
  }
  return GpuSample{u.gpu / 100.0, m.used, m.total};
}

}  // namespace cleave
