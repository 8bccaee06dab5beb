// RailPort and RailEndpoint over libfabric: one domain, FI_EP_RDM endpoints each with its own
// CQ and AV.
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include "cleave/common/log.h"
#include "fmt/format.h"
#include "rail_port.h"
#include "transfer_internal.h"

namespace cleave::transfer {

namespace {

class LibfabricEndpoint final : public RailEndpoint {
 public:
  ~LibfabricEndpoint() override {
    if (ep_) fi_close(&ep_->fid);
    if (remote_writes_) fi_close(&remote_writes_->fid);
    if (av_) fi_close(&av_->fid);
    if (cq_) fi_close(&cq_->fid);
  }

  Status open(fid_domain* domain, fi_info* info, int rail);

  const std::string& name() const override { return name_; }
  bool waitable() const override { return waitable_; }

  int av_insert(const std::string& peer_name, fi_addr_t* addr) override {
    return fi_av_insert(av_, peer_name.data(), 1, addr, 0, nullptr);
  }

  ssize_t write(void* local, size_t len, void* local_desc, fi_addr_t dest, uint64_t remote_addr,
                uint64_t key, uint64_t flags, void* context) override {
    iovec iov{local, len};
    fi_rma_iov rma{remote_addr, len, key};
    fi_msg_rma msg{};
    msg.msg_iov = &iov;
    msg.desc = &local_desc;
    msg.iov_count = 1;
    msg.addr = dest;
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    msg.context = context;
    return fi_writemsg(ep_, &msg, flags);
  }

  ssize_t send(const void* buf, size_t len, void* desc, fi_addr_t dest, uint64_t flags,
               void* context) override {
    iovec iov{const_cast<void*>(buf), len};
    fi_msg msg{};
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = dest;
    msg.context = context;
    return fi_sendmsg(ep_, &msg, flags);
  }

  ssize_t recv(void* buf, size_t len, void* desc, void* context) override {
    return fi_recv(ep_, buf, len, desc, FI_ADDR_UNSPEC, context);
  }

  ssize_t read(fi_cq_data_entry* entries, size_t count) override {
    return fi_cq_read(cq_, entries, count);
  }

  ssize_t read_error(fi_cq_err_entry* entry) override { return fi_cq_readerr(cq_, entry, 0); }

  std::string provider_error(const fi_cq_err_entry& entry) override {
    char buf[256];
    const char* text = fi_cq_strerror(cq_, entry.prov_errno, entry.err_data, buf, sizeof(buf));
    return text ? text : "-";
  }

  ssize_t wait(fi_cq_data_entry* entries, size_t count, int timeout_ms) override {
    return fi_cq_sread(cq_, entries, count, nullptr, timeout_ms);
  }

  void signal() override { fi_cq_signal(cq_); }

  uint64_t remote_writes() override { return remote_writes_ ? fi_cntr_read(remote_writes_) : 0; }
  bool counts_remote_writes() const override { return remote_writes_ != nullptr; }

 private:
  fid_ep* ep_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_cntr* remote_writes_ = nullptr;
  bool waitable_ = false;
  std::string name_;
};

Status LibfabricEndpoint::open(fid_domain* domain, fi_info* info, int rail) {
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.wait_obj = FI_WAIT_UNSPEC;
  cq_attr.size = 0;
  int rc = fi_cq_open(domain, &cq_attr, &cq_, nullptr);
  if (rc == 0) {
    // Only a wait object backed by a file descriptor sleeps until the provider has work (shm's
    // yield-based waits would neither sleep nor progress); otherwise poll the CQ.
    int fd = -1;
    waitable_ = fi_control(&cq_->fid, FI_GETWAIT, &fd) == 0;
    if (!waitable_) {
      fi_close(&cq_->fid);
      cq_ = nullptr;
    }
  }
  if (!waitable_) {
    cq_attr.wait_obj = FI_WAIT_NONE;
    rc = fi_cq_open(domain, &cq_attr, &cq_, nullptr);
    if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_cq_open", rail), rc));
  }
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  rc = fi_av_open(domain, &av_attr, &av_, nullptr);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_av_open", rail), rc));
  rc = fi_endpoint(domain, info, &ep_, nullptr);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_endpoint", rail), rc));
  rc = fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_ep_bind(cq)", rail), rc));
  rc = fi_ep_bind(ep_, &av_->fid, 0);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_ep_bind(av)", rail), rc));
  if (info->caps & FI_RMA_EVENT) {
    fi_cntr_attr cattr{};
    cattr.events = FI_CNTR_EVENTS_COMP;
    cattr.wait_obj = FI_WAIT_NONE;
    rc = fi_cntr_open(domain, &cattr, &remote_writes_, nullptr);
    if (rc == 0) rc = fi_ep_bind(ep_, &remote_writes_->fid, FI_REMOTE_WRITE);
    if (rc) {
      log::warn("rail {}: no remote-write counter ({}); an idle target naps between polls",
                rail, fi_strerror(-rc));
      if (remote_writes_) fi_close(&remote_writes_->fid);
      remote_writes_ = nullptr;
    }
  }
  rc = fi_enable(ep_);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_enable", rail), rc));

  char name[512];
  size_t len = sizeof(name);
  rc = fi_getname(&ep_->fid, name, &len);
  if (rc) return Internal(fabric_error(fmt::format("rail {}: fi_getname", rail), rc));
  name_.assign(name, len);
  return Status::Ok();
}

class LibfabricMemory final : public RailMemory {
 public:
  explicit LibfabricMemory(fid_mr* mr) : mr_(mr) {}
  ~LibfabricMemory() override { fi_close(&mr_->fid); }
  void* desc() const override { return fi_mr_desc(mr_); }

 private:
  fid_mr* mr_;
};

class LibfabricPort final : public RailPort {
 public:
  LibfabricPort(fid_domain* domain, fi_info* info) : domain_(domain), info_(info) {}

  const char* provider_name() const override { return info_->fabric_attr->prov_name; }
  size_t tx_depth() const override { return info_->tx_attr->size; }
  uint64_t max_msg_size() const override { return info_->ep_attr->max_msg_size; }

  Result<std::unique_ptr<RailMemory>> register_buffer(void* buf, size_t len, uint64_t access,
                                                      uint64_t key) override {
    fid_mr* mr = nullptr;
    int rc = fi_mr_reg(domain_, buf, len, access, 0, key, 0, &mr, nullptr);
    if (rc) {
      return Internal(fabric_error(
          fmt::format("fi_mr_reg(notice {})", access == FI_RECV ? "recv" : "send"), rc));
    }
    return std::unique_ptr<RailMemory>(std::make_unique<LibfabricMemory>(mr));
  }

  Result<std::unique_ptr<RailEndpoint>> open_endpoint(int rail) override {
    auto ep = std::make_unique<LibfabricEndpoint>();
    CLEAVE_RETURN_IF_ERROR(ep->open(domain_, info_, rail));
    return std::unique_ptr<RailEndpoint>(std::move(ep));
  }

 private:
  fid_domain* domain_;
  fi_info* info_;
};

}  // namespace

std::unique_ptr<RailPort> make_libfabric_port(fid_domain* domain, fi_info* info) {
  return std::make_unique<LibfabricPort>(domain, info);
}

}  // namespace cleave::transfer
