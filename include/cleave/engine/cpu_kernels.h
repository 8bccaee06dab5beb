// CPU compute kernels. fp32 arithmetic; weights stay in their file dtype (f32, f16, bf16, q8_0)
// and are converted inside the dot kernels. The kernel set is chosen at run time: AVX-512 (when
// the CPU and OS support it), else AVX2+FMA+F16C, else a portable fallback. The AVX-512 set gives
// the AVX2 set's results bit for bit (src/engine/cpu/kernel_set.h).
//
// Batch invariance: the result of dot(row, x) depends only on the row, x and n -- never on how
// many tokens or rows are processed together, on the thread count, or on which tile a row falls
// in. Multi-token kernels keep exactly the per-token reduction order of the single-token path.
#pragma once

#include <cstdint>
#include <string_view>

#include "cleave/common/thread_pool.h"
#include "cleave/model/tensor_view.h"

namespace cleave::cpu {

// Name of the kernel set chosen at run time ("avx512", "avx2" or "generic"). The environment
// variable CLEAVE_CPU_KERNELS=generic (or =avx2) forces that set.
const char* kernel_isa();
// Switches the kernel set ("avx512", "avx2", "generic"); false (and no change) when the name is
// unknown or this CPU cannot run it. For tests and benchmarks: call it while no kernel is
// running. Results are batch invariant within one kernel set; "avx512" and "avx2" agree bit for
// bit; "generic" may differ from them in the last bits.
bool set_kernel_isa(std::string_view name);

// dot of row `r` of matrix `w` ([rows, n], any dtype) with f32 vector x of n elements.
float dot_row(const TensorView& w, int64_t r, const float* x);

// y[t * out_stride + r] = dot(w[r], x[t * in_stride .. + n]) for every row r of w and token t in
// [0, n_tokens). Threaded over rows through `pool`; bit-identical to dot_row for every (r, t),
// whatever n_tokens and the pool size. Decode (1 token) streams each weight row once; several
// tokens: the AVX-512 set converts each block of rows to f32 once per call (each weight byte is
// read from memory once) and runs every token against it in register-blocked micro-kernels;
// the other sets apply each small block of rows to every token while it is in cache.
void matmul(ThreadPool& pool, const TensorView& w, const float* x, int64_t in_stride,
            int64_t n_tokens, float* y, int64_t out_stride);

// Converts row r of w to f32 (embedding look-up).
void row_to_f32(const TensorView& w, int64_t r, float* out);
// Converts a whole 1-D tensor (norm weights, biases) to f32.
void tensor_to_f32(const TensorView& w, float* out);

// Plain f32 helpers with a fixed reduction order.
float dot_f32(const float* a, const float* b, int64_t n);
// out = x / rms(x) * w; x and out may alias.
void rmsnorm(const float* x, const float* w, float eps, int64_t n, float* out);
// In-place numerically stable softmax.
void softmax(float* x, int64_t n);
// out[i] = silu(gate[i]) * up[i]
void silu_mul(const float* gate, const float* up, int64_t n, float* out);
// y[i] += x[i]
void add_inplace(float* y, const float* x, int64_t n);
// y[i] += a * x[i]
void axpy(float* y, float a, const float* x, int64_t n);

}  // namespace cleave::cpu
