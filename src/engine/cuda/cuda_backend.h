// The CUDA backend (DESIGN.md §3 "Backends"): the Backend operations over the kernels of
// kernels/cuda_kernels.h, on one stream of one device. Built only with CLEAVE_HAVE_CUDA.
//
// Memory: activations, constant vectors and weights live in device memory (weights uploaded once
// by prepare_weights: f32, f16 and bf16 as they are; every block-quantised format unpacked into
// int8 levels with an f32 scale and offset per 16 columns, cuda_kernels.h kInt8Groups). KV pools
// get device storage (cudaMalloc, zeroed). Index arrays go up once per sub-batch through one
// pinned staging buffer; results come back through a pinned buffer in to_host().
//
// Asynchrony: operations are queued on the stream; mark_kv_written records an event per layer
// that kv_written() queries or waits on. A failed launch or a device fault is kept as the first
// error and returned by check() (the engine then fails the step).
#pragma once

#include <memory>
#include <string>

#include "cleave/common/status.h"
#include "cleave/engine/backend.h"

namespace cleave {

// Unavailable (with the driver's reason) when device `ordinal` cannot be used.
Result<std::unique_ptr<Backend>> make_cuda_backend(int ordinal);
// Device `ordinal`'s PCI bus id ("0000:65:00.0", the form NVML takes); Unavailable when the
// device is not there.
Result<std::string> cuda_pci_bus_id(int ordinal);

}  // namespace cleave
