// check_api_key: the bearer token of a request against the configured keys.
#include "frontend/api_key.h"

namespace cleave::router {
namespace {

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

// Compares in time that depends on the lengths only, not on where the first difference is.
bool same_secret(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

}  // namespace

std::optional<openai::ApiError> check_api_key(const std::vector<std::string>& api_keys,
                                              std::string_view authorization) {
  if (api_keys.empty()) return std::nullopt;
  while (!authorization.empty() && authorization.front() == ' ') authorization.remove_prefix(1);
  constexpr std::string_view kBearer = "bearer ";
  if (authorization.size() <= kBearer.size() ||
      !iequals(authorization.substr(0, kBearer.size()), kBearer)) {
    return openai::invalid_api_key(/*missing=*/true);
  }
  std::string_view token = authorization.substr(kBearer.size());
  while (!token.empty() && token.front() == ' ') token.remove_prefix(1);
  while (!token.empty() && token.back() == ' ') token.remove_suffix(1);
  bool ok = false;
  for (const auto& key : api_keys) ok |= same_secret(token, key);
  if (!ok) return openai::invalid_api_key(/*missing=*/false);
  return std::nullopt;
}

}  // namespace cleave::router
