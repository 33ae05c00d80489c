// m3serve_scripted --script FILE serve MODEL_DIR [serve flags]: the real `serve` command with
// the scripted engine in place of the model, for e2e tests that need known output.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "chat/chat_template.h"
#include "scripted_engine.h"
#include "server/cli.h"

int main(int argc, char** argv) {
  CLI::App app{"m3serve_scripted: test server answering every request with a fixed script"};
  std::string script_path;
  app.add_option("--script", script_path, "text whose tokens every request receives, then EOS")->required();
  int step_delay_ms = 0;
  app.add_option("--step-delay-ms", step_delay_ms, "each engine step sleeps this long (a slow model)");
  app.require_subcommand(1);
  m3::server::register_serve_command(app, [&](const m3::EngineConfig& config, const m3::Tokenizer& tokenizer)
                                              -> m3::Result<std::unique_ptr<m3::Engine>> {
    std::ifstream in(script_path, std::ios::binary);
    if (!in) return m3::Status::error("cannot read " + script_path);
    std::stringstream text;
    text << in.rdbuf();
    auto eos = tokenizer.token_to_id(m3::kEndOfMessage);
    if (!eos) return m3::Status::error("the tokenizer has no end-of-message token");
    m3::server::ScriptedEngineConfig sc;
    sc.script = tokenizer.encode(text.str(), /*allow_special=*/true);
    sc.vocab_size = tokenizer.vocab_size();
    sc.max_model_len = config.max_model_len > 0 ? config.max_model_len : 4096;
    sc.eos_token_id = *eos;
    sc.step_delay_ms = step_delay_ms;
    return m3::server::make_scripted_engine(std::move(sc));
  });
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "m3serve_scripted: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
