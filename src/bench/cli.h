#pragma once
// Subcommands for the m3serve binary: `bench serve`, `bench replay` and `eval gsm8k`.
// Each parses its flags into a config and runs it from its CLI11 callback; a failure prints
// the reason and ends the parse with CLI::RuntimeError(1), which main's app.exit() returns.
#include <CLI/CLI.hpp>

void register_bench_commands(CLI::App& app);
void register_eval_commands(CLI::App& app);
