#include "raw_fabric_loop.h"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <chrono>
#include <cstring>

#include "fmt/format.h"

namespace cleave::transfer {
namespace {

using Clock = std::chrono::steady_clock;

// "what: fi_strerror (-code)".
std::string fabric_error(std::string_view what, int rc) {
  const int code = rc < 0 ? -rc : rc;
  return fmt::format("{}: {} (-{})", what, fi_strerror(code), code);
}

}  // namespace

RawFabricEndpoint::~RawFabricEndpoint() {
  if (ep_) fi_close(&ep_->fid);
  if (mr_) fi_close(&mr_->fid);
  if (av_) fi_close(&av_->fid);
  if (cq_) fi_close(&cq_->fid);
  if (domain_) fi_close(&domain_->fid);
  if (fabric_) fi_close(&fabric_->fid);
  if (info_) fi_freeinfo(info_);
}

Status RawFabricEndpoint::open(const std::string& provider, void* buf, uint64_t len) {
  fi_info* hints = fi_allocinfo();
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_RMA;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  hints->fabric_attr->prov_name = strdup(provider.c_str());
  bool shm = provider.rfind("shm", 0) == 0;
  int rc = fi_getinfo(fi_version(), shm ? nullptr : "127.0.0.1", nullptr, shm ? 0 : FI_SOURCE,
                      hints, &info_);
  fi_freeinfo(hints);
  if (rc) return Unavailable(fabric_error(fmt::format("raw: fi_getinfo({})", provider), rc));
  virt_addr_ = info_->domain_attr->mr_mode & FI_MR_VIRT_ADDR;
  prov_key_ = info_->domain_attr->mr_mode & FI_MR_PROV_KEY;
  if ((rc = fi_fabric(info_->fabric_attr, &fabric_, nullptr))) return Internal(fabric_error("raw: fi_fabric", rc));
  if ((rc = fi_domain(fabric_, info_, &domain_, nullptr))) return Internal(fabric_error("raw: fi_domain", rc));
  fi_cq_attr cqa{};
  cqa.format = FI_CQ_FORMAT_CONTEXT;
  if ((rc = fi_cq_open(domain_, &cqa, &cq_, nullptr))) return Internal(fabric_error("raw: fi_cq_open", rc));
  fi_av_attr ava{};
  ava.type = FI_AV_TABLE;
  if ((rc = fi_av_open(domain_, &ava, &av_, nullptr))) return Internal(fabric_error("raw: fi_av_open", rc));
  if ((rc = fi_endpoint(domain_, info_, &ep_, nullptr))) return Internal(fabric_error("raw: fi_endpoint", rc));
  fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV);
  fi_ep_bind(ep_, &av_->fid, 0);
  if ((rc = fi_enable(ep_))) return Internal(fabric_error("raw: fi_enable", rc));
  buf_ = buf;
  rc = fi_mr_reg(domain_, buf, len, FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE, 0,
                 0x5151, 0, &mr_, nullptr);
  if (rc) return Internal(fabric_error("raw: fi_mr_reg", rc));
  char name[512];
  size_t nlen = sizeof(name);
  if ((rc = fi_getname(&ep_->fid, name, &nlen))) return Internal(fabric_error("raw: fi_getname", rc));
  name_.assign(name, nlen);
  return Status::Ok();
}

uint64_t RawFabricEndpoint::key() const { return prov_key_ ? fi_mr_key(mr_) : 0x5151; }

Status RawFabricEndpoint::connect(const std::string& peer_name) {
  fi_addr_t a;
  if (fi_av_insert(av_, peer_name.data(), 1, &a, 0, nullptr) != 1) {
    return Unavailable("raw: fi_av_insert failed");
  }
  peer_ = a;
  return Status::Ok();
}

Result<double> RawFabricEndpoint::write_loop(uint64_t size, int64_t iters, int64_t window,
                                             uint64_t remote_addr, uint64_t key,
                                             bool delivery_complete) {
  int64_t posted = 0, done = 0;
  fi_context2 ctx[1];
  void* desc = fi_mr_desc(mr_);
  fi_cq_entry entries[64];
  auto start = Clock::now();
  while (done < iters) {
    while (posted < iters && posted - done < window) {
      iovec iov{buf_, size};
      fi_rma_iov rma{remote_addr, size, key};
      fi_msg_rma msg{};
      msg.msg_iov = &iov;
      msg.desc = &desc;
      msg.iov_count = 1;
      msg.addr = peer_;
      msg.rma_iov = &rma;
      msg.rma_iov_count = 1;
      msg.context = ctx;
      ssize_t rc = fi_writemsg(ep_, &msg,
                               FI_COMPLETION | (delivery_complete ? FI_DELIVERY_COMPLETE : 0));
      if (rc == -FI_EAGAIN) break;
      if (rc) return Internal(fabric_error("raw: fi_write", static_cast<int>(rc)));
      ++posted;
    }
    ssize_t n = fi_cq_read(cq_, entries, 64);
    if (n > 0) done += n;
    else if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      fi_cq_readerr(cq_, &err, 0);
      return Internal(fmt::format("raw: write completion error: {}", fi_strerror(err.err)));
    }
    if (Clock::now() - start > std::chrono::seconds(60)) return DeadlineExceeded("raw loop: 60 s");
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void RawFabricEndpoint::serve(const std::atomic<bool>& stop) {
  fi_cq_entry entries[16];
  while (!stop.load(std::memory_order_relaxed)) (void)fi_cq_read(cq_, entries, 16);
}

}  // namespace cleave::transfer
