#pragma once
// `m3serve disagg-proxy`: the entry point of disaggregated prefill. Each completion or chat
// request goes first to a prefill server (kv_producer) as a one-token request that keeps its
// prompt's KV blocks, then, with the transfer id the prefill answered, to a decode server
// (kv_consumer) that fetches those blocks and generates the answer, which the proxy relays
// (streamed or not). Of several servers of a kind, the one with the fewest of the proxy's requests
// in flight is taken.
#include <CLI/CLI.hpp>

namespace m3::server {

void register_disagg_proxy_command(CLI::App& app);

}  // namespace m3::server
