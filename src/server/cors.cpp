// CORS answers: Starlette's rules (wildcards, credentials echo the origin, Vary: Origin).
#include "server/cors.h"

#include <algorithm>
#include <cctype>

#include <nlohmann/json.hpp>

namespace m3::server {
namespace {

constexpr const char* kAllMethods = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT";
constexpr const char* kMaxAge = "600";

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t");
  if (a == std::string::npos) return {};
  return s.substr(a, s.find_last_not_of(" \t") - a + 1);
}

bool wildcard(const std::vector<std::string>& list) { return std::find(list.begin(), list.end(), "*") != list.end(); }

bool origin_allowed(const CorsPolicy& p, const std::string& origin) {
  return wildcard(p.origins) || std::find(p.origins.begin(), p.origins.end(), origin) != p.origins.end();
}

std::string join(const std::vector<std::string>& list) {
  std::string out;
  for (const auto& s : list) out.append(out.empty() ? "" : ", ").append(s);
  return out;
}

// The Access-Control-Allow-Origin value: "*" only for any origin without credentials.
void add_origin(const CorsPolicy& p, const std::string& origin, Headers& out) {
  if (wildcard(p.origins) && !p.credentials) {
    out.emplace_back("Access-Control-Allow-Origin", "*");
  } else {
    out.emplace_back("Access-Control-Allow-Origin", origin);
    out.emplace_back("Vary", "Origin");
  }
  if (p.credentials) out.emplace_back("Access-Control-Allow-Credentials", "true");
}

}  // namespace

std::optional<std::string> parse_cors_list(const std::string& flag, const std::string& value,
                                           std::vector<std::string>& out) {
  out.clear();
  const std::string v = trim(value);
  if (!v.empty() && v.front() == '[') {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(v);
    } catch (const std::exception& e) {
      return flag + ": not a JSON array of strings (" + e.what() + ")";
    }
    for (const auto& item : j) {
      if (!item.is_string()) return flag + ": every entry must be a string";
      out.push_back(item.get<std::string>());
    }
  } else {
    size_t start = 0;
    while (start <= v.size()) {
      const size_t comma = v.find(',', start);
      const std::string item = trim(v.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
      if (!item.empty()) out.push_back(item);
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  if (out.empty()) return flag + ": give at least one entry (\"*\" allows all)";
  return std::nullopt;
}

PreflightAnswer cors_preflight(const CorsPolicy& policy, const std::string& origin, const std::string& method,
                               const std::string& request_headers) {
  PreflightAnswer a;
  std::vector<std::string> failures;
  if (!origin_allowed(policy, origin)) failures.push_back("origin");
  if (!wildcard(policy.methods) && std::find(policy.methods.begin(), policy.methods.end(), method) == policy.methods.end())
    failures.push_back("method");
  std::vector<std::string> allowed_headers;
  for (const auto& h : policy.headers) allowed_headers.push_back(lower(h));
  // Always allowed, as in Starlette: the CORS-safelisted request headers.
  for (const char* h : {"accept", "accept-language", "content-language", "content-type"}) allowed_headers.push_back(h);
  if (!wildcard(policy.headers)) {
    std::vector<std::string> asked;
    parse_cors_list("", request_headers, asked);
    for (const auto& h : asked)
      if (std::find(allowed_headers.begin(), allowed_headers.end(), lower(h)) == allowed_headers.end()) {
        failures.push_back("headers");
        break;
      }
  }
  if (origin_allowed(policy, origin)) add_origin(policy, origin, a.headers);
  a.headers.emplace_back("Access-Control-Allow-Methods", wildcard(policy.methods) ? kAllMethods : join(policy.methods));
  a.headers.emplace_back("Access-Control-Max-Age", kMaxAge);
  a.headers.emplace_back("Access-Control-Allow-Headers",
                         wildcard(policy.headers) && !request_headers.empty() ? request_headers : join(allowed_headers));
  if (!failures.empty()) {
    a.status = 400;
    a.body = "Disallowed CORS " + join(failures);
    return a;
  }
  a.body = "OK";
  return a;
}

Headers cors_response_headers(const CorsPolicy& policy, const std::string& origin) {
  Headers out;
  if (origin.empty() || !origin_allowed(policy, origin)) return out;
  add_origin(policy, origin, out);
  return out;
}

}  // namespace m3::server
