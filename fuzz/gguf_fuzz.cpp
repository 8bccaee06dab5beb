// libFuzzer target: GgufFile::parse over arbitrary bytes must return a Status, never crash, leak
// or allocate without bound; and every tensor it accepts must decode (decode_row, every block
// format) without reading outside its bytes. Seeds: build/fuzz/make_fuzz_seeds (fuzz/README.md).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cleave/model/gguf.h"
#include "cleave/model/quants.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto r = cleave::GgufFile::parse(std::span(reinterpret_cast<const std::byte*>(data), size));
  if (r.ok()) {
    // Touch what a loader would: every tensor's bytes must lie inside the input.
    uint8_t sink = 0;
    for (const auto& t : r->tensors())
      if (t.nbytes) sink ^= static_cast<uint8_t>(t.data[0]) ^ static_cast<uint8_t>(t.data[t.nbytes - 1]);
    asm volatile("" : : "r"(sink));  // keep the reads
    // Decode the first row of each tensor (at most 4096 elements): the block layouts must stay
    // inside the row's bytes whatever the scales and levels hold.
    std::vector<float> row;
    for (const auto& t : r->tensors()) {
      const int64_t cols = t.shape.empty() ? 0 : t.shape.back();
      if (cols <= 0 || cols > 4096) continue;
      const auto bytes = cleave::dtype_row_bytes(t.dtype, static_cast<uint64_t>(cols));
      if (!bytes || *bytes > t.nbytes) continue;
      row.resize(static_cast<size_t>(cols));
      cleave::decode_row(t.dtype, t.data, cols, row.data());
    }
    (void)r->get_string_or("general.architecture", "");
  }
  return 0;
}
