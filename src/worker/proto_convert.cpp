#include "cleave/worker/proto_convert.h"

#include "fmt/format.h"

namespace cleave {

void to_proto(const KvDestination& d, v1::KvDestination* out) {
  out->set_request_id(d.request_id);
  out->set_worker_id(d.worker_id);
  out->set_transfer_address(d.transfer_address);
  out->set_region(d.region.encode());
  to_proto(d.layout, out->mutable_layout());
  out->set_model_fingerprint(d.model_fingerprint);
  out->clear_block_ids();
  out->mutable_block_ids()->Reserve(static_cast<int>(d.blocks.size()));
  for (BlockId b : d.blocks) out->add_block_ids(b);
  out->set_notice_tag(d.notice_tag);
  out->set_lease_ms(d.lease.count());
}

Result<KvDestination> from_proto(const v1::KvDestination& d) {
  KvDestination out;
  out.request_id = d.request_id();
  out.worker_id = d.worker_id();
  out.transfer_address = d.transfer_address();
  auto region = transfer::RemoteDescriptor::decode(d.region());
  if (!region.ok()) {
    return InvalidArgument(
        fmt::format("KV destination: bad region descriptor: {}", region.status().message()));
  }
  out.region = std::move(*region);
  CLEAVE_ASSIGN_OR_RETURN(out.layout, from_proto(d.layout()));
  out.model_fingerprint = d.model_fingerprint();
  out.blocks.assign(d.block_ids().begin(), d.block_ids().end());
  for (size_t i = 0; i < out.blocks.size(); ++i) {
    if (out.blocks[i] < 0 || out.blocks[i] >= out.layout.num_blocks) {
      return InvalidArgument(fmt::format(
          "KV destination: block id {} (index {}) is outside the destination's pool of {} blocks",
          out.blocks[i], i, out.layout.num_blocks));
    }
  }
  out.notice_tag = d.notice_tag();
  if (d.lease_ms() < 0) {
    return InvalidArgument(fmt::format("KV destination: negative lease_ms {}", d.lease_ms()));
  }
  out.lease = std::chrono::milliseconds(d.lease_ms());
  return out;
}

void to_proto(const EngineEvent& ev, v1::TokenEvent* out) {
  out->set_request_id(ev.id);
  out->set_has_token(ev.has_token);
  out->set_token(ev.has_token ? ev.token : 0);
  out->set_text(ev.text);
  if (ev.queue_seconds >= 0) out->set_queue_seconds(ev.queue_seconds);
  out->set_logprob(ev.sample.logprob);
  out->clear_top_logprobs();
  for (const TokenLogprob& t : ev.sample.top) {
    v1::TopLogprob* tp = out->add_top_logprobs();
    tp->set_token(t.token);
    tp->set_logprob(t.logprob);
  }
  out->clear_prompt_logprobs();
  for (const SampleResult& p : ev.prompt_logprobs) {
    v1::PromptLogprob* pl = out->add_prompt_logprobs();
    pl->set_token(p.token);
    pl->set_logprob(p.logprob);
    for (const TokenLogprob& t : p.top) {
      v1::TopLogprob* tp = pl->add_top_logprobs();
      tp->set_token(t.token);
      tp->set_logprob(t.logprob);
    }
  }
  out->set_finished(ev.finished);
  if (ev.finished) {
    out->set_finish_reason(std::string(finish_reason_name(ev.finish_reason)));
    out->set_stop_string(ev.stop_string);
    v1::Usage* u = out->mutable_usage();
    u->set_prompt_tokens(ev.prompt_tokens);
    u->set_completion_tokens(ev.generated_tokens);
    u->set_cached_prompt_tokens(ev.cached_prompt_tokens);
  } else {
    out->clear_finish_reason();
    out->clear_stop_string();
    out->clear_usage();
  }
}

}  // namespace cleave
