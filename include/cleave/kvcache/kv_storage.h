// Where a KV pool's bytes live (DESIGN.md §3 "KV pool"): the storage is separate from the block
// allocator and the prefix cache (kv_block_pool.h), so that one allocator serves a pool in host
// memory (the CPU backend) or in GPU memory (the CUDA backend) with the same block layout. The
// storage is what the transfer engine registers.
//
// Thread-safety: the buffer is written by the engine thread's backend and read by transfers;
// the storage object itself is immutable after creation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "cleave/common/status.h"

namespace cleave {

class KvStorage {
 public:
  virtual ~KvStorage() = default;
  // The buffer: at least the layout's total_bytes(), zeroed at creation, 2 MiB-aligned.
  virtual std::byte* data() = 0;
  virtual uint64_t size_bytes() const = 0;
  // -1: host memory that the CPU may read and write; >= 0: memory of that CUDA device (never
  // dereference it on the host).
  virtual int device() const = 0;
  bool on_device() const { return device() >= 0; }
};

// Anonymous host memory, zeroed, 2 MiB-aligned so it can be registered for RDMA, committed up
// front with MADV_POPULATE_WRITE where the kernel has it (steps never page-fault, and a pool the
// machine cannot hold fails here). ResourceExhausted (naming the byte count) when the memory
// cannot be had.
Result<std::unique_ptr<KvStorage>> make_host_kv_storage(uint64_t bytes);

}  // namespace cleave
