// The CUDA backend: Backend over kernels/cuda_kernels.h (see cuda_backend.h).
#include "cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string_view>
#include <cstring>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "cleave/common/log.h"
#include "cleave/model/quants.h"
#include "cuda_kernels.h"
#include "fmt/format.h"
#include "step_graphs.h"

namespace cleave {
namespace {

std::string cuda_error(cudaError_t e) {
  return fmt::format("{} ({})", cudaGetErrorString(e), cudaGetErrorName(e));
}

cuda::ElemType elem_type(DType t) {
  return t == DType::kF16 ? cuda::ElemType::kF16
                          : t == DType::kBF16 ? cuda::ElemType::kBF16 : cuda::ElemType::kF32;
}

// A KV pool's bytes in device memory (zeroed).
class DeviceKvStorage final : public KvStorage {
 public:
  DeviceKvStorage(int device, std::byte* data, uint64_t bytes)
      : device_(device), data_(data), bytes_(bytes) {}
  ~DeviceKvStorage() override {
    int current = 0;
    cudaGetDevice(&current);
    cudaSetDevice(device_);
    cudaFree(data_);
    cudaSetDevice(current);
  }
  std::byte* data() override { return data_; }
  uint64_t size_bytes() const override { return bytes_; }
  int device() const override { return device_; }

 private:
  int device_;
  std::byte* data_;
  uint64_t bytes_;
};

// A pinned host mirror of a device KV pool; copies on a stream of its own, so that they do not
// wait for the compute stream's queued work (the caller orders them: after a layer's event on
// the prefill side; before the next step on the decode side).
class CudaKvStaging final : public KvStaging {
 public:
  CudaKvStaging(int device, std::byte* dev, std::byte* host, uint64_t bytes, cudaStream_t s)
      : device_(device), dev_(dev), host_(host), bytes_(bytes), stream_(s) {}
  ~CudaKvStaging() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
    cudaFreeHost(host_);
  }
  std::byte* host() override { return host_; }
  uint64_t size_bytes() const override { return bytes_; }
  Status to_host(std::span<const KvRange> ranges) override { return copy(ranges, true); }
  Status to_device(std::span<const KvRange> ranges) override { return copy(ranges, false); }

 private:
  Status copy(std::span<const KvRange> ranges, bool down) {
    for (const KvRange& r : ranges) {
      if (r.offset > bytes_ || r.bytes > bytes_ - r.offset) {
        return InvalidArgument(fmt::format("KV staging: range [{}, +{}) outside the pool of {} bytes",
                                           r.offset, r.bytes, bytes_));
      }
      const cudaError_t e =
          down ? cudaMemcpyAsync(host_ + r.offset, dev_ + r.offset, r.bytes,
                                 cudaMemcpyDeviceToHost, stream_)
               : cudaMemcpyAsync(dev_ + r.offset, host_ + r.offset, r.bytes,
                                 cudaMemcpyHostToDevice, stream_);
      if (e != cudaSuccess) {
        return Internal(fmt::format("KV staging copy: {}", cuda_error(e)));
      }
    }
    if (const cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess) {
      return Internal(fmt::format("KV staging copy: {}", cuda_error(e)));
    }
    return Status::Ok();
  }

  int device_;
  std::byte* dev_;
  std::byte* host_;
  uint64_t bytes_;
  cudaStream_t stream_;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int ordinal) : ordinal_(ordinal) {}

  Status init() {
    CLEAVE_RETURN_IF_ERROR(call(cudaSetDevice(ordinal_), "cudaSetDevice"));
    CLEAVE_RETURN_IF_ERROR(call(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                                "cudaStreamCreate"));
    CLEAVE_RETURN_IF_ERROR(call(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming),
                                "cudaEventCreate"));
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, ordinal_) == cudaSuccess) {
      log::info("cuda backend: device {} '{}' (sm_{}{}), {:.1f} GiB, {} multiprocessors", ordinal_,
                prop.name, prop.major, prop.minor,
                static_cast<double>(prop.totalGlobalMem) / (1 << 30), prop.multiProcessorCount);
    }
    return Status::Ok();
  }

  ~CudaBackend() override {
    cudaSetDevice(ordinal_);
    if (stream_) cudaStreamSynchronize(stream_);
    clear_graphs();
    for (void* p : allocations_) cudaFree(p);
    if (staging_) cudaFreeHost(staging_);
    if (staged_dev_) cudaFree(staged_dev_);
    if (host_out_) cudaFreeHost(host_out_);
    if (partials_) cudaFree(partials_);
    for (cudaEvent_t e : layer_events_) cudaEventDestroy(e);
    for (const Timed& t : timed_) {
      cudaEventDestroy(t.a);
      if (t.b) cudaEventDestroy(t.b);
    }
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    if (staged_) cudaEventDestroy(staged_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  const char* name() const override { return "cuda"; }
  int threads() const override { return 1; }
  int device() const override { return ordinal_; }
  void reserve_attention(const AttentionLimits&) override {}

  Result<float*> alloc(int64_t n) override {
    CLEAVE_ASSIGN_OR_RETURN(void* p, device_alloc(static_cast<uint64_t>(std::max<int64_t>(n, 1)) * 4));
    CLEAVE_RETURN_IF_ERROR(call(cudaMemset(p, 0, static_cast<size_t>(std::max<int64_t>(n, 1)) * 4),
                                "cudaMemset"));
    return static_cast<float*>(p);
  }

  Result<const float*> upload(std::span<const float> host) override {
    CLEAVE_ASSIGN_OR_RETURN(void* p, device_alloc(std::max<size_t>(host.size(), 1) * 4));
    CLEAVE_RETURN_IF_ERROR(
        call(cudaMemcpy(p, host.data(), host.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy"));
    return static_cast<const float*>(p);
  }

  Status prepare_weights(std::span<const TensorView* const> tensors) override {
    uint64_t bytes = 0;
    int dequantized = 0;
    for (const TensorView* t : tensors) {
      if (t == nullptr || weights_.count(t) != 0) continue;
      CLEAVE_ASSIGN_OR_RETURN(cuda::DeviceWeights w, upload_weights(*t, bytes));
      if (w.type == cuda::WeightType::kInt8Groups) ++dequantized;
      weights_.emplace(t, w);
    }
    log::info("cuda backend: {} weight tensors on cuda:{} ({:.1f} MiB; {} block-quantised "
              "tensors unpacked to int8 levels with f32 scales per 16 columns)",
              weights_.size(), ordinal_, static_cast<double>(bytes) / (1 << 20), dequantized);
    return Status::Ok();
  }

  Result<std::unique_ptr<KvStorage>> make_kv_storage(uint64_t bytes) override {
    CLEAVE_RETURN_IF_ERROR(call(cudaSetDevice(ordinal_), "cudaSetDevice"));
    void* p = nullptr;
    if (const cudaError_t e = cudaMalloc(&p, std::max<uint64_t>(bytes, 1)); e != cudaSuccess) {
      cudaGetLastError();
      return ResourceExhausted(fmt::format(
          "cannot allocate a KV pool of {} bytes on cuda:{}: {}; lower engine.kv_blocks or "
          "engine.kv_cache_bytes",
          bytes, ordinal_, cuda_error(e)));
    }
    if (const cudaError_t e = cudaMemset(p, 0, bytes); e != cudaSuccess) {
      cudaFree(p);
      return Internal(fmt::format("cudaMemset of the KV pool: {}", cuda_error(e)));
    }
    return std::unique_ptr<KvStorage>(
        new DeviceKvStorage(ordinal_, static_cast<std::byte*>(p), bytes));
  }

  Result<std::unique_ptr<KvStaging>> make_kv_staging(KvStorage& pool) override {
    if (pool.device() != ordinal_) {
      return FailedPrecondition(fmt::format(
          "KV staging: the pool is not in cuda:{} memory (it is in {})", ordinal_,
          pool.on_device() ? fmt::format("cuda:{}", pool.device()) : "host memory"));
    }
    CLEAVE_RETURN_IF_ERROR(call(cudaSetDevice(ordinal_), "cudaSetDevice"));
    void* host = nullptr;
    if (const cudaError_t e = cudaHostAlloc(&host, pool.size_bytes(), cudaHostAllocPortable);
        e != cudaSuccess) {
      cudaGetLastError();
      return ResourceExhausted(fmt::format(
          "KV staging: cannot pin {} bytes of host memory for the pool's mirror: {}",
          pool.size_bytes(), cuda_error(e)));
    }
    cudaStream_t s = nullptr;
    if (const cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); e != cudaSuccess) {
      cudaFreeHost(host);
      return Internal(fmt::format("KV staging: cudaStreamCreate: {}", cuda_error(e)));
    }
    std::memset(host, 0, pool.size_bytes());
    return std::unique_ptr<KvStaging>(new CudaKvStaging(
        ordinal_, pool.data(), static_cast<std::byte*>(host), pool.size_bytes(), s));
  }

  void begin_batch(const TokenBatch& b, std::span<const int32_t> tokens) override {
    // The arrays sit at offsets set by capacities, not by this batch's counts, so that a
    // recorded step (graphs_) finds the next batch of its shape at the same addresses.
    const auto n = static_cast<uint64_t>(b.n_tokens);
    if (n > cap_tokens_ || static_cast<uint64_t>(b.n_seqs) > cap_seqs_ ||
        static_cast<uint64_t>(b.n_block_ids) > cap_ids_ || tokens.size() > n) {
      cap_tokens_ = std::max<uint64_t>({n, 2 * cap_tokens_, 64});
      cap_seqs_ = std::max<uint64_t>({static_cast<uint64_t>(b.n_seqs), 2 * cap_seqs_, 64});
      cap_ids_ = std::max<uint64_t>({static_cast<uint64_t>(b.n_block_ids), 2 * cap_ids_, 1024});
      if (!grow_staging(staging_bytes())) return;
    }
    const uint64_t off_slots = align16(cap_tokens_ * 8);
    const uint64_t off_seq = off_slots + align16(cap_tokens_ * 8);
    const uint64_t off_tokens = off_seq + align16(cap_tokens_ * 4);
    const uint64_t off_seq_blocks = off_tokens + align16(cap_tokens_ * 4);
    const uint64_t off_ids = off_seq_blocks + align16(cap_seqs_ * 8);
    // The last copy out of the staging buffer must be done before it is overwritten.
    if (!ok(cudaEventSynchronize(staged_), "cudaEventSynchronize")) return;
    auto put = [&](uint64_t off, const void* src, uint64_t bytes) {
      if (bytes > 0) std::memcpy(staging_ + off, src, bytes);
    };
    put(0, b.positions, n * 8);
    put(off_slots, b.kv_slots, n * 8);
    put(off_seq, b.seq, n * 4);
    put(off_tokens, tokens.data(), tokens.size() * 4);
    put(off_seq_blocks, b.seq_blocks, static_cast<uint64_t>(b.n_seqs) * 8);
    put(off_ids, b.block_ids, static_cast<uint64_t>(b.n_block_ids) * 4);
    const uint64_t total = off_ids + static_cast<uint64_t>(b.n_block_ids) * 4;
    ok(cudaMemcpyAsync(staged_dev_, staging_, total, cudaMemcpyHostToDevice, stream_),
       "cudaMemcpyAsync (batch)");
    ok(cudaEventRecord(staged_, stream_), "cudaEventRecord");
    std::byte* d = staged_dev_;
    dbatch_ = cuda::DeviceTokenBatch{
        .n_tokens = b.n_tokens,
        .positions = reinterpret_cast<const int64_t*>(d),
        .kv_slots = reinterpret_cast<const int64_t*>(d + off_slots),
        .seq = reinterpret_cast<const int32_t*>(d + off_seq),
        .seq_blocks = reinterpret_cast<const int64_t*>(d + off_seq_blocks),
        .block_ids = reinterpret_cast<const int32_t*>(d + off_ids)};
    dtokens_ = reinterpret_cast<const int32_t*>(d + off_tokens);
    max_keys_ = 1;
    for (int64_t t = 0; t < b.n_tokens; ++t) max_keys_ = std::max(max_keys_, b.positions[t] + 1);
  }

  Replay begin_replayable(const PagedKv& kv) override {
    if (!graphs_enabled_) return Replay::kEager;
    const int64_t split = cuda::attention_split_keys(max_keys_);
    const StepShape shape{dbatch_.n_tokens, (max_keys_ + split - 1) / split, kv.base,
                          kv.num_blocks,     kv.block_size,                  kv.kv_dim,
                          static_cast<int>(kv.dtype)};
    cudaGraphExec_t exec = nullptr;
    switch (graphs_.lookup(shape, &exec)) {
      case StepGraphs<cudaGraphExec_t>::Action::kEager:
        return Replay::kEager;
      case StepGraphs<cudaGraphExec_t>::Action::kReplay:
        return ok(cudaGraphLaunch(exec, stream_), "cudaGraphLaunch") ? Replay::kReplayed
                                                                     : Replay::kEager;
      case StepGraphs<cudaGraphExec_t>::Action::kRecord:
        break;
    }
    if (cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
      cudaGetLastError();
      return Replay::kEager;
    }
    recording_ = shape;
    return Replay::kRecording;
  }

  bool end_replayable() override {
    cudaGraph_t graph = nullptr;
    cudaError_t e = cudaStreamEndCapture(stream_, &graph);
    cudaGraphExec_t exec = nullptr;
    if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
    if (graph) cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
      cudaGetLastError();
      // Recording failed (nothing ran): this backend runs eagerly from now on.
      log::warn("cuda backend: recording a step as a CUDA graph failed ({}); steps run without "
                "graphs", cuda_error(e));
      graphs_enabled_ = false;
      clear_graphs();
      first_error_ = Status::Ok();  // the launches' capture errors; the step is issued again
      return false;
    }
    graphs_.recorded(recording_, exec);
    return ok(cudaGraphLaunch(exec, stream_), "cudaGraphLaunch");
  }

  void mark_kv_written(int64_t layer) override {
    while (static_cast<int64_t>(layer_events_.size()) <= layer) {
      cudaEvent_t e = nullptr;
      if (!ok(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate")) return;
      layer_events_.push_back(e);
    }
    ok(cudaEventRecord(layer_events_[static_cast<size_t>(layer)], stream_), "cudaEventRecord");
  }

  bool kv_written(int64_t layer, bool wait) override {
    if (layer < 0 || layer >= static_cast<int64_t>(layer_events_.size())) return true;
    cudaEvent_t e = layer_events_[static_cast<size_t>(layer)];
    if (wait) return ok(cudaEventSynchronize(e), "cudaEventSynchronize");
    const cudaError_t r = cudaEventQuery(e);
    if (r == cudaErrorNotReady) return false;
    return ok(r, "cudaEventQuery");
  }

  const float* to_host(const float* src, int64_t n) override {
    const uint64_t bytes = static_cast<uint64_t>(std::max<int64_t>(n, 1)) * 4;
    if (bytes > host_out_capacity_) {
      cudaStreamSynchronize(stream_);
      if (host_out_) cudaFreeHost(host_out_);
      host_out_ = nullptr;
      host_out_capacity_ = 0;
      void* p = nullptr;
      if (!ok(cudaHostAlloc(&p, bytes, cudaHostAllocDefault), "cudaHostAlloc")) {
        return empty_result(n);
      }
      host_out_ = static_cast<float*>(p);
      host_out_capacity_ = bytes;
    }
    ok(cudaMemcpyAsync(host_out_, src, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost,
                       stream_),
       "cudaMemcpyAsync (to host)");
    if (!ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize")) return empty_result(n);
    if (profiling_) collect_profile();
    return host_out_;
  }

  std::string profile_report(bool reset) override {
    if (!profiling_) return {};
    cudaStreamSynchronize(stream_);
    collect_profile();
    std::vector<std::pair<std::string, OpTotal>> rows(op_totals_.begin(), op_totals_.end());
    std::sort(rows.begin(), rows.end(),
              [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
    double all = 0;
    for (const auto& [name, t] : rows) all += t.ms;
    std::string out = fmt::format("{:<24} {:>10} {:>8} {:>10} {:>7}\n", "operation", "total ms",
                                  "calls", "mean us", "share");
    for (const auto& [name, t] : rows) {
      out += fmt::format("{:<24} {:>10.3f} {:>8} {:>10.2f} {:>6.1f}%\n", name, t.ms, t.calls,
                         t.ms * 1e3 / static_cast<double>(t.calls), 100.0 * t.ms / all);
    }
    if (reset) op_totals_.clear();
    return out;
  }

  Status check() override {
    Status s = std::move(first_error_);
    first_error_ = Status::Ok();
    return s;
  }

  void matmul(const TensorView& w, const float* x, int64_t n_tokens, float* y) override {
    const cuda::DeviceWeights* dw = find(w);
    const OpTimer timer(this, "matmul");
    if (dw) ok(cuda::matmul(*dw, x, n_tokens, y, stream_), "matmul");
  }

  void matmul_many(std::span<const TensorView* const> ws, const float* x, int64_t n_tokens,
                   std::span<float* const> ys) override {
    cuda::DeviceWeights dw[3];
    const bool fusable = ws.size() <= 3 && same_layout(ws, dw);
    if (!fusable) {
      for (size_t i = 0; i < ws.size(); ++i) matmul(*ws[i], x, n_tokens, ys[i]);
      return;
    }
    const OpTimer timer(this, "matmul_many (q, k, v)");
    ok(cuda::matmul_many(dw, static_cast<int>(ws.size()), x, n_tokens, ys.data(), stream_),
       "matmul_many");
  }

  void matmul_add(const TensorView& w, const float* x, int64_t n_tokens, float* y,
                  float* scratch) override {
    const OpTimer timer(this, "matmul_add (o, down)");
    const cuda::DeviceWeights* dw = find(w);
    if (dw) ok(cuda::matmul_add(*dw, x, n_tokens, y, stream_), "matmul_add");
  }

  void matmul_glu(const TensorView& gate, const TensorView& up, const float* x, int64_t n_tokens,
                  float* out, float* scratch) override {
    const TensorView* ws[] = {&gate, &up};
    cuda::DeviceWeights dw[3];
    if (!same_layout(ws, dw) || gate.rows() != up.rows()) {
      Backend::matmul_glu(gate, up, x, n_tokens, out, scratch);
      return;
    }
    const OpTimer timer(this, "matmul_glu (gate, up)");
    ok(cuda::matmul_glu(dw[0], dw[1], x, n_tokens, out, stream_), "matmul_glu");
  }

  void embedding(const TensorView& table, std::span<const int32_t> tokens, float* out) override {
    const cuda::DeviceWeights* dw = find(table);
    if (dw) {
      const OpTimer timer(this, "embedding");
      ok(cuda::embedding_rows(*dw, dtokens_, static_cast<int64_t>(tokens.size()), out, stream_),
         "embedding");
    }
  }

  void rmsnorm(const float* x, const float* weight, float eps, int64_t n_tokens, int64_t dim,
               float* out) override {
    const OpTimer timer(this, "rmsnorm");
    ok(cuda::rmsnorm(x, weight, eps, n_tokens, dim, out, stream_), "rmsnorm");
  }

  void rope(const RopeArgs& a) override {
    const OpTimer timer(this, "rope");
    ok(cuda::rope(a.x, a.row_stride, a.n_tokens, dbatch_.positions, a.n_heads, a.head_dim,
                  a.style == RopeStyle::kNeox, a.inv_freq, stream_),
       "rope");
  }

  void write_kv(const KvWriteArgs& a) override {
    const OpTimer timer(this, "write_kv");
    ok(cuda::write_kv(dbatch_, a.k, a.v, device_kv(a.kv), a.layer, stream_), "write_kv");
  }

  void attention(const AttentionArgs& a) override {
    const int64_t need = cuda::attention_partial_floats(dbatch_.n_tokens, max_keys_, a.n_heads,
                                                        a.head_dim);
    if (need > partial_capacity_) {
      // Grows rarely (a longer context or a larger batch than before); the old scratch may still
      // be read by queued kernels, so the stream drains first.
      if (!ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize")) return;
      clear_graphs();  // they read the old scratch
      const int64_t floats = std::max(need, 2 * partial_capacity_);
      if (partials_) cudaFree(partials_);
      partials_ = nullptr;
      partial_capacity_ = 0;
      void* p = nullptr;
      if (!ok(cudaMalloc(&p, static_cast<size_t>(floats) * 4), "cudaMalloc (attention scratch)")) {
        return;
      }
      partials_ = static_cast<float*>(p);
      partial_capacity_ = floats;
    }
    const OpTimer timer(this, "attention");
    ok(cuda::paged_attention(dbatch_, a.q, a.out, device_kv(a.kv), a.layer, a.n_heads,
                             a.n_kv_heads, a.head_dim, max_keys_, partials_, partial_capacity_,
                             stream_),
       "paged_attention");
  }

  void silu_mul(const float* gate, const float* up, int64_t n, float* out) override {
    const OpTimer timer(this, "silu_mul");
    ok(cuda::silu_mul(gate, up, n, out, stream_), "silu_mul");
  }
  void add(float* y, const float* x, int64_t n) override {
    const OpTimer timer(this, "add");
    ok(cuda::add(y, x, n, stream_), "add");
  }
  void add_bias(float* y, const float* bias, int64_t n_tokens, int64_t dim) override {
    const OpTimer timer(this, "add_bias");
    ok(cuda::add_bias(y, bias, n_tokens, dim, stream_), "add_bias");
  }

 private:
  static uint64_t align16(uint64_t v) { return (v + 15) / 16 * 16; }

  // CLEAVE_CUDA_PROFILE=1: every operation between two events on the stream (graphs off), the
  // times summed per operation at each to_host(); profile_report() lists them.
  struct OpTimer {
    OpTimer(CudaBackend* b, const char* n) : be(b), name(n) {
      if (be->profiling_) start = be->profile_event();
    }
    ~OpTimer() {
      if (start) be->timed_.push_back(Timed{name, start, be->profile_event()});
    }
    CudaBackend* be;
    const char* name;
    cudaEvent_t start = nullptr;
  };
  struct Timed {
    const char* name;
    cudaEvent_t a, b;
  };
  struct OpTotal {
    double ms = 0;
    int64_t calls = 0;
  };
  cudaEvent_t profile_event() {
    cudaEvent_t e = nullptr;
    if (!free_events_.empty()) {
      e = free_events_.back();
      free_events_.pop_back();
    } else if (cudaEventCreate(&e) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    cudaEventRecord(e, stream_);
    return e;
  }
  void collect_profile() {
    for (const Timed& t : timed_) {
      float ms = 0;
      if (t.b && cudaEventElapsedTime(&ms, t.a, t.b) == cudaSuccess) {
        OpTotal& o = op_totals_[t.name];
        o.ms += ms;
        ++o.calls;
      }
      free_events_.push_back(t.a);
      if (t.b) free_events_.push_back(t.b);
    }
    timed_.clear();
  }

  static cuda::DevicePagedKv device_kv(const PagedKv& kv) {
    return cuda::DevicePagedKv{.base = kv.base, .num_blocks = kv.num_blocks,
                               .block_size = kv.block_size, .kv_dim = kv.kv_dim,
                               .dtype = elem_type(kv.dtype)};
  }

  Status call(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return Status::Ok();
    cudaGetLastError();  // clears a non-sticky error
    return Unavailable(fmt::format("cuda:{}: {}: {}", ordinal_, what, cuda_error(e)));
  }

  // Keeps the first error for check(); true when e is cudaSuccess.
  bool ok(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return true;
    cudaGetLastError();
    if (first_error_.ok()) {
      first_error_ = Internal(fmt::format("cuda:{}: {}: {}", ordinal_, what, cuda_error(e)));
      log::error("{}", first_error_.message());
    }
    return false;
  }

  const float* empty_result(int64_t n) {
    // A failed copy: the caller still gets n readable floats (NaN), and check() fails the step.
    nan_fallback_.assign(static_cast<size_t>(std::max<int64_t>(n, 1)), std::nanf(""));
    return nan_fallback_.data();
  }

  // The prepared weights of `ws` into `out` when they share one layout and column count (one
  // launch can take them).
  bool same_layout(std::span<const TensorView* const> ws, cuda::DeviceWeights* out) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const cuda::DeviceWeights* d = find(*ws[i]);
      if (d == nullptr) return false;
      if (i > 0 && (d->type != out[0].type || d->cols != out[0].cols)) return false;
      out[i] = *d;
    }
    return !ws.empty();
  }

  const cuda::DeviceWeights* find(const TensorView& t) {
    auto it = weights_.find(&t);
    if (it != weights_.end()) return &it->second;
    if (first_error_.ok()) {
      first_error_ = Internal(fmt::format(
          "cuda backend: weight tensor '{}' was not prepared (prepare_weights)", t.name));
    }
    return nullptr;
  }

  Result<void*> device_alloc(uint64_t bytes) {
    void* p = nullptr;
    if (const cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess) {
      cudaGetLastError();
      return ResourceExhausted(fmt::format("cuda:{}: cannot allocate {} bytes of device memory: {}",
                                           ordinal_, bytes, cuda_error(e)));
    }
    allocations_.push_back(p);
    return p;
  }

  uint64_t staging_bytes() const {
    return 3 * align16(cap_tokens_ * 8) + align16(cap_tokens_ * 4) + align16(cap_seqs_ * 8) +
           align16(cap_ids_ * 4);
  }

  void clear_graphs() { graphs_.clear(); }

  bool grow_staging(uint64_t bytes) {
    clear_graphs();  // they read the old buffers
    if (!ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize")) return false;
    if (staging_) cudaFreeHost(staging_);
    if (staged_dev_) cudaFree(staged_dev_);
    staging_ = nullptr;
    staged_dev_ = nullptr;
    staged_capacity_ = 0;
    void* h = nullptr;
    void* d = nullptr;
    if (!ok(cudaHostAlloc(&h, bytes, cudaHostAllocDefault), "cudaHostAlloc")) return false;
    staging_ = static_cast<std::byte*>(h);
    if (!ok(cudaMalloc(&d, bytes), "cudaMalloc (batch)")) return false;
    staged_dev_ = static_cast<std::byte*>(d);
    staged_capacity_ = bytes;
    return true;
  }

  // One weight tensor to the device, in the layout matmul() reads (cuda_kernels.h WeightType).
  Result<cuda::DeviceWeights> upload_weights(const TensorView& t, uint64_t& bytes) {
    cuda::DeviceWeights w{.rows = t.rows(), .cols = t.cols()};
    const auto rows = static_cast<uint64_t>(w.rows), cols = static_cast<uint64_t>(w.cols);
    switch (t.dtype) {
      case DType::kF32:
      case DType::kF16:
      case DType::kBF16: {
        w.type = t.dtype == DType::kF32   ? cuda::WeightType::kF32
                 : t.dtype == DType::kF16 ? cuda::WeightType::kF16
                                          : cuda::WeightType::kBF16;
        CLEAVE_ASSIGN_OR_RETURN(void* p, device_alloc(t.nbytes));
        CLEAVE_RETURN_IF_ERROR(
            call(cudaMemcpy(p, t.data, t.nbytes, cudaMemcpyHostToDevice), "cudaMemcpy (weights)"));
        w.data = p;
        bytes += t.nbytes;
        return w;
      }
      default:
        break;
    }
    if (!dtype_is_quantized(t.dtype) || cols % kQK != 0) {
      return InvalidArgument(fmt::format("cuda backend: tensor '{}' has dtype {} with {} columns, "
                                         "which it cannot read",
                                         t.name, dtype_name(t.dtype), cols));
    }
    // Block-quantised: int8 levels, and per 16 columns scale = d * sc, offset = m * mn
    // (quants.h IntBlock), converted a slab of rows at a time.
    w.type = cuda::WeightType::kInt8Groups;
    const uint64_t groups = cols / 16;
    CLEAVE_ASSIGN_OR_RETURN(void* q, device_alloc(rows * cols));
    CLEAVE_ASSIGN_OR_RETURN(void* sc, device_alloc(rows * groups * 4));
    CLEAVE_ASSIGN_OR_RETURN(void* of, device_alloc(rows * groups * 4));
    const uint64_t row_bytes = t.row_bytes();
    const uint64_t slab = std::max<uint64_t>(1, (uint64_t{32} << 20) / cols);
    std::vector<int8_t> hq;
    std::vector<float> hs, ho;
    IntBlock blk;
    for (uint64_t r0 = 0; r0 < rows; r0 += slab) {
      const uint64_t nr = std::min(slab, rows - r0);
      hq.resize(nr * cols);
      hs.resize(nr * groups);
      ho.resize(nr * groups);
      for (uint64_t r = 0; r < nr; ++r) {
        const std::byte* row = t.data + (r0 + r) * row_bytes;
        for (uint64_t b = 0; b < cols / kQK; ++b) {
          int_block(t.dtype, row, static_cast<int64_t>(b), &blk);
          std::memcpy(&hq[r * cols + b * kQK], blk.q, kQK);
          for (int h = 0; h < 2; ++h) {
            hs[r * groups + 2 * b + h] = blk.d * static_cast<float>(blk.sc[h]);
            ho[r * groups + 2 * b + h] = blk.m * static_cast<float>(blk.mn[h]);
          }
        }
      }
      CLEAVE_RETURN_IF_ERROR(call(cudaMemcpy(static_cast<int8_t*>(q) + r0 * cols, hq.data(),
                                             nr * cols, cudaMemcpyHostToDevice),
                                  "cudaMemcpy (weights)"));
      CLEAVE_RETURN_IF_ERROR(call(cudaMemcpy(static_cast<float*>(sc) + r0 * groups, hs.data(),
                                             nr * groups * 4, cudaMemcpyHostToDevice),
                                  "cudaMemcpy (weights)"));
      CLEAVE_RETURN_IF_ERROR(call(cudaMemcpy(static_cast<float*>(of) + r0 * groups, ho.data(),
                                             nr * groups * 4, cudaMemcpyHostToDevice),
                                  "cudaMemcpy (weights)"));
    }
    w.data = q;
    w.scales = static_cast<const float*>(sc);
    w.offsets = static_cast<const float*>(of);
    bytes += rows * cols + 2 * rows * groups * 4;
    return w;
  }

  int ordinal_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t staged_ = nullptr;            // the last batch upload out of staging_
  std::vector<void*> allocations_;          // alloc(), upload(), weights: freed with the backend
  std::unordered_map<const TensorView*, cuda::DeviceWeights> weights_;
  std::byte* staging_ = nullptr;            // pinned host copy of a batch's index arrays
  std::byte* staged_dev_ = nullptr;         // and its device copy
  uint64_t staged_capacity_ = 0;
  cuda::DeviceTokenBatch dbatch_;
  const int32_t* dtokens_ = nullptr;
  uint64_t cap_tokens_ = 0, cap_seqs_ = 0, cap_ids_ = 0;  // staging capacities
  // Recorded steps (CUDA graphs) by the shape their launches depend on (step_graphs.h).
  StepGraphs<cudaGraphExec_t> graphs_{[](cudaGraphExec_t g) { cudaGraphExecDestroy(g); }};
  StepShape recording_{};
  bool profiling_ = std::getenv("CLEAVE_CUDA_PROFILE") != nullptr &&
                   std::string_view(std::getenv("CLEAVE_CUDA_PROFILE")) == "1";
  bool graphs_enabled_ = !profiling_ && (std::getenv("CLEAVE_CUDA_GRAPHS") == nullptr ||
                                         std::string_view(std::getenv("CLEAVE_CUDA_GRAPHS")) != "0");
  std::vector<Timed> timed_;
  std::vector<cudaEvent_t> free_events_;
  std::map<std::string, OpTotal> op_totals_;
  int64_t max_keys_ = 1;                    // the largest position + 1 of the batch
  float* partials_ = nullptr;               // attention's split partials (flash-decoding)
  int64_t partial_capacity_ = 0;
  std::vector<cudaEvent_t> layer_events_;
  float* host_out_ = nullptr;               // pinned, for to_host()
  uint64_t host_out_capacity_ = 0;
  std::vector<float> nan_fallback_;
  Status first_error_;
};

}  // namespace

Result<std::string> cuda_pci_bus_id(int ordinal) {
  char id[32] = {};
  if (const cudaError_t e = cudaDeviceGetPCIBusId(id, sizeof id, ordinal); e != cudaSuccess) {
    cudaGetLastError();
    return Unavailable(fmt::format("CUDA device {}: {}", ordinal, cuda_error(e)));
  }
  return std::string(id);
}

Result<std::unique_ptr<Backend>> make_cuda_backend(int ordinal) {
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    cudaGetLastError();
    return Unavailable(fmt::format("engine.device cuda:{}: no usable CUDA driver or device: {}",
                                   ordinal, cuda_error(e)));
  }
  if (ordinal >= count) {
    return Unavailable(fmt::format("engine.device cuda:{}: this machine has {} CUDA device{}",
                                   ordinal, count, count == 1 ? "" : "s"));
  }
  auto be = std::make_unique<CudaBackend>(ordinal);
  CLEAVE_RETURN_IF_ERROR(be->init());
  return std::unique_ptr<Backend>(std::move(be));
}

}  // namespace cleave
