// Typed configuration with one declaration per setting.
//
// Every setting is a field of a plain struct with its default in code. A SettingsRegistry binds
// each field to a dotted key ("engine.threads"), an environment variable ("CLEAVE_ENGINE_THREADS")
// and optionally a command-line flag, and applies sources in increasing precedence:
//   defaults (in code) < YAML file < environment (CLEAVE_*) < flags.
// The caller applies them in that order: load_yaml_file(), load_env(), then set() per flag.
// Unknown keys in a file are errors that name the key and the file, so typos never pass silently.
// The registry is also the source of the README's settings table (markdown_table()).
//
// The "file" may be a directory (a Kubernetes ConfigMap mounted as a volume): its *.yaml files
// in name order, then every other file, named after a setting key ("pools.prefill.replicas")
// and holding that setting's value. A setting given twice there, or a file that names no
// setting, is an error. Names starting with '.' are skipped.
//
// Profiles: the file's `profiles:` section maps a name (an instance type such as p5e.48xlarge,
// or `default`) to settings in the file's own nesting, with optional per-role subsections
// (`prefill:`, `decode:`, `unified:`, which win over the profile's other settings). A worker
// applies one of them (select_worker_profile) between the file and the environment:
//   defaults < file < the selected profile < environment < flags.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "cleave/common/status.h"

namespace YAML {
class Node;
}

namespace cleave {

class SettingsRegistry {
 public:
  struct Setting {
    std::string key;           // "engine.threads"
    std::string env;           // "CLEAVE_ENGINE_THREADS"
    std::string flag;          // "--threads", or empty when the setting has no flag
    std::string help;
    std::string type;          // "int", "float", "bool", "string", or "a|b|c" for enums
    std::string default_value; // rendered at registration time
    std::string source = "default";  // where the current value came from
    std::function<Status(std::string_view)> set;
    std::function<std::string()> get;
  };

  // Fields must outlive the registry. Ranges are inclusive.
  void add_int(std::string key, int64_t* field, std::string help, int64_t min, int64_t max,
               std::string flag = "");
  void add_float(std::string key, double* field, std::string help, double min, double max,
                 std::string flag = "");
  void add_bool(std::string key, bool* field, std::string help, std::string flag = "");
  void add_string(std::string key, std::string* field, std::string help, std::string flag = "");
  void add_enum(std::string key, std::string* field, std::vector<std::string> choices,
                std::string help, std::string flag = "");

  // Sets one setting from text; InvalidArgument names the key, the value and what is allowed.
  Status set(std::string_view key, std::string_view value, std::string_view source);
  // "key=value" (as given to --set).
  Status set_assignment(std::string_view assignment, std::string_view source);
  // A YAML file, or a directory as described above.
  Status load_yaml_file(const std::string& path);
  Status load_yaml_string(std::string_view yaml, std::string_view source_name);
  // Reads every registered setting's env variable through `getenv_fn` (default ::getenv).
  Status load_env(const std::function<const char*(const char*)>& getenv_fn = nullptr);

  // A profile of the file (keys and values checked when the file is read).
  struct Profile {
    std::string source;                                       // the file that defined it
    std::vector<std::pair<std::string, std::string>> common;  // every role
    std::map<std::string, std::vector<std::pair<std::string, std::string>>, std::less<>> by_role;
  };
  const std::map<std::string, Profile, std::less<>>& profiles() const { return profiles_; }
  // Applies profile `name` for a worker of `role` to every setting whose value comes from the
  // defaults or a file (env and flags keep theirs); the source reads "profile NAME (FILE)".
  // Returns the keys it set. NotFound when there is no such profile.
  Result<std::vector<std::string>> apply_profile(std::string_view name, std::string_view role);

  const std::vector<Setting>& settings() const { return settings_; }
  const Setting* find(std::string_view key) const;
  // The effective configuration as YAML, with each value's source as a comment.
  std::string to_yaml() const;
  // | Setting | Default | Env | Flag | Description | rows, for the README.
  std::string markdown_table() const;

 private:
  Setting& add(std::string key, std::string help, std::string type, std::string flag);
  Status load_directory(const std::string& dir);
  Status read_profiles(const YAML::Node& profiles, std::string_view source_name);
  std::vector<Setting> settings_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, Profile, std::less<>> profiles_;
};

// "engine.threads" -> "CLEAVE_ENGINE_THREADS".
std::string env_name_for_key(std::string_view key);

// ---- The cleave configuration (grows with each subsystem) ----

struct LogSettings {
  std::string level = "info";
};

struct ModelSettings {
  std::string path;  // GGUF file or HF directory; empty = the embedded default model
};

struct EngineSettings {
  int64_t threads = 0;      // compute threads; 0 = one per online CPU
  int64_t max_context = 0;  // 0 = the model's context length
  int64_t block_size = 16;                 // tokens per KV block
  int64_t kv_blocks = 0;                   // > 0: the KV pool's block count (wins over the budget)
  int64_t kv_cache_bytes = 256ll << 20;    // else the KV pool's memory budget
  std::string kv_dtype = "f32";            // K/V element type in the pool: f32 | f16 | bf16
  int64_t max_tokens_per_step = 256;       // token budget of one engine step (chunked prefill)
  int64_t max_num_seqs = 64;               // most sequences running at once
  bool prefix_caching = true;              // reuse cached full KV blocks across requests
};

// The libfabric transfer engine (src/transfer).
struct TransferSettings {
  // "auto" (efa, then verbs;ofi_rxm, then shm when every peer is on this host, then
  // tcp;ofi_rxm) or a provider as libfabric spells it: "tcp;ofi_rxm", "shm", "efa", ...
  std::string provider = "auto";
  // Node (address) passed to fi_getinfo; empty lets the provider choose. "127.0.0.1" pins
  // socket-based providers to loopback.
  std::string node;
  // Endpoints the engine drives in parallel. Spread over distinct domains (NICs) when the
  // provider offers several, else several endpoints on one domain.
  int64_t rails = 1;
  // Large writes are cut into slices of at most this many bytes, spread over the rails.
  int64_t slice_bytes = 1 << 20;
  // Most writes in flight per rail; 0 = the provider's TX queue depth.
  int64_t max_inflight_per_rail = 0;
  // A posted write (or notice) that sees no completion from its peer for this long fails its
  // transfer with DEADLINE_EXCEEDED and marks the peer unreachable.
  int64_t completion_timeout_ms = 5000;
  // Post writes with FI_DELIVERY_COMPLETE when the provider accepts it (the notice is always
  // sent only after every write of its batch has completed).
  bool delivery_complete = true;
  // Ask for FI_HMEM (registration of GPU memory) when built with CUDA. Off by default: the KV
  // pool is host memory, and FI_HMEM costs some providers their fastest host path (shm turns
  // off its single-copy CMA transfers and falls back to copying through bounce buffers).
  bool hmem = false;
  // A rail's progress thread keeps polling (instead of napping ~100 us) for this many
  // microseconds after its last activity, on providers whose CQ has no wait object (shm): a
  // target completes incoming writes only while it polls. 0 = always nap when idle.
  int64_t idle_poll_us = 2000;
};

// A worker process (`cleave worker`, src/worker/service).
struct WorkerSettings {
  std::string role = "unified";        // prefill | decode | unified
  std::string listen = "127.0.0.1:0";  // gRPC address; port 0 picks a free port
  std::string id;                      // empty: "<role>-<pid>"
  // How long a decode worker keeps blocks reserved for a prefill's KV (Reserve's lease_ms 0).
  int64_t lease_ms = 10000;
  // Longest a Prefill RPC waits for its prompt's compute (queueing included) before it fails.
  int64_t prefill_timeout_ms = 120000;
  // SIGTERM: stop taking requests (health NOT_SERVING), let running ones finish for at most
  // this long, then shut down.
  int64_t drain_seconds = 30;
  // HTTP port serving GET /metrics (Prometheus text) on the worker.listen host; -1: off,
  // 0: a free port.
  int64_t metrics_port = -1;
  // The node's instance type (node.kubernetes.io/instance-type), which selects the profile;
  // "@PATH" reads it from a file (select_worker_profile puts the value read here).
  std::string instance_type;
  // The profile select_worker_profile applied ("" for none). Not a setting.
  std::string profile;
};

// The router (`cleave router`, `cleave serve`; src/router/app).
struct RouterSettings {
  std::string host = "0.0.0.0";  // HTTP listen address
  int64_t port = 8000;           // HTTP port; 0 picks a free port
  int64_t grpc_port = 8001;      // gRPC API port (same host); 0 picks a free port; -1: off
  std::string api_keys;          // comma-separated bearer tokens for /v1/; empty = no auth
  int64_t max_queue = 1024;      // requests admitted and unfinished; beyond: HTTP 429
  // Longest a request waits for its first token (queueing, prefill and KV transfer included).
  int64_t request_timeout_ms = 120000;
  int64_t io_threads = 1;                    // HTTP I/O threads
  std::string mode = "disaggregated";        // unified | disaggregated
  std::string policy_prefill = "prefix_aware";  // round_robin | least_loaded | prefix_aware
  std::string policy_decode = "least_loaded";
  std::string policy_unified = "least_loaded";
  int64_t health_interval_ms = 1000;  // worker health and load probes
  int64_t health_timeout_ms = 1000;   // each probe RPC
  int64_t health_failures = 3;        // timed-out probes in a row before a worker leaves
  int64_t dns_refresh_ms = 10000;     // DNS names of the pools re-resolved this often
  int64_t max_body_bytes = 16ll << 20;  // larger request bodies: HTTP 413
  std::string served_model_name;        // empty: the model's own name (else its file name)
};

// One worker pool (pools.prefill, pools.decode, pools.unified). Where its workers are: started
// by `cleave serve` (`replicas` children) unless `workers` or `dns` names them. The engine
// settings apply to the workers `cleave serve` starts; 0 = the engine.* value.
struct PoolSettings {
  int64_t replicas = 1;
  std::string workers;  // comma-separated HOST:PORT list of running workers
  std::string dns;      // NAME:PORT resolving to the workers (e.g. a headless Service)
  int64_t threads = 0;
  int64_t kv_blocks = 0;
  int64_t kv_cache_bytes = 0;
  int64_t max_tokens_per_step = 0;
  int64_t max_num_seqs = 0;
};

struct PoolsSettings {
  PoolSettings prefill;
  PoolSettings decode;
  PoolSettings unified;
};

struct Config {
  LogSettings log;
  ModelSettings model;
  EngineSettings engine;
  TransferSettings transfer;
  WorkerSettings worker;
  RouterSettings router;
  PoolsSettings pools;
};

// Binds every field of `config` to `registry`.
void register_settings(Config& config, SettingsRegistry& registry);

// Applies file (when non-empty) < env < overrides ("key=value" each, from flags) on top of the
// defaults already in the fields bound to `registry`.
Status load_config(SettingsRegistry& registry, const std::string& file,
                   const std::vector<std::string>& overrides);

// A worker's profile, once its settings are loaded: reads worker.instance_type (from the file
// it names when it starts with '@'), picks the profile of that name, else `default`, else none,
// and applies it for worker.role (SettingsRegistry::apply_profile). Sets config.worker.profile
// and returns a line for the log saying what was chosen and set.
Result<std::string> select_worker_profile(SettingsRegistry& registry, Config& config);

}  // namespace cleave
