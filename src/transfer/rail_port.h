// The few fabric operations a FabricRail uses, behind a narrow interface: the real one calls
// libfabric (libfabric_rail_port.cpp); unit tests put a fault-injecting fake in its place.
// Internal header.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_eq.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "cleave/common/status.h"

namespace cleave::transfer {

// One RDM endpoint with its own completion queue and address vector (and, when the provider
// offers FI_RMA_EVENT, a counter of peers' writes into this process).
//
// Return values follow libfabric: 0 (or a count) on success, else a negative fi_errno;
// -FI_EAGAIN from a post means "no TX credit now: make progress (read()) and post again", and
// read() returns -FI_EAGAIN when the queue is empty and -FI_EAVAIL when read_error() has an
// entry. `context` pointers belong to the caller, come back unchanged in completions and must
// stay valid until their completion was read or the endpoint is gone (forever, for an
// endpoint that is kept open on purpose: see keep_forever()).
//
// Thread-safety: the owning rail serialises every call with its progress lock, except wait()
// (its own thread, without the lock) and signal() (any thread); the real endpoint is opened
// FI_THREAD_SAFE for that. Destroying the object closes the endpoint, the counter, the AV and
// the CQ, in that order.
class RailEndpoint {
 public:
  virtual ~RailEndpoint() = default;

  // The serialized endpoint name (fi_getname) that peers insert into their AV.
  virtual const std::string& name() const = 0;
  // Whether wait() sleeps on a file descriptor until the provider has work.
  virtual bool waitable() const = 0;

  // Returns the number inserted (1) or a negative fi_errno; `*addr` is valid on 1.
  virtual int av_insert(const std::string& peer_name, fi_addr_t* addr) = 0;

  // One RMA write of `len` bytes from `local` (registered, `local_desc`) to `remote_addr` under
  // `key` at `dest`; `flags` as for fi_writemsg. Called once per slice: keep it cheap.
  virtual ssize_t write(void* local, size_t len, void* local_desc, fi_addr_t dest,
                        uint64_t remote_addr, uint64_t key, uint64_t flags, void* context) = 0;
  // A small untagged message (a notice) from a registered buffer; `flags` as for fi_sendmsg
  // (FI_COMPLETION, and FI_DELIVERY_COMPLETE for a notice that must not be lost with the
  // endpoint: a message only handed to the transport is dropped when its endpoint closes).
  virtual ssize_t send(const void* buf, size_t len, void* desc, fi_addr_t dest, uint64_t flags,
                       void* context) = 0;
  // A receive buffer for a message from any peer.
  virtual ssize_t recv(void* buf, size_t len, void* desc, void* context) = 0;

  // Reads up to `count` completions (count 0 only makes progress).
  virtual ssize_t read(fi_cq_data_entry* entries, size_t count) = 0;
  // Takes one error completion (after read() returned -FI_EAVAIL); 1 or a negative fi_errno.
  virtual ssize_t read_error(fi_cq_err_entry* entry) = 0;
  // The provider's own words for an error completion ("-" when it has none).
  virtual std::string provider_error(const fi_cq_err_entry& entry) = 0;
  // Like read(), but sleeps up to `timeout_ms` for a completion; only when waitable().
  virtual ssize_t wait(fi_cq_data_entry* entries, size_t count, int timeout_ms) = 0;
  // Wakes a thread inside wait().
  virtual void signal() = 0;
  // Peers' writes into this process completed so far; 0 forever without FI_RMA_EVENT.
  virtual uint64_t remote_writes() = 0;
  // Whether remote_writes() counts (the provider granted FI_RMA_EVENT). When it does not, the
  // rail sends its peers wake-ups ahead of writes (same provider on both sides).
  virtual bool counts_remote_writes() const = 0;
};

// A registration of a local buffer for sends or receives; destroying it deregisters.
class RailMemory {
 public:
  virtual ~RailMemory() = default;
  // The descriptor to pass with the buffer (fi_mr_desc); may be null.
  virtual void* desc() const = 0;
};

// What a rail needs from its domain: its attributes, buffer registration, fresh endpoints.
// Owned by one rail; not thread-safe (the rail calls it with its progress lock held or before
// its thread starts). The domain behind it outlives the port.
class RailPort {
 public:
  virtual ~RailPort() = default;
  virtual const char* provider_name() const = 0;
  // The provider's TX queue depth (entries); 0 when it does not say.
  virtual size_t tx_depth() const = 0;
  // Largest single message or RMA write, in bytes.
  virtual uint64_t max_msg_size() const = 0;
  // `access`: FI_SEND or FI_RECV; `key`: the requested key (providers without FI_MR_PROV_KEY).
  virtual Result<std::unique_ptr<RailMemory>> register_buffer(void* buf, size_t len,
                                                              uint64_t access, uint64_t key) = 0;
  // A new endpoint, enabled, with nothing posted yet. `rail` only names it in errors.
  virtual Result<std::unique_ptr<RailEndpoint>> open_endpoint(int rail) = 0;
};

// The libfabric port over `domain`, whose endpoints are made from `info`. Both are borrowed:
// they must outlive the port and every endpoint it opened.
std::unique_ptr<RailPort> make_libfabric_port(fid_domain* domain, fi_info* info);

}  // namespace cleave::transfer
