#include "cleave/common/config.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "config_internal.h"
#include "fmt/format.h"
#include "yaml-cpp/yaml.h"

namespace cleave {
namespace {

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t')) --e;
  return std::string(s.substr(b, e - b));
}

std::string join(const std::vector<std::string>& v, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out += sep;
    out += v[i];
  }
  return out;
}

// Flattens a YAML mapping into dotted keys; sequences are refused (no setting takes a list yet).
Status flatten(const YAML::Node& node, const std::string& prefix, std::string_view source,
               std::vector<std::pair<std::string, std::string>>& out) {
  if (!node.IsMap()) {
    return InvalidArgument(fmt::format("{}: '{}' must be a mapping", source,
                                       prefix.empty() ? "<top level>" : prefix));
  }
  for (const auto& kv : node) {
    std::string key = kv.first.as<std::string>();
    std::string full = prefix.empty() ? key : prefix + "." + key;
    const YAML::Node& v = kv.second;
    if (v.IsMap()) {
      CLEAVE_RETURN_IF_ERROR(flatten(v, full, source, out));
    } else if (v.IsScalar()) {
      out.emplace_back(full, v.Scalar());
    } else if (v.IsNull()) {
      out.emplace_back(full, "");
    } else {
      return InvalidArgument(fmt::format("{}: '{}' must be a single value", source, full));
    }
  }
  return Status::Ok();
}

}  // namespace

namespace config_internal {
Status flatten_yaml(const YAML::Node& node, const std::string& prefix, std::string_view source,
                    std::vector<std::pair<std::string, std::string>>& out) {
  return flatten(node, prefix, source, out);
}
}  // namespace config_internal

std::string env_name_for_key(std::string_view key) {
  std::string env = "CLEAVE_";
  for (char c : key) {
    if (c == '.' || c == '-') env += '_';
    else if (c >= 'a' && c <= 'z') env += static_cast<char>(c - 'a' + 'A');
    else env += c;
  }
  return env;
}

SettingsRegistry::Setting& SettingsRegistry::add(std::string key, std::string help,
                                                 std::string type, std::string flag) {
  index_[key] = settings_.size();
  Setting s;
  s.env = env_name_for_key(key);
  s.key = std::move(key);
  s.help = std::move(help);
  s.type = std::move(type);
  s.flag = std::move(flag);
  settings_.push_back(std::move(s));
  return settings_.back();
}

void SettingsRegistry::add_int(std::string key, int64_t* field, std::string help, int64_t min,
                               int64_t max, std::string flag) {
  Setting& s = add(key, std::move(help), "int", std::move(flag));
  s.get = [field] { return std::to_string(*field); };
  s.set = [field, key, min, max](std::string_view text) -> Status {
    std::string t = trim(text);
    errno = 0;
    char* end = nullptr;
    long long v = std::strtoll(t.c_str(), &end, 10);
    if (t.empty() || *end != '\0' || errno == ERANGE)
      return InvalidArgument(fmt::format("{}: '{}' is not an integer", key, text));
    if (v < min || v > max)
      return InvalidArgument(fmt::format("{}: {} is out of range [{}, {}]", key, v, min, max));
    *field = v;
    return Status::Ok();
  };
  s.default_value = s.get();
}

void SettingsRegistry::add_float(std::string key, double* field, std::string help, double min,
                                 double max, std::string flag) {
  Setting& s = add(key, std::move(help), "float", std::move(flag));
  s.get = [field] { return fmt::format("{}", *field); };
  s.set = [field, key, min, max](std::string_view text) -> Status {
    std::string t = trim(text);
    char* end = nullptr;
    double v = std::strtod(t.c_str(), &end);
    if (t.empty() || *end != '\0' || !std::isfinite(v))
      return InvalidArgument(fmt::format("{}: '{}' is not a number", key, text));
    if (v < min || v > max)
      return InvalidArgument(fmt::format("{}: {} is out of range [{}, {}]", key, v, min, max));
    *field = v;
    return Status::Ok();
  };
  s.default_value = s.get();
}

void SettingsRegistry::add_bool(std::string key, bool* field, std::string help, std::string flag) {
  Setting& s = add(key, std::move(help), "bool", std::move(flag));
  s.get = [field] { return std::string(*field ? "true" : "false"); };
  s.set = [field, key](std::string_view text) -> Status {
    std::string t = trim(text);
    for (auto& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (t == "true" || t == "1" || t == "yes" || t == "on") *field = true;
    else if (t == "false" || t == "0" || t == "no" || t == "off") *field = false;
    else return InvalidArgument(fmt::format("{}: '{}' is not a boolean (true/false)", key, text));
    return Status::Ok();
  };
  s.default_value = s.get();
}

void SettingsRegistry::add_string(std::string key, std::string* field, std::string help,
                                  std::string flag) {
  Setting& s = add(key, std::move(help), "string", std::move(flag));
  s.get = [field] { return *field; };
  s.set = [field](std::string_view text) -> Status {
    *field = std::string(text);
    return Status::Ok();
  };
  s.default_value = s.get();
}

void SettingsRegistry::add_enum(std::string key, std::string* field,
                                std::vector<std::string> choices, std::string help,
                                std::string flag) {
  Setting& s = add(key, std::move(help), join(choices, "|"), std::move(flag));
  s.get = [field] { return *field; };
  s.set = [field, key, choices](std::string_view text) -> Status {
    std::string t = trim(text);
    for (const auto& c : choices) {
      if (c == t) {
        *field = t;
        return Status::Ok();
      }
    }
    return InvalidArgument(
        fmt::format("{}: '{}' is not one of {}", key, text, join(choices, ", ")));
  };
  s.default_value = s.get();
}

const SettingsRegistry::Setting* SettingsRegistry::find(std::string_view key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &settings_[it->second];
}

Status SettingsRegistry::set(std::string_view key, std::string_view value,
                             std::string_view source) {
  auto it = index_.find(key);
  if (it == index_.end())
    return InvalidArgument(fmt::format("{}: unknown setting '{}'", source, key));
  Setting& s = settings_[it->second];
  Status st = s.set(value);
  if (!st.ok()) return st.with_context(source);
  s.source = std::string(source);
  return Status::Ok();
}

Status SettingsRegistry::set_assignment(std::string_view assignment, std::string_view source) {
  size_t eq = assignment.find('=');
  if (eq == std::string_view::npos || eq == 0)
    return InvalidArgument(fmt::format("{}: '{}' is not of the form key=value", source, assignment));
  return set(trim(assignment.substr(0, eq)), assignment.substr(eq + 1), source);
}

Status SettingsRegistry::load_yaml_string(std::string_view yaml, std::string_view source_name) {
  std::vector<std::pair<std::string, std::string>> flat;
  try {
    YAML::Node root = YAML::Load(std::string(yaml));
    if (root.IsNull()) return Status::Ok();  // an empty file is a valid, empty config
    if (root.IsMap() && root["profiles"]) {
      CLEAVE_RETURN_IF_ERROR(read_profiles(root["profiles"], source_name));
      root.remove("profiles");
    }
    CLEAVE_RETURN_IF_ERROR(flatten(root, "", source_name, flat));
  } catch (const YAML::Exception& e) {
    return InvalidArgument(fmt::format("{}: YAML error: {}", source_name, e.what()));
  }
  for (const auto& [k, v] : flat) CLEAVE_RETURN_IF_ERROR(set(k, v, source_name));
  return Status::Ok();
}

Status SettingsRegistry::load_yaml_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return load_directory(path);
  std::ifstream in(path);
  if (!in) return NotFound(fmt::format("cannot read config file '{}'", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return load_yaml_string(ss.str(), path);
}

Status SettingsRegistry::load_env(const std::function<const char*(const char*)>& getenv_fn) {
  for (auto& s : settings_) {
    const char* v = getenv_fn ? getenv_fn(s.env.c_str()) : std::getenv(s.env.c_str());
    if (v != nullptr) CLEAVE_RETURN_IF_ERROR(set(s.key, v, "env " + s.env));
  }
  return Status::Ok();
}

std::string SettingsRegistry::to_yaml() const {
  // Group by the first key component; keys have at most two levels today, but render any depth.
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::string open_section;
  for (const auto& s : settings_) {
    size_t dot = s.key.find('.');
    std::string section = dot == std::string::npos ? "" : s.key.substr(0, dot);
    std::string leaf = dot == std::string::npos ? s.key : s.key.substr(dot + 1);
    if (section != open_section) {
      if (!open_section.empty()) out << YAML::EndMap;
      if (!section.empty()) out << YAML::Key << section << YAML::Value << YAML::BeginMap;
      open_section = section;
    }
    out << YAML::Key << leaf << YAML::Value << s.get() << YAML::Comment(s.source);
  }
  if (!open_section.empty()) out << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string SettingsRegistry::markdown_table() const {
  std::string t = "| Setting | Type | Default | Env | Flag | Description |\n";
  t += "|---|---|---|---|---|---|\n";
  for (const auto& s : settings_) {
    std::string type;
    for (char c : s.type) type += c == '|' ? std::string("\\|") : std::string(1, c);
    t += fmt::format("| `{}` | {} | `{}` | `{}` | {} | {} |\n", s.key, type,
                     s.default_value.empty() ? "\"\"" : s.default_value, s.env,
                     s.flag.empty() ? "" : "`" + s.flag + "`", s.help);
  }
  return t;
}

void register_settings(Config& c, SettingsRegistry& r) {
  r.add_enum("log.level", &c.log.level, {"trace", "debug", "info", "warn", "error", "off"},
             "Log level (logs go to stderr).", "--log-level");
  r.add_string("model.path", &c.model.path,
               "GGUF file or Hugging Face model directory; empty serves the embedded default.",
               "--model");
  r.add_int("engine.threads", &c.engine.threads,
            "Compute threads per engine; 0 = one per online CPU.", 0, 1024, "--threads");
  r.add_int("engine.max_context", &c.engine.max_context,
            "Longest sequence (prompt + output) in tokens; 0 = the model's context length.", 0,
            1 << 24, "--max-context");
  r.add_int("engine.block_size", &c.engine.block_size, "Tokens per KV block.", 1, 4096,
            "--block-size");
  r.add_int("engine.kv_blocks", &c.engine.kv_blocks,
            "KV pool size in blocks; 0 = sized from engine.kv_cache_bytes.", 0, 1 << 30,
            "--kv-blocks");
  r.add_int("engine.kv_cache_bytes", &c.engine.kv_cache_bytes,
            "KV pool memory budget in bytes (used when engine.kv_blocks is 0).", 1 << 20,
            int64_t{1} << 50, "--kv-cache-bytes");
  r.add_enum("engine.kv_dtype", &c.engine.kv_dtype, {"f32", "f16", "bf16"},
             "Element type of K and V in the KV pool (f16 and bf16 halve its memory and "
             "attention's reads; prefill and decode workers must agree).",
             "--kv-dtype");
  r.add_int("engine.max_tokens_per_step", &c.engine.max_tokens_per_step,
            "Token budget of one engine step: decode tokens plus prefill chunks.", 1, 1 << 20,
            "--max-tokens-per-step");
  r.add_int("engine.max_num_seqs", &c.engine.max_num_seqs,
            "Most sequences running at once.", 1, 1 << 16, "--max-num-seqs");
  r.add_bool("engine.prefix_caching", &c.engine.prefix_caching,
             "Reuse cached full KV blocks of earlier prompts (prefix cache).");
  r.add_string("transfer.provider", &c.transfer.provider,
               "libfabric provider: auto (efa, verbs;ofi_rxm, shm on one host, tcp;ofi_rxm) or a "
               "name as libfabric spells it (tcp;ofi_rxm, shm, efa, ...).",
               "--transfer-provider");
  r.add_string("transfer.node", &c.transfer.node,
               "Address given to fi_getinfo; empty lets the provider choose.");
  r.add_int("transfer.rails", &c.transfer.rails,
            "Endpoints driven in parallel (over NICs/domains when there are several).", 1, 64,
            "--transfer-rails");
  r.add_int("transfer.slice_bytes", &c.transfer.slice_bytes,
            "Large writes are cut into slices of at most this many bytes.", 4096, 1ll << 30);
  r.add_int("transfer.max_inflight_per_rail", &c.transfer.max_inflight_per_rail,
            "Most writes in flight per rail; 0 = the provider's TX queue depth.", 0, 1 << 20);
  r.add_int("transfer.completion_timeout_ms", &c.transfer.completion_timeout_ms,
            "A write with no completion for this long fails and marks its peer unreachable.", 1,
            3600000);
  r.add_bool("transfer.delivery_complete", &c.transfer.delivery_complete,
             "Post writes with FI_DELIVERY_COMPLETE where the provider accepts it.");
  r.add_bool("transfer.hmem", &c.transfer.hmem,
             "Ask for FI_HMEM (GPU memory registration) when built with CUDA; costs shm its "
             "single-copy (CMA) path, so only for KV in GPU memory.");
  r.add_int("transfer.idle_poll_us", &c.transfer.idle_poll_us,
            "Microseconds a rail, or a thread waiting for a transfer, keeps polling after its "
            "last activity before it naps (shm: targets complete incoming writes only while "
            "polling).", 0, 10000000);
  r.add_enum("worker.role", &c.worker.role, {"prefill", "decode", "unified"},
             "What a `cleave worker` serves: prefill, decode, or both in one process (unified).",
             "--role");
  r.add_string("worker.listen", &c.worker.listen,
               "HOST:PORT the worker's gRPC service listens on; port 0 picks a free port.",
               "--listen");
  r.add_string("worker.id", &c.worker.id,
               "Worker id in logs, metrics and the control plane; empty = ROLE-PID (e.g. decode-4242).", "--id");
  r.add_int("worker.lease_ms", &c.worker.lease_ms,
            "Decode worker: how long reserved KV blocks wait for the prefill's KV before they "
            "are released (when Reserve names no lease).",
            1, 3600000);
  r.add_int("worker.prefill_timeout_ms", &c.worker.prefill_timeout_ms,
            "Prefill worker: longest a Prefill waits for its prompt's compute, queueing included.",
            1, 86400000);
  r.add_int("worker.drain_seconds", &c.worker.drain_seconds,
            "On SIGTERM a worker stops taking requests (health NOT_SERVING) and lets running ones "
            "finish for at most this long before it exits; 0 = exit at once.",
            0, 86400);
  r.add_int("worker.metrics_port", &c.worker.metrics_port,
            "HTTP port of the worker's GET /metrics (Prometheus text), on the worker.listen host; "
            "-1 = off, 0 picks a free port.",
            -1, 65535, "--metrics-port");
  r.add_string("worker.instance_type", &c.worker.instance_type,
               "The node's instance type (node.kubernetes.io/instance-type): the worker applies "
               "profiles.<type> (else profiles.default); `@PATH` reads it from a file.",
               "--instance-type");
  r.add_string("router.host", &c.router.host,
               "Address the router's HTTP API listens on (IPv4 or IPv6 literal).", "--host");
  r.add_int("router.port", &c.router.port, "HTTP port of the router; 0 picks a free port.", 0,
            65535, "--port");
  r.add_int("router.grpc_port", &c.router.grpc_port,
            "Port of the router's gRPC API (cleave.v1.Inference, on router.host); 0 picks a free "
            "port, -1 turns it off.",
            -1, 65535, "--grpc-port");
  r.add_string("router.api_keys", &c.router.api_keys,
               "Comma-separated API keys accepted as `Authorization: Bearer KEY` on /v1/; empty "
               "= no authentication.",
               "--api-keys");
  r.add_int("router.max_queue", &c.router.max_queue,
            "Requests admitted and not yet finished; beyond it requests get HTTP 429.", 1,
            1 << 24, "--max-queue");
  r.add_int("router.request_timeout_ms", &c.router.request_timeout_ms,
            "Longest a request waits for its first token (queueing, prefill, KV transfer).", 1,
            86400000);
  r.add_int("router.io_threads", &c.router.io_threads, "HTTP I/O threads of the router.", 1, 256);
  r.add_enum("router.mode", &c.router.mode, {"unified", "disaggregated"},
             "Pools: unified workers only, or a prefill pool and a decode pool.", "--mode");
  const std::vector<std::string> policies = {"round_robin", "least_loaded", "prefix_aware"};
  r.add_enum("router.policy_prefill", &c.router.policy_prefill, policies,
             "How a prefill worker is chosen per request.");
  r.add_enum("router.policy_decode", &c.router.policy_decode, policies,
             "How a decode worker is chosen per request.");
  r.add_enum("router.policy_unified", &c.router.policy_unified, policies,
             "How a unified worker is chosen per request.");
  r.add_int("router.health_interval_ms", &c.router.health_interval_ms,
            "Every worker's health and load are probed this often.", 10, 3600000);
  r.add_int("router.health_timeout_ms", &c.router.health_timeout_ms,
            "Each health/load probe RPC of a worker times out after this long.", 10, 600000);
  r.add_int("router.health_failures", &c.router.health_failures,
            "Probes in a row that time out before a busy worker leaves its pool (a refused or "
            "failed probe, or an RPC failing UNAVAILABLE, takes it out at once).",
            1, 1000);
  r.add_int("router.dns_refresh_ms", &c.router.dns_refresh_ms,
            "Pools given by a DNS name (pools.*.dns) are re-resolved this often.", 100, 86400000);
  r.add_int("router.max_body_bytes", &c.router.max_body_bytes,
            "Largest HTTP request body; larger ones get HTTP 413.", 1024, int64_t{1} << 32);
  r.add_string("router.served_model_name", &c.router.served_model_name,
               "Model name of the API; empty = the model's own name (else its file name).",
               "--served-model-name");
  const std::pair<const char*, PoolSettings*> pools[] = {
      {"prefill", &c.pools.prefill}, {"decode", &c.pools.decode}, {"unified", &c.pools.unified}};
  for (const auto& [name, pool] : pools) {
    const std::string k = std::string("pools.") + name + ".";
    r.add_int(k + "replicas", &pool->replicas,
              fmt::format("{} workers `cleave serve` starts (when no workers or dns is set).",
                          name),
              0, 1024);
    r.add_string(k + "workers", &pool->workers,
                 fmt::format("Comma-separated HOST:PORT of running {} workers; set: `cleave "
                             "serve` starts none and the router dials these.",
                             name));
    r.add_string(k + "dns", &pool->dns,
                 fmt::format("NAME:PORT resolving to the {} workers (e.g. a Kubernetes headless "
                             "Service), re-resolved every router.dns_refresh_ms.",
                             name));
    r.add_int(k + "threads", &pool->threads,
              "Compute threads of each started worker; 0 = engine.threads (when that is 0 too, "
              "`cleave serve` shares the CPUs among its workers).",
              0, 1024);
    r.add_int(k + "kv_blocks", &pool->kv_blocks,
              "KV blocks of each started worker; 0 = engine.kv_blocks.", 0, 1 << 30);
    r.add_int(k + "kv_cache_bytes", &pool->kv_cache_bytes,
              "KV memory budget of each started worker; 0 = engine.kv_cache_bytes.", 0,
              int64_t{1} << 50);
    r.add_int(k + "max_tokens_per_step", &pool->max_tokens_per_step,
              "Token budget of one engine step of each started worker; 0 = "
              "engine.max_tokens_per_step.",
              0, 1 << 20);
    r.add_int(k + "max_num_seqs", &pool->max_num_seqs,
              "Most sequences running at once on each started worker; 0 = engine.max_num_seqs.",
              0, 1 << 16);
  }
}

Status load_config(SettingsRegistry& registry, const std::string& file,
                   const std::vector<std::string>& overrides) {
  if (!file.empty()) CLEAVE_RETURN_IF_ERROR(registry.load_yaml_file(file));
  CLEAVE_RETURN_IF_ERROR(registry.load_env());
  for (const auto& o : overrides) CLEAVE_RETURN_IF_ERROR(registry.set_assignment(o, "flag"));
  return Status::Ok();
}

}  // namespace cleave
