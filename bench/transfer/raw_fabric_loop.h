// A bare libfabric RMA endpoint for the bench's baseline: one endpoint, fi_write in a window.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>

#include "cleave/common/status.h"

struct fi_info;
struct fid_fabric;
struct fid_domain;
struct fid_ep;
struct fid_cq;
struct fid_av;
struct fid_mr;

namespace cleave::transfer {

class RawFabricEndpoint {
 public:
  ~RawFabricEndpoint();
  Status open(const std::string& provider, void* buf, uint64_t len);
  std::string name() const { return name_; }
  uint64_t key() const;
  bool virt_addr() const { return virt_addr_; }
  Status connect(const std::string& peer_name);
  // Writes `iters` times `size` bytes to the peer (remote base `addr`, `key`) with `window` in
  // flight, each with FI_DELIVERY_COMPLETE when `delivery_complete`; returns seconds.
  Result<double> write_loop(uint64_t size, int64_t iters, int64_t window, uint64_t remote_addr,
                            uint64_t key, bool delivery_complete);
  // Target side: drive progress until stop is set.
  void serve(const std::atomic<bool>& stop);

 private:
  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_ep* ep_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_mr* mr_ = nullptr;
  void* buf_ = nullptr;
  uint64_t peer_ = 0;
  bool virt_addr_ = false, prov_key_ = false;
  std::string name_;
};

}  // namespace cleave::transfer
