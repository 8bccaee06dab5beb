// CPU compute kernels. fp32 arithmetic; weights stay in their file dtype (f32, f16, bf16 and
// every block format of quants.h) and are converted inside the dot kernels.
//
// Two paths, chosen per dtype (uses_int_path):
// - f32, f16, bf16: the weights are widened to f32 and multiplied with the f32 activations by
//   fused multiply-adds: exact weights, no activation rounding, and no block scales to exploit.
// - Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: the integer path, as the fastest
//   CPU runtimes do it. Each token's activation row is quantised to 8 bits (f32 scale) per
//   32-element block for the legacy formats and per 256 elements for the K-quants (ggml's q8_K),
//   and each weight block is multiplied with it in int8 x int8 -> int32 products, 32 at a time
//   (maddubs on AVX2, vpdpbusd on AVX-512 VNNI). The legacy formats take one f32 multiply-add per
//   8 lanes and block; the K-quants apply their sub-scales to the int16 pair sums in integers
//   (madd, vpdpwssd on VNNI) and take one f32 multiply-add per 8 lanes and 256-element
//   super-block (two with a min), which is what lets them run near the memory floor. Unpacking a 4- or 5-bit
//   block into 32 int8 levels costs a few shifts and masks; widening it to f32 costs four
//   conversions and four multiplies more, and the f32 path then needs four FMAs where the
//   integer one needs one or two instructions. Measured in L2 (bench/kernel_bench), the integer
//   path computes Q8_0 twice as fast as widening it to f32. Decode is bound by the weight bytes
//   streamed, so the cheaper inner loop keeps it near the memory floor, and prefill is compute
//   bound, where the integer products do twice the work per instruction. The activation's
//   quantisation is per token, so it never depends on the batch; the error it adds is at most
//   half a level of its group's scale per element (amax / 254).
// The kernel set is chosen at run time: AVX-512 (when the CPU and OS support it), else
// AVX2+FMA+F16C, else a portable fallback. The AVX-512 set gives
// the AVX2 set's results bit for bit (src/engine/cpu/kernel_set.h).
//
// Batch invariance: the result of dot(row, x) depends only on the row, x and n -- never on how
// many tokens or rows are processed together, on the thread count, or on which tile a row falls
// in. Multi-token kernels keep exactly the per-token reduction order of the single-token path.
#pragma once

#include <cstdint>
#include <span>
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

// Whether dtype t takes the integer path above (every block format).
bool uses_int_path(DType t);

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

// Fused passes, each bit for bit the separate calls, with dense strides (x: [n_tokens, cols],
// each output [n_tokens, rows]): one parallel pass over the rows instead of one per matrix, the
// activations quantised once, the element-wise step done by the thread that computed its rows.
// ys[i] = ws[i] x; every matrix has x's column count.
void matmul_many(ThreadPool& pool, std::span<const TensorView* const> ws, const float* x,
                 int64_t n_tokens, std::span<float* const> ys);
// scratch = up x; out = silu(gate x) * scratch (silu_mul).
void matmul_glu(ThreadPool& pool, const TensorView& gate, const TensorView& up, const float* x,
                int64_t n_tokens, float* out, float* scratch);
// scratch = w x; y += scratch (add_inplace).
void matmul_add(ThreadPool& pool, const TensorView& w, const float* x, int64_t n_tokens,
                float* y, float* scratch);

// Converts row r of w to f32 (embedding look-up).
void row_to_f32(const TensorView& w, int64_t r, float* out);
// Converts a whole 1-D tensor (norm weights, biases) to f32.
void tensor_to_f32(const TensorView& w, float* out);

// Plain f32 helpers with a fixed reduction order.
float dot_f32(const float* a, const float* b, int64_t n);
// out = x / rms(x) * w; x and out may alias.
void rmsnorm(const float* x, const float* w, float eps, int64_t n, float* out);
// out[i] = exp(x[i]) by the engine's own fixed sequence of operations (kernel_set.h), the same
// bits on every kernel set, about 1 ulp from the true value; x and out may alias.
void exp_f32(const float* x, float* out, int64_t n);
// In-place numerically stable softmax (exp as above): the maximum m, x[i] = exp(x[i] - m), then
// each x[i] times 1 / the sum of the x[i] added in index order.
void softmax(float* x, int64_t n);
// softmax(row, n[r]) of row r = x + r * stride for r < n_rows, after x[i] /= div over each row's
// n[r] elements: bit for bit that division loop and softmax called row after row.
void softmax_rows(float* x, int64_t stride, const int64_t* n, int64_t n_rows, float div);
// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i]; out may alias gate.
void silu_mul(const float* gate, const float* up, int64_t n, float* out);
// y[i] += x[i]
void add_inplace(float* y, const float* x, int64_t n);
// y[i] += a * x[i]
void axpy(float* y, float a, const float* x, int64_t n);

// Attention's many small products, without a call per row:
// out[t * out_stride + r] = dot(x + t * x_stride, row r) for r < n_rows, t < n_x, where row r
// holds n elements of `dtype` (f32, f16 or bf16) at rows + r * row_bytes: each one bit for bit
// dot_f32 of x and the row converted to f32, whatever n_rows and n_x.
void dot_rows(DType dtype, const std::byte* rows, uint64_t row_bytes, int64_t n_rows,
              const float* x, int64_t x_stride, int64_t n_x, int64_t n, float* out,
              int64_t out_stride);
// For each output o < n_y: y[o * y_stride + i] += a[o * a_stride + r] * rows[r * stride + i] for
// r = 0, 1, ..., n_rows - 1 in that order: bit for bit axpy(y + o * y_stride, a[o * a_stride +
// r], rows + r * stride, n) called row after row. (Several outputs share each row's loads:
// attention's heads and queries that read the same V rows.)
void axpy_rows(float* y, int64_t y_stride, const float* a, int64_t a_stride, int64_t n_y,
               const float* rows, int64_t stride, int64_t n_rows, int64_t n);

}  // namespace cleave::cpu
