#pragma once
// Minimal blocking HTTP client for OpenAI-compatible servers (one per worker thread):
// JSON POST, streamed POST (body delivered as it arrives) and GET.
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "core/status.h"

namespace httplib {
class Client;
}

namespace m3::bench {

// "http://host:port/prefix" split into the part httplib connects to and a path prefix.
struct BaseUrl {
  std::string scheme_host_port;  // "http://host:port"
  std::string path_prefix;       // "" or "/prefix" (no trailing slash)
};
Result<BaseUrl> parse_base_url(const std::string& url);

// Joins a prefix and a path; a prefix ending in "/v1" and a path starting with "/v1/"
// share that segment once ("http://h/v1" + "/v1/completions" -> "/v1/completions").
std::string join_url_path(const std::string& prefix, const std::string& path);

struct HttpResponse {
  int status = 0;
  std::string body;
};

class HttpClient {
 public:
  HttpClient(const std::string& scheme_host_port, double timeout_s);
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  Result<HttpResponse> get(const std::string& path);
  Result<HttpResponse> post_json(const std::string& path, const std::string& body);
  // Streams a 200 response's body to on_data (return false to abort); a non-200 body is
  // collected into the returned response instead. Transport failures are errors.
  Result<HttpResponse> post_json_stream(const std::string& path, const std::string& body,
                                        const std::function<bool(std::string_view)>& on_data);

 private:
  std::unique_ptr<httplib::Client> client_;
};

}  // namespace m3::bench
