// The transfer engine's settings (transfer.*): plain fields with defaults in code, bound to the
// settings registry (cleave/common/config.h) by register_transfer_settings.
#pragma once

#include <cstdint>
#include <string>

#include "cleave/common/config.h"

namespace cleave {

// The libfabric transfer engine (src/transfer).
struct TransferSettings {
  // "auto" (efa, then verbs;ofi_rxm, then shm when every peer is on this host, then
  // tcp;ofi_rxm) or a provider as libfabric spells it: "tcp;ofi_rxm", "shm", "efa", ...
  std::string provider = "auto";
  // Node (address) passed to fi_getinfo; empty lets the provider choose. "127.0.0.1" pins
  // socket-based providers to loopback.
  std::string node;
  // Endpoints the engine drives in parallel. Spread over distinct domains (NICs) when the
  // provider offers several, else several endpoints on one domain.
  int64_t rails = 1;
  // Large writes are cut into slices of at most this many bytes, spread over the rails.
  int64_t slice_bytes = 1 << 20;
  // Most writes in flight per rail; 0 = the provider's TX queue depth.
  int64_t max_inflight_per_rail = 0;
  // A posted write (or notice) that sees no completion from its peer for this long fails its
  // transfer with DEADLINE_EXCEEDED and marks the peer unreachable.
  int64_t completion_timeout_ms = 5000;
  // Post writes with FI_DELIVERY_COMPLETE when the provider accepts it (the notice is always
  // sent only after every write of its batch has completed).
  bool delivery_complete = true;
  // Ask for FI_HMEM (registration of GPU memory) when built with CUDA. Off by default: the KV
  // pool is host memory, and FI_HMEM costs some providers their fastest host path (shm turns
  // off its single-copy CMA transfers and falls back to copying through bounce buffers).
  bool hmem = false;
  // A rail's progress thread keeps polling (instead of napping ~100 us) for this many
  // microseconds after its last activity, on providers whose CQ has no wait object (shm): a
  // target completes incoming writes only while it polls. 0 = always nap when idle.
  int64_t idle_poll_us = 2000;
};

// Binds transfer.* to `registry` (the fields must outlive it).
void register_transfer_settings(TransferSettings& settings, SettingsRegistry& registry);

}  // namespace cleave
