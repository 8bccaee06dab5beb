// Kernel bench: copy bandwidth, then matrix-vector (decode) and matrix-matrix (prefill) rates
// for each weight dtype on large matrices.
//
//   kernel_bench [--threads N] [--rounds R] [--isa avx512|avx2|generic] [--dtypes f16,q4_k,...]
//                [--shapes ROWSxCOLS,...] [--tokens T]
//
// --shapes replaces the default shapes (e.g. a model's own: 576x576,192x576,1536x576,576x1536
// for SmolLM2-135M); --tokens sets the prefill column's batch (default 64).
//
// The matrices are replicated so that each pass streams far more than the last-level cache:
// the decode figures are memory rates, comparable with the copy bandwidth (ratio matvec/copy).
// The prefill figures are compute rates: for the f32/f16/bf16 weights (fused multiply-adds in
// f32) the last column is their fraction of the f32 FMA peak of the same threads
// (compute_peak.h); the integer-path formats count their int8 products as flops too, so
// against that peak they have no ratio.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cleave/engine/cpu_kernels.h"
#include "cleave/model/dtype.h"
#include "bench_flags.h"
#include "compute_peak.h"
#include "copy_bandwidth.h"

namespace {

using cleave::DType;
using cleave::TensorView;

struct Shape {
  int64_t rows, cols;
};

// `copies` independent matrices of one shape and dtype, filled with small random values: for
// the float types, values drawn in [-0.5, 0.5) (never subnormal, which would measure the CPU's
// microcode assists instead of the kernel); for the block formats, random 16-bit words whose
// f16 scales are small and finite.
std::vector<std::vector<std::byte>> make_weights(DType dtype, Shape s, int copies) {
  const uint64_t bytes = *cleave::dtype_row_bytes(dtype, s.cols) * static_cast<uint64_t>(s.rows);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> value(-0.5f, 0.5f);
  std::vector<std::vector<std::byte>> out(static_cast<size_t>(copies));
  for (auto& buf : out) {
    buf.resize(bytes);
    auto* p = reinterpret_cast<uint16_t*>(buf.data());
    if (dtype == DType::kF32) {
      auto* f = reinterpret_cast<float*>(buf.data());
      for (uint64_t i = 0; i < bytes / 4; ++i) f[i] = value(rng);
    } else if (dtype == DType::kF16 || dtype == DType::kBF16) {
      for (uint64_t i = 0; i < bytes / 2; ++i)
        p[i] = dtype == DType::kF16 ? cleave::f32_to_f16(value(rng)) : cleave::f32_to_bf16(value(rng));
    } else {
      for (uint64_t i = 0; i < bytes / 2; ++i) p[i] = static_cast<uint16_t>(rng() & 0x3bff);
    }
  }
  return out;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 0, rounds = 5;
  int64_t tokens = 64;
  std::vector<DType> dtypes;
  std::vector<Shape> shapes{{4096, 4096}, {2048, 8192}, {8192, 2048}, {128, 1024}};
  cleave::bench::BenchFlags f("kernel_bench",
                              "usage: kernel_bench [--threads N] [--rounds R] "
                              "[--isa avx512|avx2|generic] [--dtypes f16,q4_k,...] "
                              "[--shapes ROWSxCOLS,...] [--tokens T]",
                              argc, argv);
  while (f.next()) {
    if (f.is("--dtypes")) {
      for (const std::string& name : f.values()) {
        const auto dt = cleave::parse_dtype(name);
        if (!dt) f.fail(fmt::format("--dtypes: '{}' is not a dtype", name));
        dtypes.push_back(*dt);
      }
      continue;
    }
    if (f.is("--shapes")) {
      shapes.clear();
      for (const std::string& v : f.values()) {
        Shape sh{};
        char sep = 0;
        std::istringstream in(v);
        if (!(in >> sh.rows >> sep >> sh.cols) || sep != 'x' || sh.rows <= 0 || sh.cols <= 0 ||
            !in.eof())
          f.fail(fmt::format("--shapes: '{}' is not ROWSxCOLS", v));
        shapes.push_back(sh);
      }
      continue;
    }
    if (f.is("--tokens")) {
      tokens = f.integer(1);
    } else if (f.is("--threads")) {
      threads = static_cast<int>(f.integer(0));
    } else if (f.is("--rounds")) {
      rounds = static_cast<int>(f.integer(1));
    } else if (f.is("--isa")) {
      const std::string isa = f.value();
      if (!cleave::cpu::set_kernel_isa(isa)) {
        f.fail(fmt::format("kernel set '{}' is unknown or unsupported here", isa));
      }
    } else {
      f.unknown();
    }
  }
  cleave::ThreadPool pool(threads, "bench");
  const auto bw = cleave::bench::measure_bandwidth(pool);
  fmt::print("kernels: {}   threads: {}\n", cleave::cpu::kernel_isa(), pool.size());
  fmt::print("copy bandwidth: {:.2f} GB/s copied, read bandwidth {:.2f} GB/s ({} MiB buffer, "
             "best of 7)\n",
             bw.copy_bytes_per_s / 1e9, bw.read_bytes_per_s / 1e9, bw.buffer_bytes >> 20);
  const auto peak = cleave::bench::measure_fma_peak(pool, cleave::cpu::kernel_isa());
  if (peak.lanes == 0) {
    fmt::print("f32 FMA peak: not measured for the {} kernel set\n", cleave::cpu::kernel_isa());
  } else {
    fmt::print("f32 FMA peak: {:.1f} GFLOP/s ({}-lane fused multiply-adds, best of 5){}\n",
               peak.flops_per_s / 1e9, peak.lanes,
               peak.checked ? "" : "  WARNING: its sums were wrong, the figure is not valid");
  }

  const uint64_t stream_target = uint64_t{256} << 20;  // bytes per pass, >> LLC
  // A shape that fits in L2 (the last default one) gives the kernel's compute limit, not memory's.
  if (dtypes.empty())
    for (int i = 0; i < cleave::kNumDTypes; ++i) dtypes.push_back(static_cast<DType>(i));
  fmt::print("\n{:<6} {:>11} {:>10} {:>12} {:>12} {:>10}   {:>16} {:>10}\n", "dtype", "shape",
             "matvec GB/s", "ratio/copy", "ratio/read", "us/matvec",
             fmt::format("prefill{} GFLOP/s", tokens), "ratio/peak");
  for (DType dtype : dtypes) {
    for (Shape s : shapes) {
      const auto row_bytes = cleave::dtype_row_bytes(dtype, s.cols);
      if (!row_bytes) {
        fmt::print("{:<6} {:>5}x{:<5} skipped: {} columns are not whole {} blocks\n",
                   cleave::dtype_name(dtype), s.rows, s.cols, s.cols, cleave::dtype_name(dtype));
        continue;
      }
      const uint64_t bytes = *row_bytes * static_cast<uint64_t>(s.rows);
      const bool in_cache = bytes <= (uint64_t{1} << 20);
      const int copies =
          in_cache ? 1 : static_cast<int>(std::max<uint64_t>(2, stream_target / bytes));
      auto weights = make_weights(dtype, s, copies);
      std::vector<TensorView> views(static_cast<size_t>(copies));
      for (int c = 0; c < copies; ++c)
        views[c] = TensorView{"w", dtype, {s.rows, s.cols}, weights[c].data(), bytes};
      std::vector<float> x(static_cast<size_t>(s.cols * tokens), 0.5f);
      std::vector<float> y(static_cast<size_t>(s.rows * tokens));

      for (const auto& v : views) cleave::cpu::matmul(pool, v, x.data(), s.cols, 1, y.data(), s.rows);
      double best = 1e30;
      const int reps = in_cache ? 200 : 1;
      for (int r = 0; r < rounds; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int k = 0; k < reps; ++k)
          for (const auto& v : views)
            cleave::cpu::matmul(pool, v, x.data(), s.cols, 1, y.data(), s.rows);
        best = std::min(best, seconds_since(t0) / copies / reps);
      }
      const double gbps = static_cast<double>(bytes) / best;

      double best_prefill = 1e30;
      for (int r = 0; r < std::max(2, rounds / 2); ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        cleave::cpu::matmul(pool, views[0], x.data(), s.cols, tokens, y.data(), s.rows);
        best_prefill = std::min(best_prefill, seconds_since(t0));
      }
      const double gflops = 2.0 * s.rows * s.cols * tokens / best_prefill / 1e9;
      const std::string of_peak = cleave::cpu::uses_int_path(dtype) || peak.flops_per_s <= 0
                                      ? std::string("-")
                                      : fmt::format("{:.3f}", gflops * 1e9 / peak.flops_per_s);
      fmt::print("{:<6} {:>5}x{:<5} {:>10.2f} {:>12.3f} {:>12.3f} {:>10.1f}   {:>16.1f} {:>10}{}\n",
                 cleave::dtype_name(dtype), s.rows, s.cols, gbps / 1e9, gbps / bw.copy_bytes_per_s,
                 gbps / bw.read_bytes_per_s, best * 1e6, gflops, of_peak,
                 in_cache ? "   (in L2: compute limit)" : "");
    }
  }
  return 0;
}
