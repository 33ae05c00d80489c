#include "server/disagg_proxy.h"

#include <signal.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "core/log.h"
#include "server/backend_picker.h"

namespace m3::server {
namespace {

struct ProxyOptions {
  std::vector<std::string> prefill, decode;  // base URLs, http://host:port
  std::string host = "0.0.0.0";
  int port = 8000;
  double timeout_s = 600.0;
};

void send_error(httplib::Response& res, int status, const std::string& message, const std::string& type) {
  res.status = status;
  nlohmann::json e = {{"error", {{"message", message}, {"type", type}, {"param", nullptr}, {"code", status}}}};
  res.set_content(e.dump(), "application/json");
}

class Proxy {
 public:
  explicit Proxy(ProxyOptions o) : o_(std::move(o)), prefill_(o_.prefill), decode_(o_.decode) {}

  void generation(const httplib::Request& req, httplib::Response& res, const std::string& path) {
    nlohmann::json body;
    try {
      body = nlohmann::json::parse(req.body);
    } catch (const std::exception& e) {
      return send_error(res, 400, std::string("malformed JSON in the request body: ") + e.what(), "invalid_request_error");
    }
    if (!body.is_object()) return send_error(res, 400, "the request body must be a JSON object", "invalid_request_error");
    httplib::Headers headers;
    if (req.has_header("Authorization")) headers.emplace("Authorization", req.get_header_value("Authorization"));
    if (req.has_header("X-Request-Id")) headers.emplace("X-Request-Id", req.get_header_value("X-Request-Id"));

    // Prefill: the prompt alone, one token, its blocks kept for the decode server.
    nlohmann::json pre = body;
    pre["max_tokens"] = 1;
    pre.erase("max_completion_tokens");
    pre["stream"] = false;
    pre.erase("stream_options");
    pre["n"] = 1;
    pre.erase("min_tokens");
    pre["kv_transfer_params"] = {{"do_remote_decode", true}};
    std::optional<BackendPicker::Lease> prefill_lease(prefill_.pick());
    const std::string prefill_url = prefill_lease->url();
    auto pc = client(prefill_url);
    auto pr = pc->Post(path, headers, pre.dump(), "application/json");
    if (!pr)
      return send_error(res, 502, "prefill server " + prefill_url + ": " + httplib::to_string(pr.error()),
                        "BadGatewayError");
    if (pr->status != 200) {  // its verdict on the request (e.g. a 400 naming the field) is the client's
      res.status = pr->status;
      res.set_content(pr->body, "application/json");
      return;
    }
    prefill_lease.reset();
    nlohmann::json kv;
    try {
      kv = nlohmann::json::parse(pr->body).value("kv_transfer_params", nlohmann::json());
    } catch (const std::exception&) {
    }
    if (kv.is_object()) {
      body["kv_transfer_params"] = kv;
    } else {
      body.erase("kv_transfer_params");  // nothing kept (e.g. over the prefill's buffer): the decode computes it
      M3_LOG_WARN("prefill server " + prefill_url + " kept no KV blocks for this request");
    }

    // The decode server's lease lasts until its answer is relayed (streams included).
    auto decode_lease = std::make_shared<BackendPicker::Lease>(decode_.pick());
    const std::string decode_url = decode_lease->url();
    const std::string payload = body.dump();
    if (!body.value("stream", false)) {
      auto dc = client(decode_url);
      auto dr = dc->Post(path, headers, payload, "application/json");
      if (!dr)
        return send_error(res, 502, "decode server " + decode_url + ": " + httplib::to_string(dr.error()),
                          "BadGatewayError");
      res.status = dr->status;
      res.set_content(dr->body, "application/json");
      return;
    }
    // Streams are relayed as the decode server writes them.
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, decode_lease, decode_url, path, headers, payload](size_t, httplib::DataSink& sink) {
          auto dc = client(decode_url);
          httplib::Request r;
          r.method = "POST";
          r.path = path;
          r.headers = headers;
          r.body = payload;
          r.set_header("Content-Type", "application/json");
          int status = 0;
          std::string error_body;
          r.response_handler = [&status](const httplib::Response& x) {
            status = x.status;
            return true;
          };
          r.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
            if (status != 200) {
              error_body.append(data, n);
              return true;
            }
            return sink.write(data, n);  // false: the client went away, stop reading
          };
          httplib::Response dres;
          httplib::Error err = httplib::Error::Success;
          const bool ok = dc->send(r, dres, err);
          if (!ok && err != httplib::Error::Canceled) {
            const std::string msg = nlohmann::json{{"error", {{"message", "decode server " + decode_url + ": " +
                                                                                httplib::to_string(err)},
                                                               {"type", "BadGatewayError"}}}}
                                        .dump();
            const std::string event = "data: " + msg + "\n\n";
            sink.write(event.data(), event.size());
          } else if (status != 200) {
            const std::string event = "data: " + error_body + "\n\n";
            sink.write(event.data(), event.size());
          }
          sink.done();
          return true;
        });
  }

  void forward_get(const httplib::Request& req, httplib::Response& res) {
    const std::string url = o_.decode.front();
    httplib::Headers headers;
    if (req.has_header("Authorization")) headers.emplace("Authorization", req.get_header_value("Authorization"));
    auto r = client(url)->Get(req.path, headers);
    if (!r) return send_error(res, 502, "decode server " + url + ": " + httplib::to_string(r.error()), "BadGatewayError");
    res.status = r->status;
    res.set_content(r->body, r->get_header_value("Content-Type").empty() ? "application/json"
                                                                          : r->get_header_value("Content-Type"));
  }

 private:
  std::unique_ptr<httplib::Client> client(const std::string& url) const {
    auto c = std::make_unique<httplib::Client>(url);
    const auto sec = time_t(o_.timeout_s);
    c->set_connection_timeout(sec);
    c->set_read_timeout(sec);
    c->set_write_timeout(sec);
    return c;
  }
  ProxyOptions o_;
  BackendPicker prefill_, decode_;
};

void run_proxy(const ProxyOptions& o) {
  for (const auto& list : {&o.prefill, &o.decode})
    for (const std::string& url : *list)
      if (url.rfind("http://", 0) != 0 || !httplib::Client(url).is_valid())
        throw std::runtime_error("'" + url + "' is not an http://host:port URL");
  signal(SIGPIPE, SIG_IGN);
  Proxy proxy(o);
  httplib::Server http;
  http.new_task_queue = [] { return new httplib::ThreadPool(256); };
  http.set_payload_max_length(size_t(64) << 20);
  http.set_read_timeout(30, 0);
  http.set_keep_alive_timeout(30);
  for (const char* path : {"/v1/completions", "/v1/chat/completions"})
    http.Post(path, [&proxy, p = std::string(path)](const httplib::Request& req, httplib::Response& res) {
      proxy.generation(req, res, p);
    });
  http.Get("/v1/models", [&proxy](const httplib::Request& req, httplib::Response& res) { proxy.forward_get(req, res); });
  http.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.status = 200; });
  if (!http.bind_to_port(o.host, o.port)) throw std::runtime_error("cannot listen on " + o.host + ":" + std::to_string(o.port));
  std::string line = "disaggregated prefill proxy on http://" + o.host + ":" + std::to_string(o.port) + ": prefill";
  for (const auto& u : o.prefill) line += " " + u;
  line += ", decode";
  for (const auto& u : o.decode) line += " " + u;
  M3_LOG_INFO(line);
  http.listen_after_bind();
}

}  // namespace

void register_disagg_proxy_command(CLI::App& app) {
  auto o = std::make_shared<ProxyOptions>();
  auto* cmd = app.add_subcommand(
      "disagg-proxy",
      "Route OpenAI requests through a prefill server (--kv-transfer-config kv_producer) and a decode server "
      "(kv_consumer): the decode server fetches the prompt's KV blocks instead of computing them");
  cmd->add_option("--prefill", o->prefill, "prefill server base URL (repeat for several: the one with the fewest requests in flight is taken)")
      ->required();
  cmd->add_option("--decode", o->decode, "decode server base URL (repeat for several)")->required();
  cmd->add_option("--host", o->host)->capture_default_str();
  cmd->add_option("--port", o->port)->capture_default_str();
  cmd->add_option("--timeout", o->timeout_s, "seconds a backend may take to answer")->capture_default_str();
  cmd->callback([o] { run_proxy(*o); });
}

}  // namespace m3::server
