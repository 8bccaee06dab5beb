// Run-time choice of the kernel set, and the single-row entry points of cpu_kernels.h.
#include <atomic>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "cleave/engine/cpu_kernels.h"
#include "cleave/model/quants.h"
#include "kernel_set.h"

namespace cleave::cpu {
namespace detail {

bool cpu_has_avx2_kernels() {
#if defined(__x86_64__) || defined(__i386__)
  // F16C through cpuid (leaf 1, ECX bit 29): clang's __builtin_cpu_supports does not know it.
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  }();
  return has;
#else
  return false;
#endif
}

#if defined(CLEAVE_AVX512_EMULATED)
// The emulated test build (avx512_emulated.h): SIMDe runs the AVX-512 sets on any host that
// runs the AVX2 set.
bool cpu_has_avx512_kernels() { return cpu_has_avx2_kernels(); }
bool cpu_has_avx512_vnni() { return cpu_has_avx2_kernels(); }
#else
bool cpu_has_avx512_kernels() {
#if defined(__x86_64__)
  static const bool has = [] {
    if (!cpu_has_avx2_kernels() || !__builtin_cpu_supports("avx512f")) return false;
    // The OS must save the opmask and ZMM state: XCR0 bits 1, 2 (SSE, AVX) and 5-7.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || (ecx & (1u << 27)) == 0) return false;
    uint32_t xcr0_lo = 0, xcr0_hi = 0;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    return (xcr0_lo & 0xe6u) == 0xe6u;
  }();
  return has;
#else
  return false;
#endif
}

bool cpu_has_avx512_vnni() {
#if defined(__x86_64__)
  static const bool has = cpu_has_avx512_kernels() && __builtin_cpu_supports("avx512vnni") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
  return has;
#else
  return false;
#endif
}
#endif  // CLEAVE_AVX512_EMULATED

namespace {

const KernelSet* default_kernels() {
  // CLEAVE_CPU_KERNELS=generic|avx2 forces a set (to compare or debug).
  const char* env = std::getenv("CLEAVE_CPU_KERNELS");
  if (env != nullptr && std::string_view(env) == "generic") return &generic_kernels();
  if (env != nullptr && std::string_view(env) == "avx2" && cpu_has_avx2_kernels())
    return &avx2_kernels();
  if (cpu_has_avx512_kernels()) return &avx512_kernels();
  return cpu_has_avx2_kernels() ? &avx2_kernels() : &generic_kernels();
}

std::atomic<const KernelSet*>& active_slot() {
  static std::atomic<const KernelSet*> slot{default_kernels()};
  return slot;
}

}  // namespace

const KernelSet& active_kernels() { return *active_slot().load(std::memory_order_relaxed); }

}  // namespace detail

const char* kernel_isa() { return detail::active_kernels().name; }

bool set_kernel_isa(std::string_view name) {
  const detail::KernelSet* set = nullptr;
  if (name == "generic") set = &detail::generic_kernels();
  if (name == "avx2" && detail::cpu_has_avx2_kernels()) set = &detail::avx2_kernels();
  if (name == "avx512" && detail::cpu_has_avx512_kernels()) set = &detail::avx512_kernels();
  if (set == nullptr) return false;
  detail::active_slot().store(set);
  return true;
}

bool uses_int_path(DType t) { return dtype_is_quantized(t); }

float dot_row(const TensorView& w, int64_t r, const float* x) {
  const int64_t n = w.cols();
  const uint64_t row_bytes = *dtype_row_bytes(w.dtype, static_cast<uint64_t>(n));
  const std::byte* row = w.data + static_cast<uint64_t>(r) * row_bytes;
  const detail::KernelSet& set = detail::active_kernels();
  float y = 0.0f;
  if (uses_int_path(w.dtype)) {
    set.qdot(w.dtype, row, row_bytes, 1,
             detail::quantize_to_scratch(set, x, n, 1, n, detail::kernel_group(w.dtype)), 1, &y, 0);
    return y;
  }
  set.dot_tile[static_cast<size_t>(w.dtype)](row, row_bytes, 1, x, 0, 1, n, &y, 0);
  return y;
}

void row_to_f32(const TensorView& w, int64_t r, float* out) {
  const int64_t n = w.cols();
  const uint64_t row_bytes = *dtype_row_bytes(w.dtype, static_cast<uint64_t>(n));
  decode_row(w.dtype, w.data + static_cast<uint64_t>(r) * row_bytes, n, out);
}

void tensor_to_f32(const TensorView& w, float* out) {
  decode_row(w.dtype, w.data, w.elements(), out);
}

}  // namespace cleave::cpu
