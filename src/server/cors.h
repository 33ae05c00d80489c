#pragma once
// Cross-origin requests (browser clients), as vLLM's server answers them (Starlette's CORS
// middleware): a preflight OPTIONS is answered before authentication, and responses to an
// allowed Origin carry Access-Control-Allow-Origin. Pure: headers in, headers out.
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace m3::server {

struct CorsPolicy {
  std::vector<std::string> origins = {"*"};  // "*": any origin
  std::vector<std::string> methods = {"*"};
  std::vector<std::string> headers = {"*"};
  bool credentials = false;
};

using Headers = std::vector<std::pair<std::string, std::string>>;

// A flag's value: a JSON array of strings (vLLM's form, '["http://a", "http://b"]') or a
// comma-separated list. Errors name the flag.
std::optional<std::string> parse_cors_list(const std::string& flag, const std::string& value,
                                           std::vector<std::string>& out);

struct PreflightAnswer {
  int status = 200;  // 400 when the origin, method or a header is not allowed
  Headers headers;
  std::string body;  // "OK" or what was disallowed
};

// OPTIONS carrying Origin and Access-Control-Request-Method.
PreflightAnswer cors_preflight(const CorsPolicy& policy, const std::string& origin, const std::string& method,
                               const std::string& request_headers);
// Headers added to an ordinary response to a request with this Origin (none when not allowed).
Headers cors_response_headers(const CorsPolicy& policy, const std::string& origin);

}  // namespace m3::server
