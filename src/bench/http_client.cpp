#include "bench/http_client.h"

#include <httplib.h>

namespace m3::bench {

Result<BaseUrl> parse_base_url(const std::string& url) {
  const size_t scheme_end = url.find("://");
  if (scheme_end == std::string::npos) {
    return Status::error("base URL '" + url + "' needs a scheme (http:// or https://)");
  }
  const std::string scheme = url.substr(0, scheme_end);
  if (scheme != "http" && scheme != "https") {
    return Status::error("base URL '" + url + "': unsupported scheme '" + scheme + "'");
  }
  const size_t host_begin = scheme_end + 3;
  const size_t path_begin = url.find('/', host_begin);
  BaseUrl out;
  out.scheme_host_port = url.substr(0, path_begin);
  if (out.scheme_host_port.size() <= host_begin) {
    return Status::error("base URL '" + url + "' has no host");
  }
  if (path_begin != std::string::npos) {
    out.path_prefix = url.substr(path_begin);
    while (!out.path_prefix.empty() && out.path_prefix.back() == '/') out.path_prefix.pop_back();
  }
  return out;
}

std::string join_url_path(const std::string& prefix, const std::string& path) {
  std::string p = path.empty() || path[0] == '/' ? path : "/" + path;
  const std::string v1 = "/v1";
  if (prefix.size() >= v1.size() && prefix.compare(prefix.size() - v1.size(), v1.size(), v1) == 0 &&
      p.rfind("/v1/", 0) == 0) {
    p = p.substr(v1.size());
  }
  return prefix + p;
}

HttpClient::HttpClient(const std::string& scheme_host_port, double timeout_s)
    : client_(std::make_unique<httplib::Client>(scheme_host_port)) {
  const auto sec = static_cast<time_t>(timeout_s);
  const auto usec = static_cast<time_t>((timeout_s - static_cast<double>(sec)) * 1e6);
  client_->set_connection_timeout(sec, usec);
  client_->set_read_timeout(sec, usec);
  client_->set_write_timeout(sec, usec);
  client_->set_keep_alive(true);
}

HttpClient::~HttpClient() = default;

namespace {

Status transport_error(httplib::Error error) {
  return Status::error("connection: " + httplib::to_string(error));
}

}  // namespace

Result<HttpResponse> HttpClient::get(const std::string& path) {
  auto res = client_->Get(path);
  if (!res) return transport_error(res.error());
  return HttpResponse{res->status, res->body};
}

Result<HttpResponse> HttpClient::post_json(const std::string& path, const std::string& body) {
  auto res = client_->Post(path, body, "application/json");
  if (!res) return transport_error(res.error());
  return HttpResponse{res->status, res->body};
}

Result<HttpResponse> HttpClient::post_json_stream(
    const std::string& path, const std::string& body,
    const std::function<bool(std::string_view)>& on_data) {
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body;
  req.set_header("Content-Type", "application/json");
  req.set_header("Accept", "text/event-stream");
  HttpResponse out;
  req.response_handler = [&out](const httplib::Response& r) {
    out.status = r.status;
    return true;
  };
  req.content_receiver = [&out, &on_data](const char* data, size_t num_bytes, uint64_t,
                                          uint64_t) {
    if (out.status != 200) {
      out.body.append(data, num_bytes);
      return true;
    }
    return on_data(std::string_view(data, num_bytes));
  };
  httplib::Response res;
  httplib::Error error = httplib::Error::Success;
  if (!client_->send(req, res, error)) {
    // Aborting from on_data also lands here; the caller knows it asked for it.
    if (error == httplib::Error::Canceled && out.status == 200) return out;
    return transport_error(error);
  }
  if (out.status == 0) out.status = res.status;
  return out;
}

}  // namespace m3::bench
