// m3serve: one binary, subcommands in the style users know from vLLM.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "app/commands.h"
#include "core/log.h"
#ifdef M3_HAVE_M3_BENCH
#include "bench/cli.h"
#endif
#ifdef M3_HAVE_M3_SERVER
#include "server/cli.h"
#include "server/disagg_proxy.h"
#endif

int main(int argc, char** argv) {
  CLI::App app{"m3serve: a serving engine for MiniMax-M3 (MSA + MoE)"};
  app.require_subcommand(1);
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "debug | info | warn | error")->check(CLI::IsMember({"debug", "info", "warn", "error"}));
  app.parse_complete_callback([&] {
    m3::set_log_level(log_level == "debug" ? m3::LogLevel::kDebug
                      : log_level == "warn" ? m3::LogLevel::kWarn
                      : log_level == "error" ? m3::LogLevel::kError
                                             : m3::LogLevel::kInfo);
  });
  m3::app::register_make_model(app);
  m3::app::register_make_draft(app);
  m3::app::register_generate(app);
  m3::app::register_kernel_paths(app);
#ifdef M3_HAVE_M3_SERVER
  m3::server::register_serve_command(app);
  m3::server::register_disagg_proxy_command(app);
#endif
#ifdef M3_HAVE_M3_BENCH
  register_bench_commands(app);
  register_eval_commands(app);
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "m3serve: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
