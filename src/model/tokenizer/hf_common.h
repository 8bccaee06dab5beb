// Internal: names shared by the tokenizer.json reader and writer.
#pragma once

namespace cleave::tok {

// Extra tokenizer_config.json keys written by cleave (ignored by other readers).
inline constexpr const char* kConfigSpmScores = "cleave_spm_scores";
inline constexpr const char* kConfigEotIds = "cleave_eot_token_ids";
inline constexpr const char* kSpmSpace = "\xE2\x96\x81";  // U+2581

}  // namespace cleave::tok
