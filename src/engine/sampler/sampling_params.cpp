// The stop-token rules (EOS, stop_token_ids, min_tokens). SamplingParams::validate is the
// request module's (src/request/sampling_params.cpp).
#include <algorithm>

#include "cleave/engine/sampler.h"

namespace cleave {
namespace {

bool contains(std::span<const int32_t> ids, int32_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

}  // namespace

std::vector<int32_t> tokens_to_suppress(const SamplingParams& params,
                                        std::span<const int32_t> eos_token_ids,
                                        int32_t n_generated) {
  std::vector<int32_t> ids;
  if (n_generated >= params.min_tokens) return ids;
  if (!params.ignore_eos) ids.assign(eos_token_ids.begin(), eos_token_ids.end());
  for (int32_t id : params.stop_token_ids) {
    if (!contains(ids, id)) ids.push_back(id);
  }
  return ids;
}

bool is_stop_token(int32_t token, const SamplingParams& params,
                   std::span<const int32_t> eos_token_ids, int32_t n_generated) {
  if (n_generated < params.min_tokens) return false;
  if (!params.ignore_eos && contains(eos_token_ids, token)) return true;
  return contains(params.stop_token_ids, token);
}

}  // namespace cleave
