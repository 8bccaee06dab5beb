#include <cstring>

#include "loaders.h"

namespace cleave::detail {

std::vector<std::byte> permute_rope_rows(std::span<const std::byte> src, int64_t rows,
                                         uint64_t row_bytes, int64_t n_heads, bool inverse) {
  std::vector<std::byte> out(src.size());
  const int64_t hd = rows / n_heads;
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < n_heads; ++h) {
    for (int64_t i = 0; i < half; ++i) {
      for (int64_t j = 0; j < 2; ++j) {
        const int64_t hf_row = h * hd + j * half + i;  // rotate-half layout
        const int64_t gg_row = h * hd + 2 * i + j;     // interleaved layout
        const int64_t from = inverse ? gg_row : hf_row;
        const int64_t to = inverse ? hf_row : gg_row;
        std::memcpy(out.data() + static_cast<uint64_t>(to) * row_bytes,
                    src.data() + static_cast<uint64_t>(from) * row_bytes, row_bytes);
      }
    }
  }
  return out;
}

}  // namespace cleave::detail
