#pragma once
// `m3serve serve [MODEL_DIR]`: the OpenAI-compatible HTTP server. Flags follow `vllm serve`.
#include <CLI/CLI.hpp>

#include <functional>
#include <memory>

#include "m3serve/engine.h"
#include "tokenizer/tokenizer.h"

namespace m3::server {

// Builds the engine the server runs; the default is Engine::create (tests substitute theirs).
using EngineFactory = std::function<Result<std::unique_ptr<Engine>>(const EngineConfig&, const Tokenizer&)>;

void register_serve_command(CLI::App& app, EngineFactory factory = {});

}  // namespace m3::server
