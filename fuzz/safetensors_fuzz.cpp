// libFuzzer target: SafetensorsFile::parse over arbitrary bytes must return a Status, never crash,
// leak or allocate without bound. Seeds: build/fuzz/make_fuzz_seeds (see fuzz/README.md).
#include <cstddef>
#include <cstdint>
#include <span>

#include "cleave/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto r = cleave::SafetensorsFile::parse(std::span(reinterpret_cast<const std::byte*>(data), size));
  if (r.ok()) {
    uint8_t sink = 0;
    for (const auto& t : r->tensors())
      if (t.nbytes) sink ^= static_cast<uint8_t>(t.data[0]) ^ static_cast<uint8_t>(t.data[t.nbytes - 1]);
    asm volatile("" : : "r"(sink));  // keep the reads
  }
  return 0;
}
