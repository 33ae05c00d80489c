#pragma once
// `m3serve serve [MODEL_DIR]`: the OpenAI-compatible HTTP server. Flags follow `vllm serve`.
#include <CLI/CLI.hpp>

namespace m3::server {

void register_serve_command(CLI::App& app);

}  // namespace m3::server
