// Coalescing of adjacent writes and slicing of large ones.
#include <algorithm>

#include "cleave/transfer/transfer_engine.h"

namespace cleave::transfer {

std::vector<PlannedSlice> plan_slices(const std::vector<WriteOp>& writes, uint64_t slice_bytes) {
  if (slice_bytes == 0) slice_bytes = 1;
  // Coalesce: a write that continues the previous one on both sides joins it.
  std::vector<PlannedSlice> runs;
  runs.reserve(writes.size());
  for (size_t i = 0; i < writes.size(); ++i) {
    const WriteOp& w = writes[i];
    if (!runs.empty()) {
      PlannedSlice& prev = runs.back();
      const WriteOp& pw = writes[prev.remote_index];
      if (prev.local_region == w.local_region && pw.remote.engine_id == w.remote.engine_id &&
          pw.remote.region_id == w.remote.region_id &&
          prev.local_offset + prev.len == w.local_offset &&
          prev.remote_offset + prev.len == w.remote_offset) {
        prev.len += w.len;
        continue;
      }
    }
    runs.push_back({w.local_region, w.local_offset, i, w.remote_offset, w.len});
  }
  std::vector<PlannedSlice> slices;
  slices.reserve(runs.size());
  for (const PlannedSlice& r : runs) {
    for (uint64_t done = 0; done < r.len; done += slice_bytes) {
      uint64_t n = std::min(slice_bytes, r.len - done);
      slices.push_back({r.local_region, r.local_offset + done, r.remote_index,
                        r.remote_offset + done, n});
    }
  }
  return slices;
}

}  // namespace cleave::transfer
