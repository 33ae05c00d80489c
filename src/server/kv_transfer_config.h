#pragma once
// vLLM's --kv-transfer-config JSON for `m3serve serve` (disaggregated prefill): {"kv_connector":
// "M3HttpConnector" | "M3CudaIpcConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_buffer_size": BYTES,
// "kv_ip": HOST, "kv_port": PORT, "kv_load_failure_policy": "recompute" | "fail",
// "kv_connector_extra_config": {"transfer_timeout_s": S}}.
#include <optional>
#include <string>

#include "m3serve/engine.h"
#include "server/routes.h"

namespace m3::server {

// Fills `out` (and, for a consumer without a host KV tier, engine.kv_offload_bytes), or returns
// what is wrong with the text. host / port: where this server listens (the advertised URL's
// defaults).
std::optional<std::string> parse_kv_transfer_config(const std::string& text, const std::string& host, int port,
                                                    ServerOptions::KvTransfer& out, EngineConfig& engine);

}  // namespace m3::server
