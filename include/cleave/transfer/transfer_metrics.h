// Counters of one transfer engine, read by the metrics endpoint. Thread-safe snapshot.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace cleave::transfer {

enum class TransferErrorKind : uint8_t {
  kInvalidDescriptor = 0,  // refused before posting: range, key, overflow, unknown region
  kPeerUnavailable,        // submitted to a peer already marked unreachable
  kTimeout,                // no completion within completion_timeout_ms
  kCompletionError,        // the provider reported an error completion (fi_cq_readerr)
  kPostError,              // fi_write / fi_send failed with something other than -FI_EAGAIN
  kPastDeadline,           // not posted by the batch's post_by (the destination's lease ended)
  kCount,
};
const char* error_kind_name(TransferErrorKind kind);

struct TransferMetricsSnapshot {
  // Latency of whole transfers (submit to completion) in microseconds. Bucket i counts
  // latencies < 2^i us (bucket 0: < 1 us); the last bucket also holds everything larger.
  static constexpr int kLatencyBuckets = 32;

  std::string provider;
  std::vector<uint64_t> rail_bytes;   // bytes written, per rail
  std::vector<uint64_t> rail_writes;  // completed write operations, per rail
  // Times each rail's endpoint was replaced because a peer stopped completing operations.
  std::vector<uint64_t> rail_reopens;
  struct PeerCounters {
    uint64_t bytes = 0;
    uint64_t transfers = 0;  // completed batches
    uint64_t failures = 0;
  };
  std::map<uint64_t, PeerCounters> peers;  // by peer engine id
  std::array<uint64_t, kLatencyBuckets> latency_us_buckets{};
  std::array<uint64_t, static_cast<size_t>(TransferErrorKind::kCount)> errors{};
  uint64_t notices_sent = 0;
  uint64_t notices_received = 0;
};

}  // namespace cleave::transfer
