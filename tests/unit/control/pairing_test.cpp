// check_pairing: roles, the model fingerprint and KV layout (pairing_mismatch), the transfer
// provider, and unreadable layouts.
#include <gtest/gtest.h>

#include <string>

#include "cleave/control/proto_convert.h"
#include "cleave/control/worker_client.h"

namespace cleave {
namespace {

KvLayout layout() {
  KvLayout l;
  l.block_size = 16;
  l.n_layers = 2;
  l.n_kv_heads = 2;
  l.head_dim = 8;
  l.num_blocks = 64;
  return l;
}

v1::WorkerInfo info(const std::string& id, const std::string& role) {
  v1::WorkerInfo w;
  w.set_worker_id(id);
  w.set_role(role);
  w.set_model_fingerprint("fp1");
  w.set_transfer_provider("tcp");
  to_proto(layout(), w.mutable_kv_layout());
  return w;
}

bool contains(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

TEST(Pairing, CompatibleWorkersPair) {
  EXPECT_TRUE(check_pairing(info("p", "prefill"), info("d", "decode")).ok());
  EXPECT_TRUE(check_pairing(info("u1", "unified"), info("u2", "unified")).ok());
  v1::WorkerInfo d = info("d", "decode");
  d.mutable_kv_layout()->set_num_blocks(7);  // pools may differ in size
  EXPECT_TRUE(check_pairing(info("p", "prefill"), d).ok());
}

TEST(Pairing, WrongRolesAreNamed) {
  const Status s = check_pairing(info("d1", "decode"), info("p1", "prefill"));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(s, "worker 'd1' has role 'decode', not prefill or unified")) << s.message();
  EXPECT_TRUE(contains(s, "worker 'p1' has role 'prefill', not decode or unified")) << s.message();
}

TEST(Pairing, LayoutFingerprintAndProviderDifferencesAreListed) {
  v1::WorkerInfo d = info("d", "decode");
  d.set_model_fingerprint("fp2");
  d.mutable_kv_layout()->set_block_size(32);
  d.set_transfer_provider("shm");
  const Status s = check_pairing(info("p", "prefill"), d);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(s, "prefill worker 'p' cannot write its KV into decode worker 'd'"))
      << s.message();
  EXPECT_TRUE(contains(s, "model fingerprint differs (prefill fp1, decode fp2)")) << s.message();
  EXPECT_TRUE(contains(s, "block_size differs (prefill 16, decode 32)")) << s.message();
  EXPECT_TRUE(contains(s, "transfer provider differs (prefill tcp, decode shm)")) << s.message();
}

TEST(Pairing, UnreadableLayoutIsInvalidArgument) {
  v1::WorkerInfo d = info("d", "decode");
  d.mutable_kv_layout()->set_dtype("int3");
  const Status s = check_pairing(info("p", "prefill"), d);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(s, "decode worker 'd': KV layout")) << s.message();
}

}  // namespace
}  // namespace cleave
