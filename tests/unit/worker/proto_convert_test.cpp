#include "cleave/worker/proto_convert.h"

#include <gtest/gtest.h>

namespace cleave {
namespace {

SamplingParams odd_params() {
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_k = 40;
  p.top_p = 0.9f;
  p.min_p = 0.05f;
  p.seed = 0xfedcba9876543210ull;
  p.repetition_penalty = 1.1f;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = -0.25f;
  p.logprobs = 3;
  p.stop = {"\n\n", "END"};
  p.stop_token_ids = {7, 11};
  p.ignore_eos = true;
  p.max_tokens = 77;
  p.min_tokens = 5;
  return p;
}

TEST(ProtoConvert, SamplingParamsRoundTrip) {
  const SamplingParams p = odd_params();
  v1::SamplingParams msg;
  to_proto(p, &msg);
  const SamplingParams q = from_proto(msg);
  EXPECT_EQ(q.temperature, p.temperature);
  EXPECT_EQ(q.top_k, p.top_k);
  EXPECT_EQ(q.top_p, p.top_p);
  EXPECT_EQ(q.min_p, p.min_p);
  EXPECT_EQ(q.seed, p.seed);
  EXPECT_EQ(q.repetition_penalty, p.repetition_penalty);
  EXPECT_EQ(q.presence_penalty, p.presence_penalty);
  EXPECT_EQ(q.frequency_penalty, p.frequency_penalty);
  EXPECT_EQ(q.logprobs, p.logprobs);
  EXPECT_EQ(q.stop, p.stop);
  EXPECT_EQ(q.stop_token_ids, p.stop_token_ids);
  EXPECT_EQ(q.ignore_eos, p.ignore_eos);
  EXPECT_EQ(q.max_tokens, p.max_tokens);
  EXPECT_EQ(q.min_tokens, p.min_tokens);
}

TEST(ProtoConvert, DefaultsAreWrittenExplicitly) {
  // proto3 zero would mean "top_p 0" and "logprobs 0": the defaults must travel as values.
  v1::SamplingParams msg;
  to_proto(SamplingParams{}, &msg);
  EXPECT_EQ(msg.top_p(), 1.0f);
  EXPECT_EQ(msg.logprobs(), -1);
  EXPECT_EQ(msg.repetition_penalty(), 1.0f);
  EXPECT_EQ(msg.temperature(), 1.0f);
  EXPECT_EQ(msg.max_tokens(), 16);
}

KvLayout layout() {
  KvLayout l;
  l.block_size = 32;
  l.n_layers = 3;
  l.n_kv_heads = 2;
  l.head_dim = 16;
  l.num_blocks = 100;
  return l;
}

TEST(ProtoConvert, KvLayoutRoundTripAndValidation) {
  v1::KvLayoutInfo msg;
  to_proto(layout(), &msg);
  EXPECT_EQ(msg.dtype(), "f32");
  EXPECT_EQ(msg.version(), KvLayout::kVersion);
  auto back = from_proto(msg);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->block_size, 32);
  EXPECT_EQ(back->n_layers, 3);
  EXPECT_EQ(back->n_kv_heads, 2);
  EXPECT_EQ(back->head_dim, 16);
  EXPECT_EQ(back->num_blocks, 100);
  EXPECT_EQ(back->dtype, DType::kF32);

  v1::KvLayoutInfo bad = msg;
  bad.set_dtype("int3");
  auto r = from_proto(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("int3"), std::string::npos);

  bad = msg;
  bad.set_block_size(0);
  r = from_proto(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);

  r = from_proto(v1::KvLayoutInfo{});  // all zero: not a layout
  EXPECT_FALSE(r.ok());
}

KvDestination destination() {
  KvDestination d;
  d.request_id = 42;
  d.worker_id = "decode-1";
  d.transfer_address = std::string("\x01\x00\xff\x7f", 4);
  d.region.engine_id = 9;
  d.region.region_id = 3;
  d.region.addr = 0x7f0000001000;
  d.region.len = layout().total_bytes();
  d.region.virt_addr = true;
  d.region.keys = {123, 456};
  d.layout = layout();
  d.model_fingerprint = "abc123";
  d.blocks = {4, 5, 6, 99};
  d.notice_tag = 0x1234567890abcdefull;
  d.lease = std::chrono::milliseconds(2500);
  return d;
}

TEST(ProtoConvert, KvDestinationRoundTrip) {
  const KvDestination d = destination();
  v1::KvDestination msg;
  to_proto(d, &msg);
  auto back = from_proto(msg);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->request_id, d.request_id);
  EXPECT_EQ(back->worker_id, d.worker_id);
  EXPECT_EQ(back->transfer_address, d.transfer_address);
  EXPECT_EQ(back->region, d.region);
  EXPECT_EQ(back->layout.block_size, d.layout.block_size);
  EXPECT_EQ(back->layout.num_blocks, d.layout.num_blocks);
  EXPECT_EQ(back->model_fingerprint, d.model_fingerprint);
  EXPECT_EQ(back->blocks, d.blocks);
  EXPECT_EQ(back->notice_tag, d.notice_tag);
  EXPECT_EQ(back->lease, d.lease);
}

TEST(ProtoConvert, KvDestinationRefusesBadInput) {
  v1::KvDestination msg;
  to_proto(destination(), &msg);

  v1::KvDestination bad = msg;
  bad.set_region("garbage");
  auto r = from_proto(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("region"), std::string::npos);

  bad = msg;
  bad.mutable_layout()->set_head_dim(0);
  r = from_proto(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);

  bad = msg;
  bad.add_block_ids(100);  // the pool has 100 blocks: ids 0..99
  r = from_proto(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("100"), std::string::npos);
}

TEST(ProtoConvert, TokenEvents) {
  EngineEvent ev;
  ev.id = 5;
  ev.has_token = true;
  ev.token = 77;
  ev.text = " once";
  ev.sample.token = 77;
  ev.sample.logprob = -0.5f;
  ev.sample.top = {{77, -0.5f}, {12, -1.25f}};
  v1::TokenEvent msg;
  to_proto(ev, &msg);
  EXPECT_EQ(msg.request_id(), 5u);
  EXPECT_TRUE(msg.has_token());
  EXPECT_EQ(msg.token(), 77);
  EXPECT_EQ(msg.text(), " once");
  EXPECT_EQ(msg.logprob(), -0.5f);
  ASSERT_EQ(msg.top_logprobs_size(), 2);
  EXPECT_EQ(msg.top_logprobs(1).token(), 12);
  EXPECT_EQ(msg.top_logprobs(1).logprob(), -1.25f);
  EXPECT_FALSE(msg.finished());
  EXPECT_FALSE(msg.has_usage());

  ev.finished = true;
  ev.finish_reason = FinishReason::kStop;
  ev.stop_string = "END";
  ev.prompt_tokens = 10;
  ev.generated_tokens = 4;
  ev.cached_prompt_tokens = 8;
  ev.sample.top.clear();
  to_proto(ev, &msg);  // reusing the message: nothing stale stays
  EXPECT_TRUE(msg.finished());
  EXPECT_EQ(msg.finish_reason(), "stop");
  EXPECT_EQ(msg.stop_string(), "END");
  EXPECT_EQ(msg.top_logprobs_size(), 0);
  ASSERT_TRUE(msg.has_usage());
  EXPECT_EQ(msg.usage().prompt_tokens(), 10);
  EXPECT_EQ(msg.usage().completion_tokens(), 4);
  EXPECT_EQ(msg.usage().cached_prompt_tokens(), 8);

  ev.finish_reason = FinishReason::kLength;
  ev.has_token = false;
  to_proto(ev, &msg);
  EXPECT_EQ(msg.finish_reason(), "length");
  EXPECT_FALSE(msg.has_token());
}

TEST(ProtoConvert, StatusMapsBothWays) {
  const std::pair<StatusCode, grpc::StatusCode> pairs[] = {
      {StatusCode::kCancelled, grpc::StatusCode::CANCELLED},
      {StatusCode::kInvalidArgument, grpc::StatusCode::INVALID_ARGUMENT},
      {StatusCode::kDeadlineExceeded, grpc::StatusCode::DEADLINE_EXCEEDED},
      {StatusCode::kNotFound, grpc::StatusCode::NOT_FOUND},
      {StatusCode::kAlreadyExists, grpc::StatusCode::ALREADY_EXISTS},
      {StatusCode::kPermissionDenied, grpc::StatusCode::PERMISSION_DENIED},
      {StatusCode::kResourceExhausted, grpc::StatusCode::RESOURCE_EXHAUSTED},
      {StatusCode::kFailedPrecondition, grpc::StatusCode::FAILED_PRECONDITION},
      {StatusCode::kAborted, grpc::StatusCode::ABORTED},
      {StatusCode::kOutOfRange, grpc::StatusCode::OUT_OF_RANGE},
      {StatusCode::kUnimplemented, grpc::StatusCode::UNIMPLEMENTED},
      {StatusCode::kInternal, grpc::StatusCode::INTERNAL},
      {StatusCode::kUnavailable, grpc::StatusCode::UNAVAILABLE},
      {StatusCode::kDataLoss, grpc::StatusCode::DATA_LOSS},
      {StatusCode::kUnauthenticated, grpc::StatusCode::UNAUTHENTICATED},
  };
  for (const auto& [ours, theirs] : pairs) {
    const Status s(ours, "what went wrong");
    const grpc::Status g = to_grpc(s);
    EXPECT_EQ(g.error_code(), theirs) << s.to_string();
    EXPECT_EQ(g.error_message(), "what went wrong");
    const Status back = from_grpc(g);
    EXPECT_EQ(back.code(), ours);
    EXPECT_EQ(back.message(), "what went wrong");
  }
  EXPECT_TRUE(to_grpc(Status::Ok()).ok());
  EXPECT_TRUE(from_grpc(grpc::Status::OK).ok());
  const Status unknown = from_grpc(grpc::Status(grpc::StatusCode::UNKNOWN, "boom"));
  EXPECT_EQ(unknown.code(), StatusCode::kInternal);
  EXPECT_NE(unknown.message().find("boom"), std::string::npos);
}

}  // namespace
}  // namespace cleave
