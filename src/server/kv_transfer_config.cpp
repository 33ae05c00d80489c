#include "server/kv_transfer_config.h"

#include <nlohmann/json.hpp>

namespace m3::server {

std::optional<std::string> parse_kv_transfer_config(const std::string& text, const std::string& host, int port,
                                                    ServerOptions::KvTransfer& out, EngineConfig& engine) {
  const std::string where = "--kv-transfer-config: ";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    return where + "not valid JSON: " + e.what();
  }
  if (!j.is_object()) return where + "must be a JSON object";
  for (auto it = j.begin(); it != j.end(); ++it) {
    static const char* const kKnown[] = {"kv_connector", "kv_role", "kv_buffer_size", "kv_ip", "kv_port",
                                         "kv_load_failure_policy", "kv_connector_extra_config"};
    bool known = false;
    for (const char* k : kKnown) known = known || it.key() == k;
    if (!known) return where + "unknown key '" + it.key() + "'";
  }
  if (j.contains("kv_connector")) {
    if (!j["kv_connector"].is_string()) return where + "kv_connector must be a string";
    const std::string c = j["kv_connector"].get<std::string>();
    if (c != "M3HttpConnector" && c != "M3CudaIpcConnector")
      return where + "kv_connector " + c +
             " is not built into m3serve; M3HttpConnector (KV blocks fetched over HTTP from the prefill server) and "
             "M3CudaIpcConnector (pages copied from the prefill server's GPU memory, servers of one host) are";
    out.device = c == "M3CudaIpcConnector";
  }
  if (!j.contains("kv_role") || !j["kv_role"].is_string()) return where + "kv_role (a string) is required";
  const std::string role = j["kv_role"].get<std::string>();
  if (role != "kv_producer" && role != "kv_consumer" && role != "kv_both")
    return where + "kv_role must be kv_producer, kv_consumer or kv_both, got '" + role + "'";
  out.producer = role != "kv_consumer";
  out.consumer = role != "kv_producer";
  if (j.contains("kv_buffer_size")) {
    if (!j["kv_buffer_size"].is_number() || j["kv_buffer_size"].get<double>() < 1)
      return where + "kv_buffer_size must be a number of bytes >= 1";
    out.buffer_bytes = size_t(j["kv_buffer_size"].get<double>());
  }
  // M3CudaIpcConnector: a producer's exported pages wait in this much device memory per rank
  // (kv_buffer_size, 1 GiB by default; an export that does not fit goes through host memory).
  if (out.device && role != "kv_consumer")
    engine.kv_export_device_bytes = j.contains("kv_buffer_size") ? int64_t(out.buffer_bytes) : int64_t(1) << 30;
  std::string ip = host == "0.0.0.0" || host == "::" || host.empty() ? "127.0.0.1" : host;
  if (j.contains("kv_ip")) {
    if (!j["kv_ip"].is_string() || j["kv_ip"].get<std::string>().empty()) return where + "kv_ip must be a host name";
    ip = j["kv_ip"].get<std::string>();
  }
  int advertised_port = port;
  if (j.contains("kv_port")) {
    if (!j["kv_port"].is_number_integer() || j["kv_port"].get<int>() < 1 || j["kv_port"].get<int>() > 65535)
      return where + "kv_port must be a port number";
    advertised_port = j["kv_port"].get<int>();
  }
  out.advertise_url = "http://" + ip + ":" + std::to_string(advertised_port);
  if (j.contains("kv_load_failure_policy")) {
    const auto& p = j["kv_load_failure_policy"];
    if (!p.is_string() || (p.get<std::string>() != "recompute" && p.get<std::string>() != "fail"))
      return where + "kv_load_failure_policy must be recompute or fail";
    out.fail_on_load_error = p.get<std::string>() == "fail";
  }
  if (j.contains("kv_connector_extra_config")) {
    const auto& x = j["kv_connector_extra_config"];
    if (!x.is_object()) return where + "kv_connector_extra_config must be an object";
    for (auto it = x.begin(); it != x.end(); ++it) {
      if (it.key() != "transfer_timeout_s") return where + "kv_connector_extra_config: unknown key '" + it.key() + "'";
      if (!it->is_number() || it->get<double>() <= 0) return where + "transfer_timeout_s must be a number > 0";
      out.timeout_ms = int64_t(it->get<double>() * 1000.0);
    }
  }
  if (out.producer && !engine.enable_prefix_caching)
    return where + "a KV producer keeps the prompt's cached blocks: it needs prefix caching (drop "
                   "--no-enable-prefix-caching)";
  // A consumer writes fetched blocks into the host KV tier; give it one when none was asked for.
  if (out.consumer && engine.kv_offload_bytes == 0) engine.kv_offload_bytes = int64_t(1) << 30;
  if (out.consumer && !engine.enable_prefix_caching)
    return where + "a KV consumer finds fetched blocks through the prefix cache: it needs prefix caching";
  return std::nullopt;
}

}  // namespace m3::server
