#include "cleave/worker/worker_settings.h"

namespace cleave {

void register_worker_settings(WorkerSettings& w, SettingsRegistry& r) {
  r.add_enum("worker.role", &w.role, {"prefill", "decode", "unified"},
             "What a `cleave worker` serves: prefill, decode, or both in one process (unified).",
             "--role");
  r.add_string("worker.listen", &w.listen,
               "HOST:PORT the worker's gRPC service listens on; port 0 picks a free port.",
               "--listen");
  r.add_string("worker.id", &w.id,
               "Worker id in logs, metrics and the control plane; empty = ROLE-PID (e.g. decode-4242).", "--id");
  r.add_int("worker.lease_ms", &w.lease_ms,
            "Decode worker: how long reserved KV blocks wait for the prefill's KV before they "
            "are released (when Reserve names no lease).",
            1, 3600000);
  r.add_enum("worker.kv_fence", &w.kv_fence, {"auto", "revoke", "hold"},
             "Decode worker: how a late KV write is kept out of reused blocks. revoke = a memory "
             "key per reservation, revoked when it ends; hold = the pool's one key, and a released "
             "or expired reservation's blocks held until its lease deadline + "
             "transfer.completion_timeout_ms + 1 s; auto = revoke on tcp and shm, hold on efa and "
             "verbs (whose registration cache makes a revoked key live on).");
  r.add_int("worker.prefill_timeout_ms", &w.prefill_timeout_ms,
            "Prefill worker: longest a Prefill waits for its prompt's compute, queueing included.",
            1, 86400000);
  r.add_int("worker.drain_seconds", &w.drain_seconds,
            "On SIGTERM a worker stops taking requests (health NOT_SERVING) and lets running ones "
            "finish for at most this long before it exits; 0 = exit at once.",
            0, 86400);
  r.add_int("worker.metrics_port", &w.metrics_port,
            "HTTP port of the worker's GET /metrics (Prometheus text), on the worker.listen host; "
            "-1 = off, 0 picks a free port.",
            -1, 65535, "--metrics-port");
  r.add_string("worker.instance_type", &w.instance_type,
               "The node's instance type (node.kubernetes.io/instance-type): the worker applies "
               "profiles.<type> (else profiles.default); `@PATH` reads it from a file.",
               "--instance-type");
}

}  // namespace cleave
