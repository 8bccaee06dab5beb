#include "cleave/transfer/transfer_settings.h"

namespace cleave {

void register_transfer_settings(TransferSettings& t, SettingsRegistry& r) {
  r.add_string("transfer.provider", &t.provider,
               "libfabric provider: auto (efa, verbs;ofi_rxm, shm on one host, tcp;ofi_rxm) or a "
               "name as libfabric spells it (tcp;ofi_rxm, shm, efa, ...).",
               "--transfer-provider");
  r.add_string("transfer.node", &t.node,
               "Address given to fi_getinfo; empty lets the provider choose.");
  r.add_int("transfer.rails", &t.rails,
            "Endpoints driven in parallel (over NICs/domains when there are several).", 1, 64,
            "--transfer-rails");
  r.add_int("transfer.slice_bytes", &t.slice_bytes,
            "Large writes are cut into slices of at most this many bytes.", 4096, 1ll << 30);
  r.add_int("transfer.max_inflight_per_rail", &t.max_inflight_per_rail,
            "Most writes in flight per rail; 0 = the provider's TX queue depth.", 0, 1 << 20);
  r.add_int("transfer.completion_timeout_ms", &t.completion_timeout_ms,
            "A write with no completion for this long fails and marks its peer unreachable.", 1,
            3600000);
  r.add_bool("transfer.delivery_complete", &t.delivery_complete,
             "Post writes with FI_DELIVERY_COMPLETE where the provider accepts it.");
  r.add_bool("transfer.hmem", &t.hmem,
             "Ask for FI_HMEM (GPU memory registration) when built with CUDA; costs shm its "
             "single-copy (CMA) path, so only for KV in GPU memory.");
  r.add_int("transfer.idle_poll_us", &t.idle_poll_us,
            "Microseconds a rail, or a thread waiting for a transfer, keeps polling after its "
            "last activity before it naps (shm: targets complete incoming writes only while "
            "polling).", 0, 10000000);
}

}  // namespace cleave
