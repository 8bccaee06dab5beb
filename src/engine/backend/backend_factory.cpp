// engine.device -> a Backend (backend.h make_backend).
#include <charconv>
#include <string>

#include "cleave/engine/backend.h"
#include "fmt/format.h"

#ifdef CLEAVE_HAVE_CUDA
#include "../cuda/cuda_backend.h"
#endif

namespace cleave {
namespace {

// "cuda" -> 0, "cuda:N" -> N; -1 for anything else.
int cuda_ordinal(std::string_view device) {
  if (device == "cuda") return 0;
  if (!device.starts_with("cuda:") || device.size() == 5) return -1;
  int n = -1;
  const char* end = device.data() + device.size();
  auto [p, ec] = std::from_chars(device.data() + 5, end, n);
  if (ec != std::errc() || p != end || n < 0) return -1;
  return n;
}

}  // namespace

bool valid_device_name(std::string_view device) {
  return device == "cpu" || cuda_ordinal(device) >= 0;
}

Result<std::unique_ptr<Backend>> make_backend(std::string_view device, ThreadPool& pool) {
  if (device == "cpu" || device.empty()) return make_cpu_backend(pool);
  const int ordinal = cuda_ordinal(device);
  if (ordinal < 0) {
    return InvalidArgument(fmt::format(
        "engine.device '{}' is not a device: use cpu, cuda or cuda:N (N a device number)", device));
  }
#ifdef CLEAVE_HAVE_CUDA
  return make_cuda_backend(ordinal);
#else
  return Unavailable(fmt::format(
      "engine.device {}: this build of cleave has no CUDA backend (it was built without nvcc or "
      "with CLEAVE_WITH_CUDA=OFF); rebuild with CLEAVE_WITH_CUDA=ON on a machine with the CUDA "
      "toolkit, or use engine.device cpu",
      device));
#endif
}

}  // namespace cleave
